"""Redis faults for `edgekv bench faults`: a Redis stopped and restarted mid-run, a Redis full
(`maxmemory` with `allkeys-lru`, then with `noeviction`), a Redis Cluster node stopped mid-run.

Each fault runs the real engine over a real `RedisStore` on real redis-server processes
(`redis_servers`, loopback, free ports, the work directory) and makes the fault with the
process itself: SIGKILL, `CONFIG SET maxmemory`. Every answer is compared with its prompt's cold
output (`faults.cold_outputs`: the real engine, no cache, same run). Entries are "acknowledged"
when the store's `put` returned; an acknowledged entry that cannot be read afterwards is lost,
unless the fault explains it: keys Redis reported evicting (keyspace notifications) are
`evicted_entries`, keys on a stopped server or cluster node are `unavailable_entries` while
it is down (checked by key before the restart). `recovery_s` is the median, `recovery_s_max`
the worst, over the fault's recoveries, of the time from the server being back (restarted; for
a full Redis, from the first write after the memory is freed) to the store's first cache hit,
provided a request then reuses as much as the same prompt reused before the fault
(`full_reuse_s`: to the end of that request, engine time included); a recovery that never came
within the asks allowed is counted in `not_recovered` and makes `recovery_s_max` None.
`kills_during_request`: kills that landed while a request ran (the request must still answer).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekv.config import CacheConfig
from edgekv.core.pipeline import EdgeKV
from edgekv.errors import StoreError
from edgekv.fragment import KVFragment
from edgekv.store.base import FragmentStore, Hit
from edgekv.store.redis import RedisStore

from . import redis_servers as rs
from .faults_kit import DEFAULTS, cold_outputs, fault_prompts, make_row, new_cache_dir

__all__ = ["FAULTS", "Engine", "cluster_node_down", "full", "real_engine", "restart"]

log = logging.getLogger(__name__)

# `redis_full` caps maxmemory at Redis' own use plus this share of what the first half of the
# prompts' entries took: full from then on (the prompts share prefixes, so the second half
# alone adds too little to overflow a cap above the first half's use)
FILL = 0.6


class AckedRedisStore(RedisStore):
    """A `RedisStore` that remembers the keys whose `put` returned (the acknowledged entries)
    and when it first served a hit after `arm()` (the recovery time's end)."""

    def __init__(self, url: str, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.acked: set[str] = set()
        self.first_hit: float | None = None
        self._armed: str | None = None  # "": any hit; else only hits on that server

    def put(self, key: str, fragment: KVFragment) -> None:
        super().put(key, fragment)
        self.acked.add(key)

    def put_many(self, items: Sequence[tuple[str, KVFragment]]) -> None:
        """The batched write (what the writeback stores through): acknowledged once it
        returns (on a single Redis all of them at once, or none and `StoreError`; on a
        cluster each by its own `put`)."""
        super().put_many(items)
        self.acked.update(key for key, _ in items)

    def get(self, key: str, now: float | None = None) -> KVFragment | None:
        frag = super().get(key, now)
        if frag is not None and self._armed is not None and (
                not self._armed or self.server_of(key) == self._armed):
            self.first_hit, self._armed = time.monotonic(), None
        return frag

    def get_many(self, keys: Sequence[str], now: float | None = None, *,
                 prefix: bool = False) -> list[Hit | None]:
        """The batched chain walk (what the cache reads through): its hits count too."""
        hits = super().get_many(keys, now, prefix=prefix)
        for key, hit in zip(keys, hits):
            if hit is not None and self._armed is not None and (
                    not self._armed or self.server_of(key) == self._armed):
                self.first_hit, self._armed = time.monotonic(), None
        return hits

    def arm(self, server: str = "") -> float:
        """Start timing a recovery: now, and the time of the next hit (on `server`, if given:
        a restarted cluster node) lands in `first_hit`."""
        self.first_hit, self._armed = None, server
        return time.monotonic()


@dataclass
class Engine:
    """The engine side of a fault run: an EdgeKV over a given store, the prompts, their cold
    outputs. `real_engine` builds it on llama.cpp; the tests build it on the fake engine."""

    make_kv: Callable[[FragmentStore], EdgeKV]
    prompts: list[str]
    cold: list[list[int]]
    max_tokens: int
    close: Callable[[], None] = lambda: None


def real_engine(work: Path, opts: dict[str, Any]) -> Engine:
    from edgekv.engines import open_adapter

    o = {**DEFAULTS, **opts}
    prompts = fault_prompts(o["requests"], o["seed"])
    cold = cold_outputs(prompts, o)
    cfg = CacheConfig.from_env(cache_dir=new_cache_dir(work / "cache"))
    adapter = open_adapter("llamacpp", o["model"], n_ctx=o["n_ctx"], memo_dir=cfg.cache_dir)
    return Engine(lambda store: EdgeKV(adapter, store, cfg), prompts, cold, o["max_tokens"],
                  adapter.close)


@dataclass
class Tally:
    """Requests asked, wrong answers, requests that did not complete, log records."""

    eng: Engine
    kv: EdgeKV
    requests: int = 0
    wrong: int = 0
    lost: int = 0
    logged: Counter[str] = field(default_factory=Counter)
    muted: bool = False  # while the harness itself reads the store (its logs are not counted)
    last_s: float = 0.0  # how long the last request took
    after: list[int] = field(default_factory=list)  # tokens reused by `until_reuse`'s asks
    kills_during_request: int = 0  # `ask_while` faults that landed before the answer

    def ask(self, i: int) -> int:
        """Answer prompt `i`; return the tokens it reused (-1 if the request failed)."""
        self.requests += 1
        t0 = time.perf_counter()
        try:
            r = self.kv.generate(self.eng.prompts[i], max_tokens=self.eng.max_tokens)
        except Exception as e:  # noqa: BLE001 - a lost request is what this counts
            log.error("request %d failed: %s", i, e)
            self.lost += 1
            return -1
        finally:
            self.last_s = time.perf_counter() - t0
        if list(r.tokens) != self.eng.cold[i]:
            self.wrong += 1
        return r.cached_tokens

    def ask_while(self, i: int, fault: Callable[[], None], rng: random.Random) -> int:
        """Ask prompt `i` and make `fault` happen during it: at a random point within the
        last request's duration (a kill lands inside the request, or just after it: counted
        in `kills_during_request` when inside)."""
        running = threading.Event()

        def kill() -> None:
            inside = running.is_set()
            fault()
            self.kills_during_request += inside

        killer = threading.Timer(rng.uniform(0.0, self.last_s), kill)
        running.set()
        killer.start()
        try:
            return self.ask(i % len(self.eng.prompts))
        finally:
            running.clear()
            killer.join()

    def pass_over(self, n: int | None = None) -> list[int]:
        m = len(self.eng.prompts)
        return [self.ask(i % m) for i in range(m if n is None else n)]

    def until_reuse(self, i: int, want: int, tries: int) -> int:
        """Ask prompt `i` until it reuses `want` tokens; how many asks that took (or -1)."""
        self.after = []
        for t in range(tries):
            self.after.append(self.ask(i))
            if self.after[-1] >= want:
                return t + 1
        return -1


@contextmanager
def counting_logs(tally: Tally) -> Iterator[None]:
    """Count WARNING+ records of `edgekv.*` by logger name into `tally.logged`."""
    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not tally.muted:
                tally.logged[record.name] += 1

    h, lg = H(logging.WARNING), logging.getLogger("edgekv")
    lg.addHandler(h)
    try:
        yield
    finally:
        lg.removeHandler(h)


def _row(fault: str, t: Tally, store: RedisStore, *, runs: int, lost_entries: int,
         recovery: list[float], how: str, **extra: Any) -> dict[str, Any]:
    return make_row(
        fault, runs=runs, requests=t.requests, wrong_outputs=t.wrong, lost_requests=t.lost,
        lost_entries=lost_entries, recovery_s=recovery, how=how,
        recovery_each_s=[round(r, 3) for r in recovery],
        kills_during_request=t.kills_during_request,
        errors_logged=t.logged["edgekv.store.redis"], errors_counted=store.stats().errors,
        other_warnings={k: v for k, v in t.logged.items() if k != "edgekv.store.redis"},
        **extra)


def _recovery(store: AckedRedisStore, back: float, tries: int) -> float:
    """Seconds from `back` to the store's first hit (-1: no request got its reuse back)."""
    return store.first_hit - back if tries > 0 and store.first_hit is not None else -1.0


def _unreadable(url: str, keys: set[str], t: Tally) -> set[str]:
    """Of `keys`, those a fresh store cannot read (verified decode) right now; its log
    records are not the run's."""
    t.muted = True
    try:
        check = RedisStore(url)
    except StoreError:  # nothing answers at `url` (a server that is down): none is readable
        t.muted = False
        return set(keys)
    try:
        return {k for k in keys if check.get(k) is None}
    finally:
        check.close()
        t.muted = False


# -- the faults ------------------------------------------------------------------------------

def restart(eng: Engine, work: Path, opts: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL the Redis mid-run, keep asking for `duration / restarts` seconds (at least
    `requests` requests), start it again on the same port and append-only file."""
    o = {**DEFAULTS, **opts}
    cycles = max(1, int(o.get("redis_restarts", min(int(o["kills"]), 3))))
    outage_s = float(o["duration"]) / cycles
    rng = random.Random(o["seed"])
    srv = rs.RedisServer(work / "redis", "--appendonly", "yes", "--appendfsync", "always")
    srv.start()
    try:
        store = AckedRedisStore(srv.url)
        t = Tally(eng, eng.make_kv(store))
        lost, recovery, full_reuse = 0, [], []
        unavailable: set[str] = set()  # acknowledged keys unreadable during any outage
        with counting_logs(t):
            for _ in range(cycles):
                t.pass_over()
                want = t.ask(0)  # what prompt 0 reuses while Redis is up
                t.ask_while(1, lambda: srv.stop(kill=True), rng)  # dies mid-request
                acked = set(store.acked)  # what it acknowledged before it died
                t0 = time.monotonic()
                while True:  # at least `requests` requests, at least `outage_s` seconds
                    t.pass_over(o["requests"])
                    if time.monotonic() - t0 >= outage_s:
                        break
                unavailable |= _unreadable(srv.url, acked, t)  # while it is down
                srv.start()
                back = store.arm()
                tries = t.until_reuse(0, want, 5 * o["requests"])
                recovery.append(_recovery(store, back, tries))
                full_reuse.append(time.monotonic() - back if tries > 0 else -1.0)
                lost += len(_unreadable(srv.url, acked, t))
        return _row("redis_restart", t, store, runs=cycles, lost_entries=lost, recovery=recovery,
                    how="redis-server (appendonly, appendfsync always) killed with SIGKILL "
                        "at a random point of a request, restarted on the same port and files "
                        "after the outage",
                    acked_entries=len(store.acked), unavailable_entries=len(unavailable),
                    full_reuse_s=[round(r, 3) for r in full_reuse])
    finally:
        srv.stop()


def _watch_evictions(srv: rs.RedisServer, prefix: str, out: set[str],
                     stop: threading.Event) -> threading.Thread:
    """Collect the store keys Redis evicts (keyevent notifications) into `out`."""
    r = srv.client()
    r.config_set("notify-keyspace-events", "Ee")
    ps = r.pubsub()
    ps.subscribe("__keyevent@0__:evicted")
    head = f"{prefix}:frag:"

    def run() -> None:
        while not stop.is_set():
            m = ps.get_message(timeout=0.2)
            if m and m["type"] == "message":
                k = m["data"].decode()
                if k.startswith(head):
                    out.add(k[len(head):].replace("{", "", 1).replace("}", "", 1))
        ps.close()
        r.close()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def full(eng: Engine, work: Path, opts: dict[str, Any]) -> dict[str, Any]:
    """Fill the store with half the prompts, cap `maxmemory` below what Redis then uses (`FILL`
    of the entries' memory), run the other half and everything again, lift the cap; once with
    `allkeys-lru` (Redis evicts) and once with `noeviction` (Redis refuses the writes)."""
    half = max(1, len(eng.prompts) // 2)
    per: dict[str, dict[str, Any]] = {}
    total_req = total_wrong = total_lost_req = lost = 0
    recovery: list[float] = []
    for policy in ("allkeys-lru", "noeviction"):
        srv = rs.RedisServer(work / policy, "--appendonly", "no", "--maxmemory-policy", policy)
        srv.start()
        evicted: set[str] = set()
        stop = threading.Event()
        watcher = _watch_evictions(srv, "edgekv", evicted, stop)
        admin = srv.client()
        try:
            store = AckedRedisStore(srv.url)
            t = Tally(eng, eng.make_kv(store))
            with counting_logs(t):
                base = int(admin.info("memory")["used_memory"])
                for i in range(half):
                    t.ask(i)
                used = int(admin.info("memory")["used_memory"])
                cap = base + int((used - base) * FILL)
                admin.config_set("maxmemory", cap)
                for i in range(half, len(eng.prompts)):
                    t.ask(i)
                t.pass_over()
                refused = store.stats().errors
                want = t.ask(len(eng.prompts) - 1)  # reuse while full (0 if never written)
                admin.config_set("maxmemory", 0)
                t.ask(len(eng.prompts) - 1)  # written now that there is room
                back = store.arm()  # from its write to the first hit (the next request)
                tries = t.until_reuse(len(eng.prompts) - 1, max(want, 1), 3)
                recovery.append(_recovery(store, back, tries))
            time.sleep(0.3)  # the last eviction notices
            stop.set()
            watcher.join()
            gone = _unreadable(srv.url, store.acked, t)
            lost += len(gone - evicted)
            per[policy] = {
                "maxmemory_bytes": cap, "acked_entries": len(store.acked),
                "evicted_entries": len(gone & evicted), "lost_entries": len(gone - evicted),
                "evicted_keys_info": int(admin.info("stats")["evicted_keys"]),
                "errors_counted": store.stats().errors, "errors_while_full": refused,
                "errors_logged": t.logged["edgekv.store.redis"],
                "other_warnings": dict(t.logged), "requests": t.requests,
                "wrong_outputs": t.wrong, "lost_requests": t.lost}
            total_req += t.requests
            total_wrong += t.wrong
            total_lost_req += t.lost
        finally:
            stop.set()
            admin.close()
            srv.stop()
    return make_row(
        "redis_full", runs=2, requests=total_req, wrong_outputs=total_wrong,
        lost_requests=total_lost_req, lost_entries=lost, recovery_s=recovery,
        how=f"maxmemory set to Redis' own use plus {FILL:.0%} of what half the prompts' entries "
            "used, then the other half and all again: "
            "allkeys-lru evicts (evicted keys come from keyevent notifications), noeviction "
            "refuses writes with OOM (puts fail, reads still serve)",
        recovery_each_s=[round(r, 3) for r in recovery],
        evicted_entries=sum(p["evicted_entries"] for p in per.values()),
        errors_logged=sum(p["errors_logged"] for p in per.values()),
        errors_counted=sum(p["errors_counted"] for p in per.values()), policies=per)


def cluster_node_down(eng: Engine, work: Path, opts: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL one node of a three-node cluster mid-run (the one holding the most entries),
    keep asking, check what the other nodes still serve, restart it."""
    o = {**DEFAULTS, **opts}
    c = rs.RedisCluster3(work / "cluster", persist=True)
    c.start()
    try:
        store = AckedRedisStore(c.url)
        t = Tally(eng, eng.make_kv(store))
        with counting_logs(t):
            t.pass_over()
            want = t.ask(0)
            owner = _owners(store, c, store.acked)
            victim = Counter(owner.values()).most_common(1)[0][0]
            t.ask_while(1, lambda: c.nodes[victim].stop(kill=True), random.Random(o["seed"]))
            acked = set(store.acked)  # what the cluster acknowledged before the node died
            owner = _owners(store, c, acked)
            on_victim = {k for k, n in owner.items() if n == victim}
            t0 = time.monotonic()
            outage_reuse = []
            while True:
                outage_reuse += t.pass_over(o["requests"])
                if time.monotonic() - t0 >= float(o["duration"]):
                    break
            unreadable_down = _unreadable(c.url, acked, t)
            c.restart(victim)
            back = store.arm(c.nodes[victim].address)  # a hit on the restarted node
            tries = t.until_reuse(0, want, 5 * o["requests"])
            recovery = [_recovery(store, back, tries)]
            full_reuse = time.monotonic() - back if tries > 0 else -1.0
            unreadable_after = _unreadable(c.url, acked, t)
        return _row("redis_cluster_node_down", t, store, runs=1,
                    lost_entries=len(unreadable_down - on_victim) + len(unreadable_after),
                    recovery=recovery,
                    how="3 masters, no replicas, cluster-require-full-coverage no, appendfsync "
                        "always; the node holding the most entries killed with SIGKILL at a "
                        "random point of a request, restarted after the outage",
                    acked_entries=len(acked), unavailable_entries=len(unreadable_down & on_victim),
                    entries_on_stopped_node=len(on_victim),
                    outage_requests_with_reuse=sum(r > 0 for r in outage_reuse),
                    reuse_before=want, reuse_after=t.after,
                    full_reuse_s=round(full_reuse, 3))
    finally:
        c.stop()


def _owners(store: RedisStore, c: rs.RedisCluster3, keys: set[str]) -> dict[str, int]:
    """Which node of `c` holds each key, from the cluster's own slot map."""
    names = [n.address for n in c.nodes]
    return {k: names.index(store.server_of(k)) for k in keys}


def _real(fn: Callable[[Engine, Path, dict[str, Any]], dict[str, Any]]
          ) -> Callable[[Path, dict[str, Any]], dict[str, Any]]:
    def run(work: Path, opts: dict[str, Any]) -> dict[str, Any]:
        work.mkdir(parents=True, exist_ok=True)
        eng = real_engine(work, opts)
        try:
            return fn(eng, work, opts)
        finally:
            eng.close()

    run.__doc__ = fn.__doc__
    return run


FAULTS: dict[str, Callable[[Path, dict[str, Any]], dict[str, Any]]] = {
    "redis_restart": _real(restart),
    "redis_full": _real(full),
    "redis_cluster_node_down": _real(cluster_node_down),
}
