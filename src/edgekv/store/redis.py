"""Redis tier: fragments shared by several KV-server processes (or devices on one LAN box).

Each fragment is one Redis string holding the self-verifying serial blob (so a damaged value
is a logged miss, as on disk), expiring through Redis' own TTL (PEXPIREAT); lifecycle fields
live in a small hash beside it, and a set per parent key lists successors with their tokens
for the strict successor walk. Capacity is Redis' `maxmemory` with an eviction policy, set
on the server; `stats()` reports what Redis holds under this store's prefix.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import StoreError
from ..fragment import KVFragment
from ..serial import encode_fragment
from .base import FragmentStore, StoreStats, check_key, decode_or_miss, live_or_miss

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)


class RedisStore(FragmentStore):
    name = "redis"
    def __init__(self, url: str, *, prefix: str = "edgekv", timeout_s: float = 2.0) -> None:
        try:
            import redis
        except ImportError as e:  # pragma: no cover
            raise StoreError("the redis client is missing: `pip install redis`") from e
        self._r: Any = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s)
        self._errors = (redis.RedisError, OSError)
        try:
            self._r.ping()
        except self._errors as e:
            raise StoreError(f"cannot reach Redis at {url}: {e}. Is redis-server running?") from e
        self.url, self.prefix = url, prefix
        self._stats = StoreStats(tier="redis")
        self._listeners: list[Callable[[str], None]] = []

    def _k(self, kind: str, key: str) -> str:
        return f"{self.prefix}:{kind}:{key}"

    def get(self, key: str, now: float | None = None) -> KVFragment | None:
        check_key(key)
        try:
            blob, meta = self._r.get(self._k("frag", key)), self._r.hgetall(self._k("meta", key))
        except self._errors as e:
            log.warning("redis store: get %s failed (%s); treated as a miss", key, e)
            self._stats.misses += 1
            return None
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
        check_key(key)
        blob = encode_fragment(fragment)
        p = self._r.pipeline()
        p.set(self._k("frag", key), blob)
        p.hset(self._k("meta", key), mapping={"hit_count": fragment.hit_count,
                                               "expires_at": fragment.expires_at})
        p.hset(self._k("children", fragment.parent_key or "_root"), key,
               fragment.token_ids.astype("<i4").tobytes())
        if fragment.expires_at > 0:
            ms = int(fragment.expires_at * 1000)
            p.pexpireat(self._k("frag", key), ms)
            p.pexpireat(self._k("meta", key), ms)
        try:
            p.execute()
        except self._errors as e:
            raise StoreError(f"cannot write {key} to Redis: {e}") from e

    def touch(self, key: str, hit_count: int, expires_at: float, now: float | None = None) -> None:
        try:
            p = self._r.pipeline()
            p.hset(self._k("meta", key), mapping={"hit_count": hit_count, "expires_at": expires_at})
            p.pexpireat(self._k("frag", key), int(expires_at * 1000))
            p.pexpireat(self._k("meta", key), int(expires_at * 1000))
            p.execute()
        except self._errors as e:
            log.warning("redis store: touch %s failed (%s)", key, e)

    def contains(self, key: str) -> bool:
        try:
            return bool(self._r.exists(self._k("frag", check_key(key))))
        except self._errors:
            return False

    def children(self, parent: str) -> list[tuple[str, np.ndarray]]:
        try:
            rows = self._r.hgetall(self._k("children", parent or "_root"))
        except self._errors:
            return []
        out = []
        for k, tok in rows.items():
            key = k.decode()
            if self.contains(key):  # entries that expired in Redis drop out here
                out.append((key, np.frombuffer(tok, dtype="<i4")))
            else:
                try:
                    self._r.hdel(self._k("children", parent or "_root"), k)
                except self._errors:
                    pass
        return out

    def add_remove_listener(self, fn: Callable[[str], None]) -> None:
        self._listeners.append(fn)

    def delete(self, key: str) -> bool:
        try:
            n = self._r.delete(self._k("frag", key), self._k("meta", key))
        except self._errors as e:
            raise StoreError(f"cannot delete {key} from Redis: {e}") from e
        for fn in self._listeners:
            fn(key)
        return bool(n)

    def keys(self) -> list[str]:
        pre = self._k("frag", "")
        return sorted(k.decode()[len(pre):] for k in self._r.scan_iter(match=pre + "*"))

    def sweep(self, now: float | None = None) -> int:
        """Redis expires entries itself; this removes what is past its expiry but still held
        (e.g. clock skew) and reports how many."""
        now = time.time() if now is None else now
        n = 0
        for key in self.keys():
            meta = self._r.hgetall(self._k("meta", key))
            if meta and 0 < float(meta[b"expires_at"]) <= now:
                self.delete(key)
                n += 1
        self._stats.expired += n
        return n

    def clear(self) -> int:
        keys = self.keys()
        for key in keys:
            self.delete(key)
        for k in self._r.scan_iter(match=self._k("children", "*")):
            self._r.delete(k)
        return len(keys)

    def stats(self) -> StoreStats:
        keys = self.keys()
        size = sum(int(self._r.strlen(self._k("frag", k))) for k in keys)
        return dataclasses.replace(self._stats, entries=len(keys), bytes=size)

    def close(self) -> None:
        self._r.close()
