"""Fragment stores: tiers behind one protocol."""

from __future__ import annotations

from ..config import CacheConfig
from .base import FragmentStore, StoreStats, check_key
from .disk import DiskStore
from .memory import MemoryStore
from .tiered import TieredStore

__all__ = [
    "DiskStore", "FragmentStore", "MemoryStore", "StoreStats", "TieredStore", "check_key",
    "open_store", "open_store_url",
]


def open_store_url(url: str, capacity_bytes: int) -> FragmentStore:
    """A single tier chosen by URL: a path or `file://PATH` (disk), `redis://HOST:PORT/DB`,
    `redis-cluster://HOST:PORT,HOST:PORT,...` (a Redis Cluster: any reachable node finds the
    rest), or `memory://` (RAM, for tests)."""
    from pathlib import Path

    if url.startswith(("redis://", "rediss://", "redis-cluster://")):
        from .redis import RedisStore

        return RedisStore(url)
    if url.startswith("memory://"):
        return MemoryStore(capacity_bytes)
    path = url[len("file://"):] if url.startswith("file://") else url
    return DiskStore(Path(path), capacity_bytes)


def open_store(config: CacheConfig, url: str | None = None) -> TieredStore:
    """The default two tiers: RAM (LRU) in front of the embedded disk store, or of the store
    at `url` (`open_store_url`: PATH, file://PATH, redis://..., shared between processes);
    with `config.write_behind`, that one written by a thread of its own (`WriteBehind`)."""
    behind: FragmentStore = (
        DiskStore(config.cache_dir / "store", config.disk_capacity_bytes) if url is None
        else open_store_url(url, config.disk_capacity_bytes))
    if config.write_behind:
        from .behind import WriteBehind

        behind = WriteBehind(behind)
    return TieredStore(MemoryStore(config.ram_capacity_bytes), behind)
