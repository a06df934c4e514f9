"""The one protocol every fragment store (tier) implements."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class FragmentStore(Protocol):
    """A tier of fragments keyed by strings. Reads that fail verification are misses."""

    name: str  # the tier's name in reports ("ram", "disk", "redis")

    def get(self, key: str, now: float | None = None) -> KVFragment | None: ...

    def put(self, key: str, fragment: KVFragment) -> None: ...

    def touch(self, key: str, hit_count: int, expires_at: float, now: float | None = None) -> None:
        """Record a hit: the new hit count and expiry (the cache decides promotion)."""
        ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def sweep(self, now: float | None = None) -> int:
        """Drop expired entries; return how many."""
        ...

    def clear(self) -> int: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...


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
