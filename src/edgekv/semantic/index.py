"""HNSW index over fragment embeddings (usearch; seed parameters M=16, efSearch=50).

Entries are keyed by fragment store keys. The index is saved next to the disk store (index
file + a JSON map of labels to keys, both written atomically) and rebuilt from the store's
fragments whenever it is missing, unreadable or disagrees with its map: the fragments, which
carry their `embedding`, are the truth. Several processes may save the same index: the pair of
files is replaced under an exclusive lock (and read under a shared one), each written to a
temp name, fsynced and renamed, so a reader never pairs one process's index with another's
map, and a process killed mid-save leaves the previous pair (or a mismatch that is rebuilt).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["VectorIndex"]

log = logging.getLogger(__name__)


def _native(vector: np.ndarray) -> np.ndarray:
    """A 1-d native-order float32 copy (usearch rejects explicitly little-endian buffers)."""
    return np.frombuffer(np.asarray(vector, dtype=np.float32).tobytes(), dtype=np.float32)


@functools.cache
def _share_libstdcxx() -> None:
    """Load the system's libstdc++ into the global symbol scope before usearch. usearch's
    extension carries a static libstdc++ whose template statics (GNU unique symbols, as the
    locale facets' ids) bind process-wide: imported first, every llama.cpp model loaded
    afterwards in the process failed (`error loading model vocabulary: std::bad_cast`),
    while models loaded before it were fine (tests/semantic/test_real_semantic.py). With
    the system's library loaded globally first, both share its symbols."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("stdc++")
    if name is None or not hasattr(ctypes, "RTLD_GLOBAL"):
        return
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:  # not this platform's library: usearch is still usable
        log.debug("libstdc++ not loaded globally (%s)", e)


def _label(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


class VectorIndex:
    def __init__(self, dim: int, path: Path | None = None, *, connectivity: int = 16,
                 expansion_search: int = 50,
                 rebuild_from: Callable[[], Iterable[tuple[str, np.ndarray]]] | None = None,
                 ) -> None:
        self.dim = dim
        self.path = Path(path) if path else None
        self._params: dict[str, Any] = dict(ndim=dim, metric="cos", dtype="f32",
                                            connectivity=connectivity,
                                            expansion_search=expansion_search)
        self._lock = threading.Lock()
        self._keys: dict[int, str] = {}
        self._index = self._new()
        self.rebuilt = False
        if self.path is not None and not self._load() and rebuild_from is not None:
            self.rebuild(rebuild_from())

    def _new(self) -> Any:
        _share_libstdcxx()
        from usearch.index import Index

        return Index(**self._params)

    # -- public API ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return _label(key) in self._keys

    def keys(self) -> list[str]:
        return sorted(self._keys.values())

    def add(self, key: str, vector: np.ndarray) -> None:
        v = _native(vector)
        if v.shape[0] != self.dim:
            raise ValueError(f"vector of {v.shape[0]} dims for a {self.dim}-d index")
        label = _label(key)
        with self._lock:
            if label in self._keys:
                self._index.remove(label)
            self._index.add(label, v)
            self._keys[label] = key

    def remove(self, key: str) -> bool:
        label = _label(key)
        with self._lock:
            if label not in self._keys:
                return False
            self._index.remove(label)
            del self._keys[label]
            return True

    def search(self, vector: np.ndarray, k: int = 4) -> list[tuple[str, float]]:
        """Nearest entries as (key, cosine similarity), best first."""
        with self._lock:
            if not self._keys:
                return []
            res = self._index.search(_native(vector), k)
            out = []
            for label, dist in zip(np.atleast_1d(res.keys), np.atleast_1d(res.distances)):
                key = self._keys.get(int(label))
                if key is not None:
                    out.append((key, float(1.0 - dist)))
            return out

    def rebuild(self, entries: Iterable[tuple[str, np.ndarray]]) -> int:
        with self._lock:
            self._index = self._new()
            self._keys = {}
        n = 0
        for key, vec in entries:
            self.add(key, vec)
            n += 1
        self.rebuilt = True
        log.info("semantic index rebuilt from the store: %d entries", n)
        self.save()
        return n

    def clear(self) -> None:
        with self._lock:
            self._index = self._new()
            self._keys = {}

    def save(self) -> None:
        """Write the index and its map (see the module doc); an I/O failure (disk full,
        read-only) is logged and leaves the previous files: the index is rebuilt from the
        fragments when it disagrees with them."""
        if self.path is None:
            return
        tag = f"{os.getpid()}.{threading.get_ident()}"
        tmp_idx = self.path.with_name(f".{self.path.name}.{tag}.tmp")
        tmp_map = self._map_path().with_name(f".{self._map_path().name}.{tag}.tmp")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with self._lock:
                self._index.save(str(tmp_idx))
                data = json.dumps({str(k): v for k, v in self._keys.items()}).encode()
            fd = os.open(tmp_map, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp_idx, 0o600)
            with open(tmp_idx, "rb") as f:
                os.fsync(f.fileno())
            with self._file_lock(fcntl.LOCK_EX):
                os.replace(tmp_idx, self.path)
                os.replace(tmp_map, self._map_path())
        except OSError as e:
            log.warning("semantic index %s not saved (%s); it is rebuilt from the store when "
                        "it disagrees with it", self.path, e)
            for tmp in (tmp_idx, tmp_map):
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)

    # -- private helpers -----------------------------------------------------------------

    def _map_path(self) -> Path:
        assert self.path is not None
        return self.path.with_suffix(".keys.json")

    @contextlib.contextmanager
    def _file_lock(self, kind: int) -> Iterator[None]:
        """A cross-process lock on the index's pair of files (a no-op where the lock file
        cannot be opened, e.g. a read-only directory: nobody can replace them there)."""
        assert self.path is not None
        try:
            fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, kind)
            yield
        finally:
            os.close(fd)

    def _load(self) -> bool:
        assert self.path is not None
        if not self.path.is_file() or not self._map_path().is_file():
            return False
        try:
            index = self._new()
            with self._file_lock(fcntl.LOCK_SH):
                keys = {int(k): str(v)
                        for k, v in json.loads(self._map_path().read_text()).items()}
                index.load(str(self.path))
            if len(index) != len(keys) or any(k not in index for k in keys):
                raise ValueError(f"index holds {len(index)} vectors, its map {len(keys)} keys")
        except Exception as e:  # noqa: BLE001 - any damage means rebuild
            log.warning("semantic index %s is damaged (%s); rebuilding it", self.path, e)
            return False
        self._index, self._keys = index, keys
        return True
