"""Fragment stores: tiers behind one protocol."""

from __future__ import annotations

from ..config import CacheConfig
from .base import FragmentStore, StoreStats, check_key
from .disk import DiskStore
from .memory import MemoryStore
from .tiered import TieredStore

__all__ = [
    "DiskStore", "FragmentStore", "MemoryStore", "StoreStats", "TieredStore", "check_key",
    "open_store",
]


def open_store(config: CacheConfig) -> TieredStore:
    """The default two tiers: RAM (LRU) in front of the embedded disk store."""
    return TieredStore(
        MemoryStore(config.ram_capacity_bytes),
        DiskStore(config.cache_dir / "store", config.disk_capacity_bytes),
    )
