"""The one protocol every fragment store (tier) implements."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import CorruptEntry, StoreError
from ..fragment import KVFragment
from ..serial import decode_fragment

__all__ = ["Entry", "FragmentStore", "Hit", "StoreStats", "check_key", "decode_or_miss",
           "live_or_miss"]

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
    # a tier written behind (`behind.WriteBehind`): fragments accepted, not yet written
    queued: int = 0
    queued_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Hit:
    """A fragment read, and the tier that answered ("ram", "disk", "redis")."""

    fragment: KVFragment
    tier: str


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry as a tier's own index lists it, without reading the fragment: what the
    prefix index is rebuilt from on open (`PrefixIndex.rebuild`)."""

    name: str
    parent: str
    tokens: np.ndarray
    start: int  # the first token's position; -1: not recorded (an older disk index)
    nbytes: int
    last_access: float
    fingerprint: str


# Who frees room when a tier is over capacity: None, the tier's own LRU; else a callback
# asked to free at least n bytes (the prefix index, leaves first), returning what it freed.
Evictor = Callable[[int], int]


@runtime_checkable
class FragmentStore(Protocol):
    """A tier of fragments keyed by names (`keys.StoreKey.name`); it knows nothing of chains
    (the prefix index does). Reads that fail verification are misses.

    The methods with a body are defaults for what a single tier has nothing to offer; a tier
    subclasses this protocol to inherit them (`MemoryStore`, `DiskStore`, `RedisStore`), and
    `TieredStore` overrides them across its tiers. The batched methods default to the
    per-item ones; a tier whose calls cost a round trip or a query answers a batch in one.
    """

    name: str  # the tier's name in reports ("ram", "disk", "redis")
    evictor: Evictor | None = None
    # a tier that evicts by itself, unseen (Redis' maxmemory policy) and is shared by other
    # processes: the prefix index neither evicts from it nor frees what it holds
    self_evicting: bool = False

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

    def get_many(self, keys: Sequence[str], now: float | None = None, *,
                 prefix: bool = False) -> list[Hit | None]:
        """`get` of each key, with the tier that answered; `prefix`: a chain walk, so
        everything after the first miss is a miss too (and is not read)."""
        out: list[Hit | None] = []
        for key in keys:
            frag = None if prefix and out and out[-1] is None else self.get(key, now)
            out.append(None if frag is None else Hit(frag, self.name))
        return out

    def put_many(self, items: Sequence[tuple[str, KVFragment]]) -> None:
        """`put` of each (key, fragment), in order; the first failure raises `StoreError`."""
        for key, frag in items:
            self.put(key, frag)

    def touch_many(self, items: Sequence[tuple[str, int, float]],
                   now: float | None = None) -> None:
        """`touch` of each (key, hit count, expiry)."""
        for key, hits, expires in items:
            self.touch(key, hits, expires, now)

    def excess_bytes(self) -> int:
        """Bytes held past the tier's capacity (what its evictor must free). Default: a
        tier without a capacity of its own is never over it."""
        return 0

    def count_evictions(self, n: int) -> None:
        """Count `n` entries its evictor (the prefix index) deleted to make room, in
        `stats().evictions`. Default: a tier that keeps no such count ignores it."""
        return None

    def entries(self) -> list[Entry]:
        """What the tier holds, from its own index (no fragment read). Default: a tier that
        cannot list cheaply lists nothing, and the prefix index learns its entries as they
        are read."""
        return []

    def tier_list(self) -> tuple[FragmentStore, ...]:
        """The single tiers behind this store, fastest first (`TieredStore`: each of its)."""
        return (self,)

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
        `fn` may hear of one removal twice (a written-behind store tells of what its queue
        dropped and relays its tier): it looks at what is held, and a second call finds the
        work done. Default: the tier never tells."""
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
