"""Disk tier: one self-verifying file per fragment plus a SQLite index of their lifecycle.

Why two parts: the tensors are written once and read whole (a plain file, written to a temp
name, fsynced and renamed, so a crash never leaves half an entry under a real name), while hit
counts, expiry and last access change on every hit (a SQLite row, transactional, shared safely
by several processes). The files are the truth: a missing or damaged index is rebuilt from them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import CorruptEntry, StoreError
from ..fragment import KVFragment
from ..serial import decode_fragment, encode_fragment
from .base import FragmentStore, StoreStats, check_key, decode_or_miss, live_or_miss

__all__ = ["DiskStore"]

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries_v2 (
    key TEXT PRIMARY KEY, nbytes INTEGER NOT NULL, expires_at REAL NOT NULL,
    hit_count INTEGER NOT NULL, last_access REAL NOT NULL, fingerprint TEXT NOT NULL,
    parent TEXT NOT NULL, tokens BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS entries_v2_parent ON entries_v2(parent);
"""


class DiskStore(FragmentStore):
    name = "disk"
    def __init__(self, root: Path, capacity_bytes: int) -> None:
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self._dir = self.root / "fragments"
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the disk store at {self.root}: {e}") from e
        self._lock = threading.Lock()
        self._stats = StoreStats(tier="disk", capacity_bytes=capacity_bytes)
        self._listeners: list[Callable[[str], None]] = []
        self._db = self._open_index()

    # -- public API ----------------------------------------------------------------------

    def get(self, key: str, now: float | None = None) -> KVFragment | None:
        now = time.time() if now is None else now
        path = self._path(check_key(key))
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            self._stats.misses += 1
            return None
        except OSError as e:
            log.warning("disk store: cannot read %s (%s); treated as a miss", path, e)
            self._stats.misses += 1
            return None
        frag = decode_or_miss(blob, key, self._stats, self.delete)
        if frag is None:
            return None
        try:
            with self._lock:
                row = self._db.execute(
                    "SELECT hit_count, expires_at FROM entries_v2 WHERE key=?", (key,)
                ).fetchone()
                if row is None:  # file without index row: adopt it
                    row = (frag.hit_count, frag.expires_at)
                    self._upsert(key, len(blob), frag, now)
                self._db.execute("UPDATE entries_v2 SET last_access=? WHERE key=?", (now, key))
                self._db.commit()
        except sqlite3.Error as e:  # e.g. locked by another process for too long
            log.warning("disk store: index unavailable (%s); using the entry's own lifecycle", e)
            row = (frag.hit_count, frag.expires_at)
        frag = frag.with_lifecycle(hit_count=int(row[0]), expires_at=float(row[1]))
        return live_or_miss(frag, key, now, self._stats, self.delete)

    def put(self, key: str, fragment: KVFragment) -> None:
        path = self._path(check_key(key))
        blob = encode_fragment(fragment)
        if len(blob) > self.capacity_bytes:
            log.debug("fragment %s (%d B) exceeds disk capacity; not stored", key, len(blob))
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot write {path}: {e}. Check free space and permissions.") from e
        with self._lock:
            self._upsert(key, len(blob), fragment, time.time())
            self._db.commit()
        self._enforce_capacity()

    def touch(self, key: str, hit_count: int, expires_at: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            self._db.execute(
                "UPDATE entries_v2 SET hit_count=?, expires_at=?, last_access=? WHERE key=?",
                (hit_count, expires_at, now, key),
            )
            self._db.commit()

    def contains(self, key: str) -> bool:
        return self._path(check_key(key)).exists()

    def add_remove_listener(self, fn: Callable[[str], None]) -> None:
        """Call `fn(key)` whenever an entry leaves the store (delete, eviction, expiry, damage)."""
        self._listeners.append(fn)

    def delete(self, key: str) -> bool:
        path = self._path(check_key(key))
        existed = path.exists()
        path.unlink(missing_ok=True)
        self._forget(key)
        for fn in self._listeners:
            fn(key)
        return existed

    def sweep(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        with self._lock:
            dead = [r[0] for r in self._db.execute(
                "SELECT key FROM entries_v2 WHERE expires_at > 0 AND expires_at <= ?", (now,))]
        for key in dead:
            self.delete(key)
        self._stats.expired += len(dead)
        return len(dead)

    def clear(self) -> int:
        n = 0
        for path in self._dir.glob("*/*.ekv"):
            path.unlink(missing_ok=True)
            n += 1
            for fn in self._listeners:
                fn(path.stem)
        with self._lock:
            self._db.execute("DELETE FROM entries_v2")
            self._db.commit()
        return n

    def children(self, parent: str) -> list[tuple[str, np.ndarray]]:
        """Entries whose fragment follows the chunk keyed `parent`, with their token ids
        (from the index: no fragment is read)."""
        with self._lock:
            try:
                rows = self._db.execute(
                    "SELECT key, tokens FROM entries_v2 WHERE parent=? AND "
                    "(expires_at <= 0 OR expires_at > ?)", (parent, time.time())).fetchall()
            except sqlite3.Error as e:
                log.warning("disk store: index query failed (%s)", e)
                return []
        return [(k, np.frombuffer(t, dtype="<i4")) for k, t in rows]

    def keys(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT key FROM entries_v2 ORDER BY key")]

    def stats(self) -> StoreStats:
        with self._lock:
            n, size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(nbytes),0) FROM entries_v2").fetchone()
        return dataclasses.replace(self._stats, entries=int(n), bytes=int(size))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- private helpers -----------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self._dir / key[:2] / f"{key}.ekv"

    def _open_index(self) -> sqlite3.Connection:
        path = self.root / "index.sqlite3"
        try:
            db = sqlite3.connect(path, timeout=30, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: no fsync per access update
            db.executescript(_SCHEMA)
            n_rows = db.execute("SELECT COUNT(*) FROM entries_v2").fetchone()[0]
            db.commit()
            if n_rows == 0 and any(self._dir.glob("*/*.ekv")):
                self._rebuild(db)  # files without an index (index deleted or older schema)
            return db
        except sqlite3.DatabaseError as e:
            log.warning("disk store: index %s is damaged (%s); rebuilding it from the files",
                        path, e)
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
            db = sqlite3.connect(path, timeout=30, check_same_thread=False)
            db.executescript(_SCHEMA)
            self._rebuild(db)
            return db

    def _rebuild(self, db: sqlite3.Connection) -> None:
        now = time.time()
        for path in self._dir.glob("*/*.ekv"):
            try:
                frag = decode_fragment(path.read_bytes())
                db.execute("INSERT OR REPLACE INTO entries_v2 VALUES (?,?,?,?,?,?,?,?)",
                           self._row(path.stem, path.stat().st_size, frag, now))
            except (CorruptEntry, OSError) as e:
                log.warning("disk store: dropping damaged %s during rebuild (%s)", path, e)
                path.unlink(missing_ok=True)
        db.commit()

    @staticmethod
    def _row(key: str, nbytes: int, frag: KVFragment, now: float) -> tuple[object, ...]:
        return (key, nbytes, frag.expires_at, frag.hit_count, now, frag.model_fingerprint,
                frag.parent_key, frag.token_ids.astype("<i4").tobytes())

    def _upsert(self, key: str, nbytes: int, frag: KVFragment, now: float) -> None:
        self._db.execute("INSERT OR REPLACE INTO entries_v2 VALUES (?,?,?,?,?,?,?,?)",
                         self._row(key, nbytes, frag, now))

    def _forget(self, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM entries_v2 WHERE key=?", (key,))
            self._db.commit()

    def _enforce_capacity(self) -> None:
        with self._lock:
            total = self._db.execute("SELECT COALESCE(SUM(nbytes),0) FROM entries_v2").fetchone()[0]
            if total <= self.capacity_bytes:
                return
            # expired first, then least recently used
            rows = self._db.execute(
                "SELECT key, nbytes FROM entries_v2"
                " ORDER BY (expires_at > 0 AND expires_at <= ?) DESC, last_access ASC",
                (time.time(),)
            ).fetchall()
        for key, nbytes in rows:
            if total <= self.capacity_bytes:
                break
            self.delete(key)
            total -= nbytes
            self._stats.evictions += 1
