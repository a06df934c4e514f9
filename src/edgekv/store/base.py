"""The one protocol every fragment store (tier) implements."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import CorruptEntry, StoreError
from ..fragment import KVFragment
from ..serial import decode_fragment

__all__ = ["FragmentStore", "StoreStats", "check_key", "decode_or_miss", "live_or_miss"]

log = logging.getLogger(__name__)

_KEY = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise StoreError(
            f"store key {key!r} is invalid: use 1-200 characters from [A-Za-z0-9._-]"
        )
    return key


@dataclass(slots=True)
class StoreStats:
    tier: str
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expired: int = 0
    corrupt: int = 0
    # calls that failed in the backend (a server down, a full Redis, an I/O error): each was
    # a miss or an unstored fragment, the request computed locally; logged once per outage
    errors: int = 0


@runtime_checkable
class FragmentStore(Protocol):
    """A tier of fragments keyed by strings (`keys.StoreKey`). Reads that fail verification
    are misses.

    The methods with a body are defaults for what a single tier has nothing to offer; a tier
    subclasses this protocol to inherit them (`MemoryStore`, `DiskStore`, `RedisStore`), and
    `TieredStore` overrides them across its tiers.
    """

    name: str  # the tier's name in reports ("ram", "disk", "redis")
    # which tier served the last hit (`TieredStore`); None: not tracked, reports say "store"
    last_tier: str | None = None

    def get(self, key: str, now: float | None = None) -> KVFragment | None: ...

    def put(self, key: str, fragment: KVFragment) -> None: ...

    def touch(self, key: str, hit_count: int, expires_at: float, now: float | None = None) -> None:
        """Record a hit: the new hit count and expiry (the cache decides promotion)."""
        ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def keys(self) -> list[str]:
        """Every key held (compaction and index rebuilds scan it)."""
        ...

    def sweep(self, now: float | None = None) -> int:
        """Drop expired entries; return how many."""
        ...

    def clear(self) -> int: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...

    # -- with defaults -------------------------------------------------------------------

    def children(self, parent: str) -> list[tuple[str, np.ndarray]]:
        """The entries whose fragment follows the chunk keyed `parent` (store key, token
        ids), from the tier's parent index: the radix step's candidates. Default: none."""
        return []

    def warm(self, key: str) -> KVFragment | None:
        """Copy `key` into the faster tiers if it is only lower down (prefetch); the fragment,
        or None. Default: a single tier has no faster tier, so nothing is warmed."""
        return None

    def add_remove_listener(self, fn: Callable[[str], None]) -> None:
        """Call `fn(key)` after an entry leaves the store (eviction, expiry, delete, clear).
        Default: the tier never tells."""
        return None

    def persistent_tier(self) -> FragmentStore:
        """The tier that outlives the process (the last of a tiered store), to scan without
        promoting what is read into faster tiers. Default: the store itself."""
        return self


def decode_or_miss(blob: bytes, key: str, stats: StoreStats,
                   drop: Callable[[str], object]) -> KVFragment | None:
    """Decode a stored blob; a damaged one is logged, counted, removed and read as a miss."""
    try:
        return decode_fragment(blob)
    except CorruptEntry as e:
        log.warning("%s store: entry %s is damaged (%s); removed, treated as a miss",
                    stats.tier, key, e)
        stats.corrupt += 1
        stats.misses += 1
        try:
            drop(key)
        except StoreError:
            pass
        return None


def live_or_miss(frag: KVFragment, key: str, now: float | None, stats: StoreStats,
                 drop: Callable[[str], object]) -> KVFragment | None:
    """The fragment if it has not expired; an expired one is removed and counted as a miss."""
    if frag.is_expired(now):
        try:
            drop(key)
        except StoreError:
            pass
        stats.expired += 1
        stats.misses += 1
        return None
    stats.hits += 1
    return frag
