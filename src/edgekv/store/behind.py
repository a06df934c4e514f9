"""A tier written behind: `put_many` returns once the fragments are queued, and one writer
thread, at a lower OS priority, writes them to the tier underneath.

Why: on a server's slots, a request stores its answer's KV on its slot's thread while the
other slots decode. Measured on 2 AVX2 cores (SmolLM2, commits of 650 tokens): the disk
tier's writes were 47-80 ms of a 65-101 ms store (files written and fsynced), the CPU the
other slots' decode steps share, and time in which the other requests' lookups wait for the
cache's step. Written behind, the store costs the slot the extraction and the RAM tier's
insert; the disk write runs on a thread the OS schedules after the decode threads.

Until written, a fragment is *pending*: it is read, listed and counted as held (`contains`,
`get_many`, `children`, `entries`, `keys`), so the prefix index and the next request see it
at once. Mutations keep their order: a `touch_many` queued after a put applies after it; a
`delete` or `clear` drops what is still queued, and a fragment deleted while it is being
written is deleted again once written. `flush` waits for the queue; `close` flushes.

What it gives up: a process killed before the queue drains loses those writes (the disk
tier is a cache: the next request recomputes them; a crash still never leaves half an entry).
Where a write must be on the tier before the caller goes on (a KV server acknowledging a
PUT), the tier is used as it is, unwrapped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import StoreError
from ..fragment import KVFragment
from .base import Entry, Evictor, FragmentStore, Hit, StoreStats

__all__ = ["WriteBehind"]

log = logging.getLogger(__name__)

MIB = 1 << 20


class WriteBehind(FragmentStore):
    """`inner` written by a thread of its own (module doc). `max_pending_bytes`: a `put_many`
    that finds more than this queued waits for the writer (memory stays bounded when the
    disk is slower than the answers); `nice`: the writer thread's OS priority, added to the
    process's (Linux; elsewhere the thread keeps it)."""

    def __init__(self, inner: FragmentStore, *, max_pending_bytes: int = 256 * MIB,
                 nice: int = 10) -> None:
        self.inner = inner
        self.name = inner.name
        self.max_pending_bytes = max_pending_bytes
        self._nice = nice
        self._cv = threading.Condition()
        self._pending: dict[str, KVFragment] = {}  # queued or being written
        self._latest: dict[str, int] = {}  # a pending key's last put (its number)
        self._puts = 0
        self._pending_bytes = 0
        # ("put", keys, its number) or ("touch", items, now), in the order they came
        self._queue: deque[tuple[str, Any, Any]] = deque()
        self._writing: set[str] = set()  # the keys of the batch being written
        self._cancelled: set[str] = set()  # deleted while being written
        self._busy = False
        self._closed = False
        self._listeners: list[Callable[[str], None]] = []
        self.writes = 0  # batches written (and `failed`: batches the tier refused)
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name=f"edgekv-{self.name}-writer",
                                        daemon=True)
        self._thread.start()

    # -- what the prefix index sets and reads on a tier ------------------------------------

    @property
    def evictor(self) -> Evictor | None:
        return self.inner.evictor

    @evictor.setter
    def evictor(self, fn: Evictor | None) -> None:
        self.inner.evictor = fn

    @property
    def self_evicting(self) -> bool:
        return self.inner.self_evicting

    @self_evicting.setter
    def self_evicting(self, value: bool) -> None:
        self.inner.self_evicting = value

    # -- writes: queued ------------------------------------------------------------------

    def put(self, key: str, fragment: KVFragment) -> None:
        self.put_many([(key, fragment)])

    def put_many(self, items: Sequence[tuple[str, KVFragment]]) -> None:
        if not items:
            return
        with self._cv:
            if self._closed:
                raise StoreError(f"the {self.name} store is closed")
            self._cv.wait_for(lambda: self._pending_bytes <= self.max_pending_bytes
                              or self._closed)
            if self._closed:  # closed while it waited: the writer may be gone
                raise StoreError(f"the {self.name} store is closed")
            self._puts += 1
            for key, frag in items:
                old = self._pending.get(key)
                self._pending_bytes += frag.nbytes - (old.nbytes if old is not None else 0)
                self._pending[key], self._latest[key] = frag, self._puts
                self._cancelled.discard(key)
            self._queue.append(("put", [k for k, _ in items], self._puts))
            self._cv.notify_all()

    def touch(self, key: str, hit_count: int, expires_at: float, now: float | None = None) -> None:
        self.touch_many([(key, hit_count, expires_at)], now)

    def touch_many(self, items: Sequence[tuple[str, int, float]],
                   now: float | None = None) -> None:
        """Queued behind the puts before it; a pending fragment's own copy is updated now, so
        that a read before the write sees the new count."""
        if not items:
            return
        with self._cv:
            for key, hits, expires in items:
                frag = self._pending.get(key)
                if frag is not None:
                    self._pending[key] = replace(frag, hit_count=hits, expires_at=expires)
            self._queue.append(("touch", list(items), now))
            self._cv.notify_all()

    def delete(self, key: str) -> bool:
        with self._cv:
            frag = self._pending.pop(key, None)
            self._latest.pop(key, None)
            if frag is not None:
                self._pending_bytes -= frag.nbytes
                if key in self._writing:
                    self._cancelled.add(key)
            self._cv.notify_all()
        held = self.inner.delete(key)  # the tier tells the listeners what it held
        if frag is not None:  # and this store what was queued (a key both held is told twice:
            self._removed(key)  # listeners take that, `FragmentStore.add_remove_listener`)
        return held or frag is not None

    def clear(self) -> int:
        with self._cv:
            held = len(self._pending)
            dropped = [k for k in self._pending if k not in self._writing]
            self._cancelled |= self._writing  # deleted (and told of) once written
            self._pending.clear()
            self._latest.clear()
            self._pending_bytes = 0
            self._queue.clear()
            self._cv.notify_all()
        n = self.inner.clear()
        for key in dropped:
            self._removed(key)
        return n + held

    def sweep(self, now: float | None = None) -> int:
        return self.inner.sweep(now)  # what is pending was stamped just now

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on the tier; False if `timeout` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(60)
        if self._thread.is_alive():
            log.warning("%s store: the writer did not finish in 60 s; %d fragments not "
                        "written", self.name, len(self._pending))
        self.inner.close()

    # -- reads: pending first ------------------------------------------------------------

    def get(self, key: str, now: float | None = None) -> KVFragment | None:
        hit = self.get_many([key], now)[0]
        return None if hit is None else hit.fragment

    def get_many(self, keys: Sequence[str], now: float | None = None, *,
                 prefix: bool = False) -> list[Hit | None]:
        with self._cv:
            held = {k: self._pending[k] for k in keys if k in self._pending}
        if not held:
            return self.inner.get_many(keys, now, prefix=prefix)
        lower = [k for k in keys if k not in held]
        below = iter(self.inner.get_many(lower, now, prefix=prefix) if lower else [])
        out: list[Hit | None] = []
        for key in keys:
            frag = held.get(key)
            hit = (next(below) if frag is None
                   else None if frag.is_expired(now) else Hit(frag, self.name))
            if hit is None and prefix:
                return out + [None] * (len(keys) - len(out))
            out.append(hit)
        return out

    def contains(self, key: str) -> bool:
        with self._cv:
            if key in self._pending:
                return True
        return self.inner.contains(key)

    def keys(self) -> list[str]:
        with self._cv:
            pending = list(self._pending)
        return sorted(set(self.inner.keys()).union(pending))

    def children(self, parent: str) -> list[tuple[str, np.ndarray]]:
        with self._cv:
            pending = [(k, f.token_ids) for k, f in self._pending.items()
                       if f.parent_key == parent and not f.is_expired()]
        seen = dict(self.inner.children(parent))
        for key, ids in pending:
            seen.setdefault(key, ids)
        return list(seen.items())

    def entries(self) -> list[Entry]:
        with self._cv:
            pending = list(self._pending.items())
        listed = self.inner.entries()
        known = {e.name for e in listed}
        now = time.time()
        return listed + [Entry(k, f.parent_key, np.asarray(f.token_ids, np.int32), f.token_start,
                               f.nbytes, now, f.model_fingerprint)
                         for k, f in pending if k not in known]

    def stats(self) -> StoreStats:
        """The tier's own (what is written), with what is queued (`queued`, `queued_bytes`)."""
        n, size = self.pending()
        return replace(self.inner.stats(), queued=n, queued_bytes=size)

    def pending(self) -> tuple[int, int]:
        """(fragments, bytes) queued or being written."""
        with self._cv:
            return len(self._pending), self._pending_bytes

    def excess_bytes(self) -> int:
        return self.inner.excess_bytes()

    def count_evictions(self, n: int) -> None:
        self.inner.count_evictions(n)

    def add_remove_listener(self, fn: Callable[[str], None]) -> None:
        if not self._listeners:
            self.inner.add_remove_listener(self._removed)
        self._listeners.append(fn)

    def persistent_tier(self) -> FragmentStore:
        return self

    # -- the writer ----------------------------------------------------------------------

    def _run(self) -> None:
        if self._nice:
            try:  # Linux: a thread's own priority (its id as the "process")
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               os.getpriority(os.PRIO_PROCESS, 0) + self._nice)
            except (AttributeError, OSError) as e:
                log.debug("%s store writer: priority unchanged (%s)", self.name, e)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                op, items, arg = self._queue.popleft()
                if op == "put":  # the keys whose last put this is, as they are now
                    items = [(k, self._pending[k]) for k in items if self._latest.get(k) == arg]
                    self._writing = {k for k, _ in items}
                self._busy = True
            try:
                self._apply(op, items, arg)
            finally:
                with self._cv:
                    again = self._settle(op, items, arg)
                try:
                    for key in again:
                        self.inner.delete(key)
                finally:
                    with self._cv:
                        self._busy = False
                        self._cv.notify_all()

    def _apply(self, op: str, items: list[Any], now: Any) -> None:
        try:
            if op == "put":
                if items:
                    self.inner.put_many(items)
                    self.writes += 1
            else:
                self.inner.touch_many(items, now)
        except StoreError as e:  # the tier counted it (stats().errors) and logged the first
            self.failed += 1
            log.debug("%s store writer: %s refused (%s)", self.name, op, e)
        except Exception:  # the writer must outlive a bug in one write
            self.failed += 1
            log.exception("%s store writer: %s failed", self.name, op)

    def _settle(self, op: str, items: list[Any], number: Any) -> list[str]:
        """After a batch: what it wrote is no longer pending (unless put again meanwhile);
        what was deleted while it was written must be deleted again. Under the lock."""
        if op != "put":
            return []
        for key, _ in items:
            if self._latest.get(key) == number:
                del self._latest[key]
                self._pending_bytes -= self._pending.pop(key).nbytes
        again = [k for k, _ in items if k in self._cancelled]
        self._cancelled.difference_update(self._writing)
        self._writing = set()
        return again

    def _removed(self, key: str) -> None:
        """`key` left the store (the tier's or the queue's): its listeners."""
        for fn in self._listeners:
            fn(key)
