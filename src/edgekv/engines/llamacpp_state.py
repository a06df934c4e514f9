"""Parse and assemble llama.cpp sequence-state blobs (`llama_state_seq_get/set_data`).

Layout (llama.cpp `llama_context::state_seq_get_data` + `llama_kv_cache::state_write`), LE:

    u32 magic 0xaf143cd8 | i32 seq_id | then one KV cache, or two for sliding-window models:
    per cache: u32 n_stream
      per stream: u32 cell_count; if > 0:
        per cell: i32 pos, u32 n_seq_id, i32 seq_id * n_seq_id
        u32 v_trans, u32 n_layer (the layers of this cache)
        per layer K: i32 type, u64 row_bytes, cell_count rows
        V (v_trans=0): per layer: i32 type, u64 row_bytes, cell_count rows
        V (v_trans=1): per layer: i32 type, u32 elem_bytes, u32 n_embd_v, n_embd_v x cell_count

A model with interleaved sliding-window (SWA) and global layers (Gemma 3) runs on
`llama_kv_cache_iswa`: two caches, written one after the other in one blob, the global
("base") cache first, then the SWA cache. Each holds only its own layers, in model order. For
one sequence, llama.cpp leaves out the SWA cells the window already masks (positions
<= pos_max - n_swa), so the SWA section is the last `n_swa` positions; with seq_id -1 (the
whole cache) it writes every cell it still holds: all of them with `swa_full=True`, the last
window plus a micro-batch without. See docs/llamacpp-state.md.

A context with one KV stream per sequence (llama.cpp `kv_unified=false`, the server's slots in
`llamacpp_slots`) writes every stream's cell count for one sequence, 0 but in its own stream.

Only what can be sliced and reassembled safely is accepted: one sequence in one stream, plain
f16/f32 K and V, no per-cell extension (M-RoPE / n-gram models), every cache's cells a gap-free
range of positions ending at the same place, every byte accounted for. Anything else raises
`UnsupportedLayout` with what was found, so the cache falls back to recomputing instead of
feeding llama.cpp a state it would misread.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import UnsupportedLayout

__all__ = ["SEQ_MAGIC", "CellBlock", "Cells", "KVSection", "SeqState", "SeqStateWriter",
           "assemble_seq_state", "parse_seq_state"]

SEQ_MAGIC = 0xAF143CD8
# GGML_TYPE_F32, GGML_TYPE_F16
GGML_TYPES: dict[int, np.dtype] = {0: np.dtype("<f4"), 1: np.dtype("<f2")}
_TYPE_IDS = {np.dtype("<f4"): 0, np.dtype("<f2"): 1}
_CELL = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])


@dataclass(frozen=True, slots=True)
class KVSection:
    """One KV cache of a state blob: `layers` (model layer indices, in blob order) for the
    positions [start, start + n): layer i's keys/values [position - start, width].

    Held per layer, as views into the blob: reading a state copies nothing. A server's slot
    extracts its answer's KV on its own thread beside the other slots' decode steps, and
    stacking every layer into one array was a whole extra copy of it: extracting a 1,792-token
    sequence's 14 chunks of SmolLM2 took 56.6-64.3 ms with it, 38.3-42.8 without (medians of
    12, alternating runs, 2 cores). `keys` and `values` stack them, a copy, for whole-state
    users."""

    layers: tuple[int, ...]
    start: int
    layer_keys: tuple[np.ndarray, ...]
    layer_values: tuple[np.ndarray, ...]

    @property
    def n(self) -> int:
        return int(self.layer_keys[0].shape[0]) if self.layer_keys else 0

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def keys(self) -> np.ndarray:
        """keys[i, position - start, width]: every layer stacked (a copy)."""
        return np.stack(self.layer_keys)

    @property
    def values(self) -> np.ndarray:
        return np.stack(self.layer_values)


@dataclass(frozen=True, slots=True)
class SeqState:
    """One sequence's KV in canonical layout, one section per KV cache (two for SWA models)."""

    sections: tuple[KVSection, ...]
    v_trans: bool

    @property
    def n_tokens(self) -> int:
        return self.sections[0].end

    @property
    def keys(self) -> np.ndarray:
        """keys[layer, position, width] of a one-cache state (every layer from position 0)."""
        return self._whole().keys

    @property
    def values(self) -> np.ndarray:
        return self._whole().values

    def _whole(self) -> KVSection:
        s = self.sections[0]
        if len(self.sections) != 1 or s.start != 0:
            raise UnsupportedLayout("a sliding-window state has no single keys array; use "
                                    "layer_kv(layer, positions)")
        return s

    def layer_kv(self, layer: int, tok: slice) -> tuple[np.ndarray, np.ndarray]:
        """K and V [token, width] of `layer` at the absolute positions `tok`."""
        for s in self.sections:
            if layer in s.layers:
                if tok.start < s.start or tok.stop > s.end:
                    raise UnsupportedLayout(
                        f"layer {layer} holds positions [{s.start}, {s.end}), not "
                        f"[{tok.start}, {tok.stop}): its sliding window dropped the rest "
                        "(run llama.cpp with swa_full=True to keep them)")
                i, lo, hi = s.layers.index(layer), tok.start - s.start, tok.stop - s.start
                return s.layer_keys[i][lo:hi], s.layer_values[i][lo:hi]
        raise UnsupportedLayout(f"layer {layer} is in no KV cache of the state")


class CellBlock(Protocol):
    """Cells to write into a restored sequence (`LlamaCppAdapter.restore_cells`): positions
    [token_start, token_end) of the layers `layer_indices`, keys/values[i, token, width] for
    layer `layer_indices[i]`. A `KVFragment` is one; `Cells` is the plain one."""

    @property
    def token_start(self) -> int: ...

    @property
    def token_end(self) -> int: ...

    @property
    def token_ids(self) -> Sequence[int] | np.ndarray: ...

    @property
    def layer_indices(self) -> Sequence[int]: ...

    @property
    def keys(self) -> np.ndarray: ...

    @property
    def values(self) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class Cells:
    """A `CellBlock` of every layer (`range(n_layer)`) or of the layers given."""

    token_start: int
    token_ids: Sequence[int]
    keys: np.ndarray  # [layer, token, n_embd_k]
    values: np.ndarray
    layer_indices: Sequence[int]

    @property
    def token_end(self) -> int:
        return self.token_start + len(self.token_ids)


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.off = buf, 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.off + size > len(self.buf):
            raise UnsupportedLayout(f"state blob ends early at byte {self.off} (needed {fmt})")
        (v,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += size
        return int(v)

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        nbytes = count * dtype.itemsize
        if self.off + nbytes > len(self.buf):
            raise UnsupportedLayout(f"state blob ends early at byte {self.off} (tensor data)")
        a = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.off)
        self.off += nbytes
        return a


def _dtype(type_id: int, what: str) -> np.dtype:
    if type_id not in GGML_TYPES:
        raise UnsupportedLayout(
            f"{what} has ggml type {type_id}; EdgeKV slices only f16/f32 KV. Run llama.cpp "
            "without a quantized KV cache (type_k/type_v = f16) to enable reuse")
    return GGML_TYPES[type_id]


def _read_cache(r: _Reader, layers: tuple[int, ...], n_embd_k: int, n_embd_v: int,
                what: str) -> tuple[KVSection, bool | None]:
    """One KV cache: the section of the one stream that holds the sequence's cells, and
    v_trans (None when it holds no cells). A context with a KV stream per sequence
    (llama.cpp's kv_unified=false) writes every stream's cell count, the others' 0."""
    n_stream = r.take("<I")
    if not 1 <= n_stream <= 256:
        raise UnsupportedLayout(f"{n_stream} KV streams in the state; not a llama.cpp blob "
                                "EdgeKV understands")
    found: tuple[KVSection, bool | None] | None = None
    for _ in range(n_stream):
        n = r.take("<I")
        if n == 0:
            continue
        if found is not None:
            raise UnsupportedLayout(f"{what} holds cells in several KV streams (a whole "
                                    "multi-sequence context); EdgeKV reads one sequence")
        found = _read_stream(r, n, layers, n_embd_k, n_embd_v, what)
    if found is None:
        return KVSection(layers, 0, tuple(np.zeros((0, n_embd_k), np.float16) for _ in layers),
                         tuple(np.zeros((0, n_embd_v), np.float16) for _ in layers)), None
    return found


def _read_stream(r: _Reader, n: int, layers: tuple[int, ...], n_embd_k: int, n_embd_v: int,
                 what: str) -> tuple[KVSection, bool]:
    """One stream's `n` cells, then its K and V."""
    cells = r.array(_CELL, n)
    if np.any(cells["n_seq"] != 1):
        raise UnsupportedLayout("cells shared by several sequences or with a per-cell extension "
                                "(M-RoPE/n-gram models); not supported")
    order = np.argsort(cells["pos"], kind="stable")
    start = int(cells["pos"][order[0]])
    if not np.array_equal(cells["pos"][order], np.arange(start, start + n)):
        raise UnsupportedLayout(f"{what} positions are not a gap-free range (context shift or "
                                "another sequence's cells); not reusable")
    v_trans = r.take("<I")
    if (got := r.take("<I")) != len(layers):
        raise UnsupportedLayout(f"{what} has {got} layers, the model {len(layers)} there "
                                "(hybrid/recurrent memory, another sliding-window pattern or "
                                "another model)")
    keys = []
    for il in layers:
        dt = _dtype(r.take("<i"), f"K of layer {il}")
        if (row := r.take("<Q")) != n_embd_k * dt.itemsize:
            raise UnsupportedLayout(
                f"K row of layer {il} is {row} B, expected {n_embd_k}x{dt.itemsize}")
        keys.append(r.array(dt, n * n_embd_k).reshape(n, n_embd_k))
    values = []
    for il in layers:
        dt = _dtype(r.take("<i"), f"V of layer {il}")
        if v_trans:
            if r.take("<I") != dt.itemsize or r.take("<I") != n_embd_v:
                raise UnsupportedLayout(f"V of layer {il}: unexpected element size/width")
            values.append(r.array(dt, n * n_embd_v).reshape(n_embd_v, n).T)
        else:
            if (row := r.take("<Q")) != n_embd_v * dt.itemsize:
                raise UnsupportedLayout(f"V row of layer {il} is {row} B")
            values.append(r.array(dt, n * n_embd_v).reshape(n, n_embd_v))
    if not np.array_equal(order, np.arange(n)):  # cells out of position order: copies
        keys, values = [k[order] for k in keys], [v[order] for v in values]
    return KVSection(layers, start, tuple(keys), tuple(values)), bool(v_trans)


def parse_seq_state(blob: bytes | bytearray | memoryview, *, n_layer: int, n_embd_k: int,
                    n_embd_v: int, swa_layers: Sequence[int] = ()) -> SeqState:
    """Decode a blob into canonical keys/values, ordered by position. `swa_layers`: the
    model's sliding-window layers (the blob then holds the global cache, then the SWA one)."""
    r = _Reader(memoryview(blob).cast("B"))
    if (magic := r.take("<I")) != SEQ_MAGIC:
        raise UnsupportedLayout(f"sequence-state magic {magic:#x}, expected {SEQ_MAGIC:#x}")
    r.take("<i")  # seq_id of the writer
    swa = tuple(sorted(set(swa_layers)))
    groups = [tuple(i for i in range(n_layer) if i not in swa)]
    if swa:
        groups.append(swa)
    names = ["the global KV cache", "the sliding-window KV cache"] if swa else ["the KV cache"]
    sections, flags = [], []
    for layers, what in zip(groups, names):
        section, v_trans = _read_cache(r, layers, n_embd_k, n_embd_v, what)
        sections.append(section)
        flags.append(v_trans)
    if r.off != len(r.buf):
        raise UnsupportedLayout(f"{len(r.buf) - r.off} unexpected trailing bytes in the state")
    base = sections[0]
    if base.start != 0:
        raise UnsupportedLayout(f"the global KV cache starts at position {base.start}, not 0")
    for s in sections[1:]:
        if s.n and s.end != base.end:
            raise UnsupportedLayout(f"the sliding-window cache ends at {s.end}, the global one "
                                    f"at {base.end}")
        if base.end and not s.n:
            raise UnsupportedLayout("the sliding-window cache holds no cells for a non-empty "
                                    "sequence")
    known = {f for f in flags if f is not None}
    if len(known) > 1:
        raise UnsupportedLayout("the KV caches disagree on the V layout (v_trans)")
    return SeqState(tuple(sections), known.pop() if known else True)


class SeqStateWriter:
    """A blob llama.cpp restores as one sequence, filled in place.

    `sections`: per KV cache, (its layers in blob order, its first position); every cache ends
    at position n. The header and cell records are written at construction; `k(layer)` and
    `v(layer)` are writable [position - start, width] views into the blob (V is a transposed
    view when llama.cpp keeps V transposed), so fragments are copied exactly once, straight
    into the bytes llama.cpp reads. Cells not written stay zero.
    """

    def __init__(self, n_layer: int, n: int, n_embd_k: int, n_embd_v: int, dtype: np.dtype,
                 *, v_trans: bool, seq_id: int = 0, n_stream: int = 1,
                 sections: Sequence[tuple[Sequence[int], int]] | None = None) -> None:
        dt = np.dtype(dtype).newbyteorder("<")
        tid = _TYPE_IDS[dt]
        if sections is None:
            sections = [(range(n_layer), 0)]
        k_head = struct.pack("<iQ", tid, n_embd_k * dt.itemsize)
        v_head = (struct.pack("<iII", tid, dt.itemsize, n_embd_v) if v_trans
                  else struct.pack("<iQ", tid, n_embd_v * dt.itemsize))
        parts: list[tuple[bytes, tuple[int, ...], int]] = []
        total = 8
        empty_streams = 4 * (n_stream - 1)  # their u32 cell counts, 0
        for layers, start in sections:
            m = n - start
            if not 0 <= start <= n:
                raise UnsupportedLayout(f"section start {start} outside [0, {n}]")
            cells = np.zeros(m, _CELL)
            cells["pos"] = np.arange(start, n)
            cells["n_seq"] = 1
            cells["seq"] = seq_id
            # the cells in the first stream, the other streams' cell counts 0 after its data
            # (the blob is zeroed): llama.cpp restores a sequence into its own stream,
            # whichever stream of the blob holds the cells
            head = struct.pack("<II", n_stream, m)
            if m:
                head += cells.tobytes() + struct.pack("<II", 1 if v_trans else 0, len(layers))
            parts.append((head, tuple(layers), m))
            total += empty_streams
            if m:
                total += len(head) + len(layers) * (len(k_head) + len(v_head)
                                                    + m * (n_embd_k + n_embd_v) * dt.itemsize)
            else:
                total += len(head)
        self.blob = bytearray(total)
        mv = memoryview(self.blob)
        mv[:8] = struct.pack("<Ii", SEQ_MAGIC, seq_id)
        off = 8
        self._k: dict[int, np.ndarray] = {}
        self._v: dict[int, np.ndarray] = {}
        self._start: dict[int, int] = {}
        for head, layers, m in parts:
            mv[off : off + len(head)] = head
            off += len(head) + (0 if m else empty_streams)
            if not m:
                continue
            for il in layers:
                mv[off : off + len(k_head)] = k_head
                off += len(k_head)
                self._k[il] = np.frombuffer(self.blob, dt, m * n_embd_k, off).reshape(m, n_embd_k)
                self._start[il] = n - m
                off += m * n_embd_k * dt.itemsize
            for il in layers:
                mv[off : off + len(v_head)] = v_head
                off += len(v_head)
                if v_trans:
                    arr = np.frombuffer(self.blob, dt, m * n_embd_v, off).reshape(n_embd_v, m).T
                else:
                    arr = np.frombuffer(self.blob, dt, m * n_embd_v, off).reshape(m, n_embd_v)
                self._v[il] = arr
                off += m * n_embd_v * dt.itemsize
            off += empty_streams

    def k(self, layer: int) -> np.ndarray:
        return self._k[layer]

    def v(self, layer: int) -> np.ndarray:
        return self._v[layer]

    def start(self, layer: int) -> int:
        """The first position `k(layer)`/`v(layer)` hold (their row 0)."""
        return self._start[layer]


def assemble_seq_state(keys: np.ndarray, values: np.ndarray, *, v_trans: bool,
                       seq_id: int = 0) -> bytearray:
    """Build a blob from whole keys/values[layer, token, width] arrays."""
    n_layer, n, n_embd_k = keys.shape
    w = SeqStateWriter(n_layer, n, n_embd_k, values.shape[2], keys.dtype, v_trans=v_trans,
                       seq_id=seq_id)
    for il in range(n_layer):
        w.k(il)[:] = keys[il]
        w.v(il)[:] = values[il]
    return w.blob
