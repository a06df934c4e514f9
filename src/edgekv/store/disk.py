"""Disk tier: one self-verifying file per fragment plus a SQLite index of their lifecycle.

Why two parts: the tensors are written once and read whole (a plain file, written to a temp
name, fsynced and renamed, so a crash never leaves half an entry under a real name), while hit
counts, expiry and last access change on every hit (a SQLite row, transactional, shared safely
by several processes). The files are the truth: a missing or damaged index is rebuilt from them.

Several processes share one directory: files appear only by atomic rename, the index is SQLite
in WAL mode with a busy timeout, and a process that opens the store reconciles the index with
the files (rows whose file is gone are dropped, files without a row are adopted after their
checksum is verified, temp files of dead writers are removed), so a process killed at any
moment leaves nothing that a later one serves wrongly. The directory is private to its user
(0700, files 0600). When the disk fails (full, read-only, no permission) the store keeps
working as well as it can: reads that fail are misses, writes that fail raise `StoreError`
(the caller computes locally), each failure is counted in `stats().errors` and logged once
per kind; an index that cannot be opened for writing is read-only or held in memory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..errors import CorruptEntry, StoreError
from ..fragment import KVFragment
from ..serial import decode_fragment, encode_fragment_parts
from .base import Entry, FragmentStore, Hit, StoreStats, check_key, decode_or_miss, live_or_miss

__all__ = ["DiskStore", "make_private"]

log = logging.getLogger(__name__)

_TEMP_MAX_AGE_S = 3600.0  # a temp file older than this is a dead writer's, whatever its pid


def make_private(path: Path) -> None:
    """Create `path` (and missing parents) as 0700 directories; if it exists and belongs to this
    user, take away the group's and others' bits (never add any: a directory made read-only
    stays so). What it holds (KV of prompts, their token ids) is the user's."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:
            pass
    try:
        st = path.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    except OSError:
        pass  # not ours, or not reachable: the store reports what fails when it is used

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries_v2 (
    key TEXT PRIMARY KEY, nbytes INTEGER NOT NULL, expires_at REAL NOT NULL,
    hit_count INTEGER NOT NULL, last_access REAL NOT NULL, fingerprint TEXT NOT NULL,
    parent TEXT NOT NULL, tokens BLOB NOT NULL, token_start INTEGER NOT NULL DEFAULT -1);
CREATE INDEX IF NOT EXISTS entries_v2_parent ON entries_v2(parent);
"""
_COLUMNS = ("key, nbytes, expires_at, hit_count, last_access, fingerprint, parent, tokens, "
            "token_start")
_INSERT = f"INSERT OR REPLACE INTO entries_v2 ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)"


def _add_token_start(db: sqlite3.Connection) -> None:
    """An index written before rows carried their token start gets the column (-1 until
    the row is written again; the prefix index then places it by its parent)."""
    cols = {r[1] for r in db.execute("PRAGMA table_info(entries_v2)")}
    if "token_start" not in cols:
        db.execute("ALTER TABLE entries_v2 ADD COLUMN token_start INTEGER NOT NULL DEFAULT -1")


class DiskStore(FragmentStore):
    """`durable=False` skips the fsync of each file (bulk loads in benchmarks: a crash may
    then lose recent files, which the next open drops like any missing file)."""

    name = "disk"

    def __init__(self, root: Path, capacity_bytes: int, *, durable: bool = True) -> None:
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.durable = durable
        self._dir = self.root / "fragments"
        self._lock = threading.Lock()
        self._stats = StoreStats(tier="disk", capacity_bytes=capacity_bytes)
        self._listeners: list[Callable[[str], None]] = []
        self._failing = False  # an outage is under way: its first failure has been logged
        self.mode = "rw"  # "ro": the index is read-only; "memory": no usable index on disk
        try:
            make_private(self.root)
            make_private(self._dir)
        except OSError as e:
            self._fail("create", e)
        self._db = self._open_index()

    # -- public API ----------------------------------------------------------------------

    def get(self, key: str, now: float | None = None) -> KVFragment | None:
        hit = self.get_many([key], now)[0]
        return None if hit is None else hit.fragment

    def put(self, key: str, fragment: KVFragment) -> None:
        self.put_many([(key, fragment)])

    def put_many(self, items: Sequence[tuple[str, KVFragment]]) -> None:
        """Each fragment in a file of its own (atomic rename), then their index rows in one
        transaction; a failed write raises `StoreError` after the rows of those before it."""
        written: list[tuple[str, int, KVFragment]] = []
        error: StoreError | None = None
        for key, fragment in items:
            try:
                size = self._write_file(key, fragment)
            except StoreError as e:
                error = e
                break
            if size:
                written.append((key, size, fragment))
        try:
            with self._lock:
                now = time.time()
                for key, size, fragment in written:
                    self._upsert(key, size, fragment, now)
                self._db.commit()
        except sqlite3.Error as e:
            # the files are complete and verifiable: the next process that opens the store
            # adopts them, and `get` adopts them now (it reads files, not rows)
            self._fail("index", e)
            written = []
        if written and error is None and self._failing:
            self._failing = False
            log.info("disk store %s: writes succeed again", self.root)
        if written:
            self._enforce_capacity()
        if error is not None:
            raise error

    def _write_file(self, key: str, fragment: KVFragment) -> int:
        """Write `key`'s file atomically; its size, or 0 if it is larger than the tier."""
        path = self._path(check_key(key))
        parts = encode_fragment_parts(fragment)  # written in pieces: no copy in one buffer
        size = sum(len(p) for p in parts)
        if size > self.capacity_bytes:
            log.debug("fragment %s (%d B) exceeds disk capacity; not stored", key, size)
            return 0
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "wb") as f:
                for part in parts:
                    f.write(part)
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._fail("write", e)
            raise StoreError(f"cannot write {path}: {e}. Check free space and permissions.") from e
        return size

    def get_many(self, keys: Sequence[str], now: float | None = None, *,
                 prefix: bool = False) -> list[Hit | None]:
        """The files of `keys` and their lifecycle rows in one index query (plus one update of
        their last access); `prefix`: stop reading at the first missing file."""
        now = time.time() if now is None else now
        names = [check_key(k) for k in keys]
        try:
            with self._lock:
                rows = {r[0]: (int(r[1]), float(r[2])) for part in _parts(names)
                        for r in self._db.execute(
                            "SELECT key, hit_count, expires_at FROM entries_v2 WHERE key IN "
                            f"({','.join('?' * len(part))})", part)}
        except sqlite3.Error as e:
            self._fail("index", e)
            rows = {}
        out: list[Hit | None] = [None] * len(names)
        adopt: list[tuple[str, int, KVFragment]] = []
        for i, key in enumerate(names):
            try:
                blob = self._path(key).read_bytes()
            except OSError as e:
                if not isinstance(e, FileNotFoundError):
                    self._fail("read", e)
                self._stats.misses += 1
                if prefix:
                    break
                continue
            frag = decode_or_miss(blob, key, self._stats, self.delete)
            if frag is not None:
                if key not in rows:  # file without index row: adopt it
                    adopt.append((key, len(blob), frag))
                    rows[key] = (frag.hit_count, frag.expires_at)
                hits, expires = rows[key]
                frag = live_or_miss(frag.with_lifecycle(hit_count=hits, expires_at=expires),
                                    key, now, self._stats, self.delete)
            if frag is None:
                if prefix:
                    break
                continue
            out[i] = Hit(frag, self.name)
        read = [k for k, h in zip(names, out) if h is not None]
        if read:
            try:
                with self._lock:
                    for key, size, frag in adopt:
                        self._upsert(key, size, frag, now)
                    self._db.executemany("UPDATE entries_v2 SET last_access=? WHERE key=?",
                                         [(now, k) for k in read])
                    self._db.commit()
            except sqlite3.Error as e:  # locked for too long, read-only, disk full
                self._fail("index", e)
        return out

    def touch(self, key: str, hit_count: int, expires_at: float, now: float | None = None) -> None:
        self.touch_many([(key, hit_count, expires_at)], now)

    def touch_many(self, items: Sequence[tuple[str, int, float]],
                   now: float | None = None) -> None:
        now = time.time() if now is None else now
        try:
            with self._lock:
                self._db.executemany(
                    "UPDATE entries_v2 SET hit_count=?, expires_at=?, last_access=? WHERE key=?",
                    [(hits, expires, now, key) for key, hits, expires in items])
                self._db.commit()
        except sqlite3.Error as e:  # a hit is still a hit; its promotion waits
            self._fail("index", e)

    def contains(self, key: str) -> bool:
        try:
            return self._path(check_key(key)).exists()
        except OSError as e:  # e.g. no permission on the directory: nothing usable here
            self._fail("read", e)
            return False

    def add_remove_listener(self, fn: Callable[[str], None]) -> None:
        """Call `fn(key)` whenever an entry leaves the store (delete, eviction, expiry, damage)."""
        self._listeners.append(fn)

    def delete(self, key: str) -> bool:
        path = self._path(check_key(key))
        try:
            existed = path.exists()
            path.unlink(missing_ok=True)
        except OSError as e:
            self._fail("delete", e)
            return False
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

    def entries(self) -> list[Entry]:
        """Every row of the index (the prefix index is rebuilt from them on open)."""
        try:
            with self._lock:
                rows = self._db.execute("SELECT key, parent, tokens, token_start, nbytes, "
                                        "last_access, fingerprint FROM entries_v2").fetchall()
        except sqlite3.Error as e:
            self._fail("index", e)
            return []
        return [Entry(k, p, np.frombuffer(t, dtype="<i4"), int(s), int(n), float(a), fp)
                for k, p, t, s, n, a, fp in rows]

    def count_evictions(self, n: int) -> None:
        with self._lock:
            self._stats.evictions += n

    def excess_bytes(self) -> int:
        with self._lock:
            total = self._db.execute("SELECT COALESCE(SUM(nbytes),0) FROM entries_v2").fetchone()[0]
        return max(0, int(total) - self.capacity_bytes)

    def stats(self) -> StoreStats:
        with self._lock:
            n, size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(nbytes),0) FROM entries_v2").fetchone()
        return dataclasses.replace(self._stats, entries=int(n), bytes=int(size))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- failures ------------------------------------------------------------------------

    def _fail(self, op: str, e: BaseException) -> None:
        """Count an I/O failure; log the first of an outage (a full disk must not flood the
        log with a line per request): the rest go to DEBUG until a write succeeds again."""
        self._stats.errors += 1
        if self._failing:
            log.debug("disk store: %s failed again (%s)", op, e)
            return
        self._failing = True
        log.warning("disk store %s: %s failed (%s); requests are answered by local compute "
                    "and this is counted in the store's stats (errors). Check free space and "
                    "permissions.", self.root, op, e)

    # -- private helpers -----------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self._dir / key[:2] / f"{key}.ekv"

    def _open_index(self) -> sqlite3.Connection:
        """The index, in the best mode the directory allows: read-write (reconciled with the
        files), else read-only, else an in-memory copy rebuilt from the files."""
        path = self.root / "index.sqlite3"
        try:
            return self._open_rw(path)
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError) and not _writable(self.root):
                self._fail("open", e)
            else:
                log.warning("disk store: index %s is damaged (%s); rebuilding it from the files",
                            path, e)
                try:
                    for suffix in ("", "-wal", "-shm"):
                        Path(f"{path}{suffix}").unlink(missing_ok=True)
                    return self._open_rw(path)
                except (sqlite3.DatabaseError, OSError) as e2:
                    self._fail("open", e2)
        try:  # read-only directory: read the index as it is
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30,
                                 check_same_thread=False)
            db.execute("SELECT COUNT(*) FROM entries_v2").fetchone()
            self.mode = "ro"
            return db
        except sqlite3.DatabaseError:
            pass
        db = sqlite3.connect(":memory:", check_same_thread=False)
        db.executescript(_SCHEMA)
        self.mode = "memory"
        self._rebuild(db, drop_damaged=False)
        return db

    def _open_rw(self, path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(path, timeout=30, check_same_thread=False)
        try:
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: no fsync per access update
            db.executescript(_SCHEMA)
            _add_token_start(db)
            db.commit()
            _private_file(path)
            self._reconcile(db)
        except BaseException:
            db.close()
            raise
        return db

    def _reconcile(self, db: sqlite3.Connection) -> None:
        """Bring the index in line with the files after a crash or another process's: drop rows
        whose file is gone, adopt verified files that have no row (a writer killed between
        its rename and its commit), remove temp files of dead writers."""
        try:
            files = {p.stem: p for p in self._dir.glob("*/*.ekv")}
        except OSError:
            return
        rows = {r[0] for r in db.execute("SELECT key FROM entries_v2")}
        gone = [k for k in rows if k not in files]
        # a row written by a live process between our listing and now has its file: recheck
        gone = [k for k in gone if not self._path(k).exists()]
        db.executemany("DELETE FROM entries_v2 WHERE key=?", [(k,) for k in gone])
        self._rebuild(db, [p for k, p in files.items() if k not in rows])
        _remove_dead_temps(self._dir)
        if gone:
            log.info("disk store: dropped %d index rows whose files are gone", len(gone))

    def _rebuild(self, db: sqlite3.Connection, paths: list[Path] | None = None,
                 drop_damaged: bool = True) -> None:
        now = time.time()
        if paths is None:
            try:
                paths = list(self._dir.glob("*/*.ekv"))
            except OSError as e:  # no permission: an empty index, every read a miss
                self._fail("list", e)
                paths = []
        for path in paths:
            try:
                frag = decode_fragment(path.read_bytes())
                db.execute(_INSERT, self._row(path.stem, path.stat().st_size, frag, now))
            except (CorruptEntry, OSError) as e:
                if not drop_damaged:
                    continue
                log.warning("disk store: dropping damaged %s during rebuild (%s)", path, e)
                try:
                    path.unlink(missing_ok=True)
                except OSError:
                    pass
        db.commit()

    @staticmethod
    def _row(key: str, nbytes: int, frag: KVFragment, now: float) -> tuple[object, ...]:
        return (key, nbytes, frag.expires_at, frag.hit_count, now, frag.model_fingerprint,
                frag.parent_key, frag.token_ids.astype("<i4").tobytes(), frag.token_start)

    def _upsert(self, key: str, nbytes: int, frag: KVFragment, now: float) -> None:
        self._db.execute(_INSERT, self._row(key, nbytes, frag, now))

    def _forget(self, key: str) -> None:
        try:
            with self._lock:
                self._db.execute("DELETE FROM entries_v2 WHERE key=?", (key,))
                self._db.commit()
        except sqlite3.Error as e:  # the next open drops the row (its file is gone)
            self._fail("index", e)

    def _enforce_capacity(self) -> None:
        """Past capacity, the evictor (the prefix index: leaves first) frees room; what it
        cannot free (entries it does not know, e.g. another process's), the tier's own
        order: expired first, then least recently used."""
        if self.evictor is not None:
            while (over := self.excess_bytes()) > 0 and self.evictor(over) > 0:
                pass
        with self._lock:
            total = self._db.execute("SELECT COALESCE(SUM(nbytes),0) FROM entries_v2").fetchone()[0]
            if total <= self.capacity_bytes:
                return
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


def _parts(names: list[str], size: int = 500) -> list[list[str]]:
    """`names` in slices that fit SQLite's limit on bound parameters."""
    return [names[i : i + size] for i in range(0, len(names), size)]


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def _private_file(path: Path) -> None:
    try:
        st = path.stat()
        if st.st_mode & 0o077 and st.st_uid == os.getuid():
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    except OSError:
        pass


def _remove_dead_temps(root: Path) -> None:
    """Remove `.NAME.PID.TID.tmp` files whose writer is dead (or that are over an hour old):
    a process killed mid-write leaves one, never under a real entry's name."""
    now = time.time()
    for tmp in root.glob("*/.*.tmp"):
        try:
            pid = int(tmp.name.rsplit(".", 3)[-3])
        except (ValueError, IndexError):
            pid = 0
        try:
            alive = pid > 0 and _alive(pid)
            if not alive or now - tmp.stat().st_mtime > _TEMP_MAX_AGE_S:
                tmp.unlink(missing_ok=True)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
