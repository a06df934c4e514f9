"""Redis tier: fragments shared by several KV-server processes (or devices on one LAN box), on
one Redis (`redis://HOST:PORT/DB`) or a Redis Cluster (`redis-cluster://HOST:PORT,HOST:PORT`).

Each fragment is one Redis string holding the self-verifying serial blob (so a damaged value
is a logged miss, as on disk), expiring through Redis' own TTL (PEXPIREAT); lifecycle fields
live in a small hash beside it, and a hash per parent chunk lists its successors with their
tokens for the radix step. Capacity is Redis' `maxmemory` with an eviction policy, set on the
server; `stats()` reports what Redis holds under this store's prefix.

Keys carry a Redis Cluster hash tag, the chunk's chain key: `edgekv:frag:{<chain>}.L0-15`,
`edgekv:meta:{<chain>}.L0-15`, and `edgekv:children:{<chain>}` for the successors of that
chunk. So every layer group of a chunk, its lifecycle hash and the list of what follows it
share one slot, and a put is one MULTI/EXEC in the chunk's slot (fragment and metadata land
together or not at all, also when a full Redis refuses writes) plus one HSET in the parent's
slot. On a single Redis the tags are plain characters.

Redis is a cache under every request, never a dependency of it: a failed call is a miss (or a
`StoreError` from `put`, which the writeback logs and drops), the request computes locally.
The first failure of an outage is logged once, the rest are counted in `stats().errors`
until a call succeeds again; a refused write (a full Redis) is logged once per kind of
refusal. A stopped server refuses connections at once, so every call tries it (and the first
after a restart succeeds); a hung one (a timeout) is not tried again for `retry_s`, so it
costs one timeout per `retry_s`, not one per call.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from ..errors import StoreError
from ..fragment import KVFragment
from ..serial import encode_fragment
from .base import Entry, FragmentStore, Hit, StoreStats, check_key, decode_or_miss, live_or_miss

__all__ = ["RedisStore", "cluster_nodes", "redact"]

log = logging.getLogger(__name__)

CLUSTER_SCHEME = "redis-cluster://"


def redact(url: str) -> str:
    """`url` without a password (`redis://user:secret@host` -> `redis://user:***@host`): what
    logs and errors may show."""
    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """`redis-cluster://host:port,host:port,...` as (host, port) pairs (any one node is
    enough to find the others; list several so that one down node does not stop a start)."""
    if not url.startswith(CLUSTER_SCHEME):
        raise StoreError(f"{url!r} is not a {CLUSTER_SCHEME}HOST:PORT,HOST:PORT,... URL")
    out = []
    for part in url[len(CLUSTER_SCHEME):].split("/")[0].split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise StoreError(f"cluster node {part!r} in {url!r} is not HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    return out


class RedisStore(FragmentStore):
    name = "redis"
    self_evicting = True  # maxmemory and its policy, on the server; shared by processes

    def __init__(self, url: str, *, prefix: str = "edgekv", timeout_s: float = 2.0,
                 retry_s: float = 1.0) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:  # pragma: no cover
            raise StoreError("the redis client is missing: `pip install redis`") from e
        # one quick retry (a pooled connection that died with a restarted server reconnects),
        # no backoff: a request never sleeps on the cache
        opts: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                    retry=Retry(NoBackoff(), 1))
        self.cluster = url.startswith(CLUSTER_SCHEME)
        if self.cluster:
            from redis.cluster import ClusterNode, RedisCluster

            nodes = [ClusterNode(h, p) for h, p in cluster_nodes(url)]
            make: Callable[[], Any] = lambda: RedisCluster(  # noqa: E731
                startup_nodes=nodes, require_full_coverage=False, **opts)
        else:
            make = lambda: redis.Redis.from_url(url, **opts)  # noqa: E731
        from redis.exceptions import ClusterDownError, RedisClusterException

        self._errors = (redis.RedisError, OSError, RedisClusterException)
        self._down_errors = (redis.ConnectionError, redis.TimeoutError, OSError,
                             ClusterDownError, RedisClusterException)
        self._slow_errors = (redis.TimeoutError, TimeoutError)
        self._oom_errors = (redis.exceptions.OutOfMemoryError,)
        try:
            self._r: Any = make()
            if not self.cluster:  # a cluster client read the slot map from a node already
                self._r.ping()  # (a cluster PING asks every node: one down would refuse)
        except self._errors as e:
            raise StoreError(f"cannot reach Redis at {redact(url)}: {e}. Is redis-server running"
                             f"{' (every node of the cluster)' if self.cluster else ''}?") from e
        self.url, self.prefix, self.retry_s = url, prefix, retry_s
        self.where = redact(url)  # the single server's name in logs (no password)
        self._stats = StoreStats(tier="redis")
        self._listeners: list[Callable[[str], None]] = []
        self._failing: set[tuple[str, str]] = set()  # (server, "unreachable" | error type)
        self._skip_until: dict[str, float] = {}  # server -> monotonic time of the next try
        self._last_size = (0, 0)
        # requests sent: a command or a pipeline each (a cluster pipeline writes to every
        # node it needs, then reads their answers: one round trip, nodes in parallel)
        self.round_trips = 0
        self._pool: Any = None  # threads for the calls to several cluster nodes at once

    # -- keys ------------------------------------------------------------------------------

    def _k(self, kind: str, key: str) -> str:
        """The Redis key of `kind` for store key `key`, tagged by its chain key."""
        chain, dot, rest = key.partition(".")
        return f"{self.prefix}:{kind}:{{{chain}}}{dot}{rest}"

    def _store_key(self, redis_key: bytes, kind: str = "frag") -> str:
        return redis_key.decode()[len(self.prefix) + len(kind) + 2:].replace("{", "", 1) \
            .replace("}", "", 1)

    def slot(self, key: str) -> int:
        """The cluster slot of `key`'s entries (its chain key's hash tag)."""
        from redis.crc import key_slot

        return int(key_slot(self._k("frag", key).encode()))

    # -- failures --------------------------------------------------------------------------

    def server_of(self, key: str | None) -> str:
        """The server (`host:port` of the cluster node) that holds `key`'s entries; on a single
        Redis, its URL without a password. Failures are logged and skipped per server."""
        if not self.cluster or key is None:
            return self.where
        try:
            return str(self._r.nodes_manager.get_node_from_slot(self.slot(key)).name)
        except Exception:  # noqa: BLE001 - slot map in flux: the cluster as a whole
            return self.where

    def _skipping(self, server: str) -> bool:
        return time.monotonic() < self._skip_until.get(server, 0.0)

    def _failed(self, op: str, key: str | None, server: str, e: Exception) -> None:
        self._stats.errors += 1
        kind = "unreachable" if isinstance(e, self._down_errors) else "write"
        if isinstance(e, self._slow_errors):  # a hung server: do not wait on it per call
            self._skip_until[server] = time.monotonic() + self.retry_s
        # an outage is logged once until the server answers again; a refusal (a full Redis
        # under noeviction, a fragment larger than allkeys-lru can make room for) once per
        # kind for the store's life: small writes passing between big ones would flap it
        episode = (server, "unreachable" if kind == "unreachable" else type(e).__name__)
        if episode not in self._failing:
            self._failing.add(episode)
            log.warning("redis store: %s %s on %s failed (%s: %s); requests compute locally, "
                        "further errors are counted in stats().errors, not logged%s",
                        op, (key or "")[:16], server, type(e).__name__, e,
                        " until it is reachable again" if kind == "unreachable" else "")

    def _ok(self, server: str) -> None:
        if (server, "unreachable") in self._failing:
            self._failing.discard((server, "unreachable"))
            log.info("redis store: %s is reachable again (%d errors so far)", server,
                     self._stats.errors)

    def _call(self, op: str, key: str | None, fn: Callable[[], Any], default: Any) -> Any:
        """`fn()`, or `default` if Redis fails (logged once, counted) or is being skipped."""
        server = self.server_of(key)
        if self._skipping(server):
            self._stats.errors += 1
            return default
        self.round_trips += 1
        try:
            out = fn()
        except self._errors as e:
            self._failed(op, key, server, e)
            return default
        self._ok(server)
        return out

    def _call_all(self, op: str, calls: Sequence[tuple[str, Callable[[], Any]]]) -> list[Any]:
        """`_call` of each (key, fn), None for a failure; on a cluster, the calls to several
        nodes at once (a thread each), so a walk over three nodes waits one round trip, not
        three. The threads only talk to Redis; failures are booked here, in order."""
        if len(calls) < 2 or not self.cluster:
            return [self._call(op, key, fn, None) for key, fn in calls]
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="edgekv-redis")
        sent: list[tuple[str, str, Any] | None] = []
        for key, fn in calls:
            server = self.server_of(key)
            if self._skipping(server):
                self._stats.errors += 1
                sent.append(None)
                continue
            self.round_trips += 1
            sent.append((key, server, self._pool.submit(fn)))
        out: list[Any] = []
        for job in sent:
            if job is None:
                out.append(None)
                continue
            key, server, fut = job
            try:
                out.append(fut.result())
            except self._errors as e:
                self._failed(op, key, server, e)
                out.append(None)
            else:
                self._ok(server)
        return out

    # -- the protocol ----------------------------------------------------------------------

    def get(self, key: str, now: float | None = None) -> KVFragment | None:
        hit = self.get_many([key], now)[0]
        return None if hit is None else hit.fragment

    def get_many(self, keys: Sequence[str], now: float | None = None, *,
                 prefix: bool = False) -> list[Hit | None]:
        """Every fragment and its lifecycle hash in one pipeline per server: a chain walk is
        one round trip to a single Redis; on a cluster, one to each node holding a part, sent
        to all of them at once (so a node that is down costs only its own chunks, and is
        logged and skipped as such)."""
        names = [check_key(k) for k in keys]
        by_server: dict[str, list[int]] = {}
        for i, key in enumerate(names):
            by_server.setdefault(self.server_of(key), []).append(i)
        replies: list[Any] = [None] * (2 * len(names))
        groups = list(by_server.values())

        def read(mine: list[str]) -> list[Any]:
            p = self._r.pipeline(transaction=False)
            for key in mine:
                p.get(self._k("frag", key))
                p.hgetall(self._k("meta", key))
            return list(p.execute())

        calls = [(names[where[0]], partial(read, [names[i] for i in where])) for where in groups]
        for where, got in zip(groups, self._call_all("get", calls)):
            if got is not None:
                for j, i in enumerate(where):
                    replies[2 * i : 2 * i + 2] = got[2 * j : 2 * j + 2]
        out: list[Hit | None] = []
        for i, key in enumerate(names):
            frag = self._decode(key, replies[2 * i], replies[2 * i + 1], now)
            if frag is None and prefix:
                return out + [None] * (len(names) - len(out))
            out.append(None if frag is None else Hit(frag, self.name))
        return out

    def _decode(self, key: str, blob: Any, meta: Any, now: float | None) -> KVFragment | None:
        if blob is None:
            self._stats.misses += 1
            return None
        frag = decode_or_miss(blob, key, self._stats, self.delete)
        if frag is None:
            return None
        if meta:
            try:
                frag = frag.with_lifecycle(int(meta[b"hit_count"]), float(meta[b"expires_at"]))
            except (KeyError, ValueError) as e:
                log.warning("redis store: lifecycle of %s is damaged (%s); using the entry's",
                            key, e)
        return live_or_miss(frag, key, now, self._stats, self.delete)

    def put(self, key: str, fragment: KVFragment) -> None:
        """One transaction in the chunk's slot (fragment + lifecycle), then the parent's
        successor list; a failure raises `StoreError` (logged once here, counted)."""
        check_key(key)
        server = self.server_of(key)
        if self._skipping(server):
            self._stats.errors += 1
            raise StoreError(f"Redis {server} is unreachable; {key[:16]} not written")
        p = self._r.pipeline(transaction=True)
        self._queue_put(p, key, fragment)
        parent = fragment.parent_key or "_root"
        try:
            self.round_trips += 1
            p.execute()
            self._ok(server)
            server = self.server_of(parent)
            self.round_trips += 1
            self._r.hset(*self._successor(key, fragment))
        except self._errors as e:
            self._failed("put", key, server, e)
            raise StoreError(f"cannot write {key[:16]} to Redis: {e}") from e

    def put_many(self, items: Sequence[tuple[str, KVFragment]]) -> None:
        """On a single Redis, every fragment, its lifecycle and its parent's successor entry
        in one MULTI/EXEC: a request's new chunks in one round trip, all of them landing or
        none (a failure raises `StoreError`, nothing is written), except for want of room
        (below). On a cluster each chunk is in its own slot, which no transaction spans: one
        `put` each.

        A full Redis refuses the whole transaction when its eviction policy cannot free room
        for all of it at once (the queued payload and the query buffer holding it count
        twice against `maxmemory`); then the chunks go one `put` at a time in the order
        given (the writeback's: parents first), so `allkeys-lru` evicts between them and a
        chain's written part stays a reachable prefix. Under `noeviction` they land until one
        is refused, which raises."""
        if self.cluster or len(items) < 2:
            for key, frag in items:
                self.put(key, frag)
            return
        for key, _ in items:
            check_key(key)
        if self._skipping(self.where):
            self._stats.errors += 1
            raise StoreError(f"Redis {self.where} is unreachable; {len(items)} fragments not "
                             "written")
        p = self._r.pipeline(transaction=True)
        for key, frag in items:
            self._queue_put(p, key, frag)
            p.hset(*self._successor(key, frag))
        try:
            self.round_trips += 1
            p.execute()
        except self._oom_errors:
            for key, frag in items:
                self.put(key, frag)
            return
        except self._errors as e:
            self._failed("put", items[0][0], self.where, e)
            raise StoreError(f"cannot write {len(items)} fragments to Redis: {e}") from e
        self._ok(self.where)

    def _queue_put(self, p: Any, key: str, fragment: KVFragment) -> None:
        """The fragment and its lifecycle hash (with their expiry) onto pipeline `p`."""
        p.set(self._k("frag", key), encode_fragment(fragment))
        p.hset(self._k("meta", key), mapping={"hit_count": fragment.hit_count,
                                               "expires_at": fragment.expires_at})
        if fragment.expires_at > 0:
            ms = int(fragment.expires_at * 1000)
            p.pexpireat(self._k("frag", key), ms)
            p.pexpireat(self._k("meta", key), ms)

    def _successor(self, key: str, fragment: KVFragment) -> tuple[str, str, bytes]:
        """HSET arguments naming `key` (and its tokens) in its parent's successor list."""
        return (self._k("children", fragment.parent_key or "_root"), key,
                fragment.token_ids.astype("<i4").tobytes())

    def touch(self, key: str, hit_count: int, expires_at: float, now: float | None = None) -> None:
        self.touch_many([(key, hit_count, expires_at)], now)

    def touch_many(self, items: Sequence[tuple[str, int, float]],
                   now: float | None = None) -> None:
        """Every hit in one pipeline per server, the servers at once (on a single Redis one
        MULTI/EXEC; a cluster node's slots differ, so its pipeline is not a transaction)."""
        by_server: dict[str, list[tuple[str, int, float]]] = {}
        for item in items:
            by_server.setdefault(self.server_of(item[0]), []).append(item)
        def write(mine: list[tuple[str, int, float]]) -> None:
            p = self._r.pipeline(transaction=not self.cluster)
            for key, hit_count, expires_at in mine:
                p.hset(self._k("meta", key), mapping={"hit_count": hit_count,
                                                       "expires_at": expires_at})
                p.pexpireat(self._k("frag", key), int(expires_at * 1000))
                p.pexpireat(self._k("meta", key), int(expires_at * 1000))
            p.execute()

        self._call_all("touch", [(mine[0][0], partial(write, mine))
                                 for mine in by_server.values()])

    def contains(self, key: str) -> bool:
        check_key(key)
        return bool(self._call("contains", key,
                               lambda: self._r.exists(self._k("frag", key)), False))

    def children(self, parent: str) -> list[tuple[str, np.ndarray]]:
        hkey = self._k("children", parent or "_root")
        rows = self._call("children", parent or "_root", lambda: self._r.hgetall(hkey), {})
        out = []
        for k, tok in rows.items():
            key = k.decode()
            held = self._call("contains", key, partial(self._r.exists, self._k("frag", key)),
                              None)
            if held:
                out.append((key, np.frombuffer(tok, dtype="<i4")))
            elif held is not None:  # expired or evicted: dropped from the list; but not when
                # its node could not say (a cluster node down): it is back with the node
                self._call("children", parent or "_root", partial(self._r.hdel, hkey, k), None)
        return out

    def entries(self) -> list[Entry]:
        """What the successor lists name (parent, tokens; neither size nor position, which
        the prefix index learns when they are read): one scan and one read per list, at
        open. A server down: nothing listed (the exact walk still finds every chain)."""
        try:
            lists = self._scan("children")
        except StoreError:
            return []
        out = []
        for hkey in lists:
            parent = self._store_key(hkey, "children")
            rows = self._call("entries", None, partial(self._r.hgetall, hkey), {})
            for name, tok in rows.items():
                out.append(Entry(name.decode(), "" if parent == "_root" else parent,
                                 np.frombuffer(tok, dtype="<i4"), -1, 0, 0.0, ""))
        return out

    def add_remove_listener(self, fn: Callable[[str], None]) -> None:
        self._listeners.append(fn)

    def delete(self, key: str) -> bool:
        try:
            n = self._r.delete(self._k("frag", key), self._k("meta", key))  # one slot
        except self._errors as e:
            self._failed("delete", key, self.server_of(key), e)
            raise StoreError(f"cannot delete {key[:16]} from Redis: {e}") from e
        for fn in self._listeners:
            fn(key)
        return bool(n)

    def _scan(self, kind: str) -> list[bytes]:
        try:
            return list(self._r.scan_iter(match=f"{self.prefix}:{kind}:*", count=1000))
        except self._errors as e:
            raise StoreError(f"cannot list the keys in Redis {self.where}: {e}") from e

    def keys(self) -> list[str]:
        """Every fragment key (all nodes of a cluster); `StoreError` if a server is down."""
        return sorted(self._store_key(k) for k in self._scan("frag"))

    def sweep(self, now: float | None = None) -> int:
        """Redis expires entries itself; this removes what is past its expiry but still held
        (e.g. clock skew) and reports how many."""
        now = time.time() if now is None else now
        n = 0
        for key in self.keys():
            meta = self._call("sweep", key, partial(self._r.hgetall, self._k("meta", key)), {})
            if meta and 0 < float(meta[b"expires_at"]) <= now:
                self.delete(key)
                n += 1
        self._stats.expired += n
        return n

    def clear(self) -> int:
        keys = self.keys()
        for key in keys:
            self.delete(key)
        for k in self._scan("children"):
            self._r.delete(k)
        return len(keys)

    def stats(self) -> StoreStats:
        """Counters, and what Redis holds under the prefix (the last figures seen while a
        server is down)."""
        try:
            keys = self.keys()
            p = self._r.pipeline(transaction=False)
            for k in keys:
                p.strlen(self._k("frag", k))
            self._last_size = (len(keys), sum(int(n) for n in p.execute()))
        except (StoreError, *self._errors):
            pass  # a report, not a request: the failure is neither counted nor logged
        return dataclasses.replace(self._stats, entries=self._last_size[0],
                                   bytes=self._last_size[1])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._r.close()
