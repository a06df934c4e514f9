"""RAM tier: fragments with a capacity in bytes. Past it, the tier's `evictor` (the prefix
index: leaves first) frees room; without one, the least recently used entries go."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from ..fragment import KVFragment
from .base import Entry, FragmentStore, StoreStats, check_key

__all__ = ["MemoryStore"]

log = logging.getLogger(__name__)


class MemoryStore(FragmentStore):
    name = "ram"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, KVFragment] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = StoreStats(tier="ram", capacity_bytes=capacity_bytes)
        self._listeners: list[Callable[[str], None]] = []
        self._children: dict[str, set[str]] = {}
        self._removed: list[str] = []

    def add_remove_listener(self, fn: Callable[[str], None]) -> None:
        self._listeners.append(fn)

    def get(self, key: str, now: float | None = None) -> KVFragment | None:
        try:
            return self._get(key, now)
        finally:
            self._notify()

    def _get(self, key: str, now: float | None) -> KVFragment | None:
        now = time.time() if now is None else now
        with self._lock:
            frag = self._items.get(key)
            if frag is None:
                self._stats.misses += 1
                return None
            if frag.is_expired(now):
                self._drop(key)
                self._stats.expired += 1
                self._stats.misses += 1
                return None
            self._items.move_to_end(key)
            self._stats.hits += 1
            return frag

    def put(self, key: str, fragment: KVFragment) -> None:
        try:
            self._put(key, fragment)
            self._make_room(key)
        finally:
            self._notify()

    def _put(self, key: str, fragment: KVFragment) -> None:
        check_key(key)
        size = fragment.nbytes
        with self._lock:
            if key in self._items:
                self._drop(key)
            if size > self.capacity_bytes:
                log.debug("fragment %s (%d B) exceeds RAM capacity; not kept in RAM", key, size)
                return
            self._items[key] = fragment
            self._children.setdefault(fragment.parent_key, set()).add(key)
            self._bytes += size
            if self.evictor is None:
                while self._bytes > self.capacity_bytes:
                    old, _ = next(iter(self._items.items()))
                    self._drop(old)
                    self._stats.evictions += 1

    def _make_room(self, key: str) -> None:
        """With an evictor: ask it for room (outside the lock: it deletes through this
        store); if it cannot free enough (what is left is in use), `key` is not kept here."""
        if self.evictor is None:
            return
        while (over := self.excess_bytes()) > 0:
            self._notify()
            freed = self.evictor(over)
            if freed <= 0:
                with self._lock:
                    if self._bytes > self.capacity_bytes and self._drop(key):
                        self._stats.evictions += 1
                return

    def count_evictions(self, n: int) -> None:
        with self._lock:
            self._stats.evictions += n

    def excess_bytes(self) -> int:
        with self._lock:
            return max(0, self._bytes - self.capacity_bytes)

    def entries(self) -> list[Entry]:
        with self._lock:
            return [Entry(k, f.parent_key, f.token_ids, f.token_start, f.nbytes, 0.0,
                          f.model_fingerprint)
                    for k, f in self._items.items()]

    def touch(self, key: str, hit_count: int, expires_at: float, now: float | None = None) -> None:
        with self._lock:
            frag = self._items.get(key)
            if frag is not None:
                self._items[key] = dataclasses.replace(
                    frag, hit_count=hit_count, expires_at=expires_at
                )

    def children(self, parent: str) -> list[tuple[str, np.ndarray]]:
        with self._lock:
            return [(k, self._items[k].token_ids) for k in self._children.get(parent, ())]

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def delete(self, key: str) -> bool:
        with self._lock:
            dropped = self._drop(key)
        self._notify()
        return dropped

    def sweep(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        with self._lock:
            dead = [k for k, f in self._items.items() if f.is_expired(now)]
            for k in dead:
                self._drop(k)
            self._stats.expired += len(dead)
        self._notify()
        return len(dead)

    def clear(self) -> int:
        with self._lock:
            n = len(self._items)
            self._removed.extend(self._items)
            self._items.clear()
            self._children.clear()
            self._bytes = 0
        self._notify()
        return n

    def stats(self) -> StoreStats:
        with self._lock:
            return dataclasses.replace(self._stats, entries=len(self._items), bytes=self._bytes)

    def close(self) -> None:
        self.clear()

    def _drop(self, key: str) -> bool:
        frag = self._items.pop(key, None)
        if frag is None:
            return False
        self._children.get(frag.parent_key, set()).discard(key)
        self._bytes -= frag.nbytes
        self._removed.append(key)
        return True

    def _notify(self) -> None:
        """Tell listeners what left the store; called after the lock is released (a listener
        may call back into the store)."""
        while self._removed:
            key = self._removed.pop()
            for fn in self._listeners:
                fn(key)
