"""Parse and assemble llama.cpp sequence-state blobs (`llama_state_seq_get/set_data`).

Layout (llama.cpp `llama_context::state_seq_get_data` + `llama_kv_cache::state_write`), LE:

    u32 magic 0xaf143cd8 | i32 seq_id | u32 n_stream
    per stream: u32 cell_count; if > 0:
        per cell: i32 pos, u32 n_seq_id, i32 seq_id * n_seq_id
        u32 v_trans, u32 n_layer
        per layer K: i32 type, u64 row_bytes, cell_count rows
        V (v_trans=0): per layer: i32 type, u64 row_bytes, cell_count rows
        V (v_trans=1): per layer: i32 type, u32 elem_bytes, u32 n_embd_v, n_embd_v x cell_count

Only what can be sliced and reassembled safely is accepted: one stream, one sequence, plain
f16/f32 K and V, no per-cell extension (M-RoPE / n-gram models), every byte accounted for.
Anything else raises `UnsupportedLayout` with what was found, so the cache falls back to
recomputing instead of feeding llama.cpp a state it would misread.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedLayout

__all__ = ["SEQ_MAGIC", "SeqState", "SeqStateWriter", "assemble_seq_state", "parse_seq_state"]

SEQ_MAGIC = 0xAF143CD8
# GGML_TYPE_F32, GGML_TYPE_F16
GGML_TYPES: dict[int, np.dtype] = {0: np.dtype("<f4"), 1: np.dtype("<f2")}
_TYPE_IDS = {np.dtype("<f4"): 0, np.dtype("<f2"): 1}


@dataclass(frozen=True, slots=True)
class SeqState:
    """One sequence's KV in canonical layout: keys/values[layer, position, width]."""

    keys: np.ndarray
    values: np.ndarray
    v_trans: bool

    @property
    def n_tokens(self) -> int:
        return int(self.keys.shape[1])


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


def parse_seq_state(blob: bytes | bytearray | memoryview, *, n_layer: int, n_embd_k: int,
                    n_embd_v: int) -> SeqState:
    """Decode a blob into canonical keys/values, ordered by position 0..n-1."""
    r = _Reader(memoryview(blob).cast("B"))
    if (magic := r.take("<I")) != SEQ_MAGIC:
        raise UnsupportedLayout(f"sequence-state magic {magic:#x}, expected {SEQ_MAGIC:#x}")
    r.take("<i")  # seq_id of the writer
    if (n_stream := r.take("<I")) != 1:
        raise UnsupportedLayout(f"{n_stream} KV streams; EdgeKV supports a unified single stream")
    n = r.take("<I")
    if n == 0:
        if r.off != len(r.buf):
            raise UnsupportedLayout("empty sequence state followed by unexpected bytes")
        empty = np.zeros((n_layer, 0, n_embd_k), np.float16)
        return SeqState(empty, np.zeros((n_layer, 0, n_embd_v), np.float16), True)
    cells = r.array(np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")]), n)
    if np.any(cells["n_seq"] != 1):
        raise UnsupportedLayout("cells shared by several sequences or with a per-cell extension "
                                "(M-RoPE/n-gram models); not supported")
    order = np.argsort(cells["pos"], kind="stable")
    if not np.array_equal(cells["pos"][order], np.arange(n)):
        raise UnsupportedLayout("sequence positions are not a gap-free range 0..n-1 "
                                "(context shift or SWA masking); not reusable")
    v_trans = r.take("<I")
    if (layers := r.take("<I")) != n_layer:
        raise UnsupportedLayout(f"state has {layers} layers, the model {n_layer} (hybrid/SWA "
                                "memory or another model)")
    keys = []
    for il in range(n_layer):
        dt = _dtype(r.take("<i"), f"K of layer {il}")
        if (row := r.take("<Q")) != n_embd_k * dt.itemsize:
            raise UnsupportedLayout(
                f"K row of layer {il} is {row} B, expected {n_embd_k}x{dt.itemsize}")
        keys.append(r.array(dt, n * n_embd_k).reshape(n, n_embd_k))
    values = []
    for il in range(n_layer):
        dt = _dtype(r.take("<i"), f"V of layer {il}")
        if v_trans:
            if r.take("<I") != dt.itemsize or r.take("<I") != n_embd_v:
                raise UnsupportedLayout(f"V of layer {il}: unexpected element size/width")
            values.append(r.array(dt, n * n_embd_v).reshape(n_embd_v, n).T)
        else:
            if (row := r.take("<Q")) != n_embd_v * dt.itemsize:
                raise UnsupportedLayout(f"V row of layer {il} is {row} B")
            values.append(r.array(dt, n * n_embd_v).reshape(n, n_embd_v))
    if r.off != len(r.buf):
        raise UnsupportedLayout(f"{len(r.buf) - r.off} unexpected trailing bytes in the state")
    k, v = np.stack(keys), np.stack(values)
    if not np.array_equal(order, np.arange(n)):
        k, v = k[:, order], v[:, order]
    return SeqState(k, v, bool(v_trans))


class SeqStateWriter:
    """A blob llama.cpp restores as cells 0..n-1 of `seq_id`, filled in place.

    The header and cell records are written at construction; `k(layer)` and `v(layer)` are
    writable [token, width] views into the blob (V is a transposed view when llama.cpp keeps V
    transposed), so fragments are copied exactly once, straight into the bytes llama.cpp reads.
    """

    def __init__(self, n_layer: int, n: int, n_embd_k: int, n_embd_v: int, dtype: np.dtype,
                 *, v_trans: bool, seq_id: int = 0) -> None:
        dt = np.dtype(dtype).newbyteorder("<")
        tid = _TYPE_IDS[dt]
        cells = np.zeros(n, dtype=[("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
        cells["pos"] = np.arange(n)
        cells["n_seq"] = 1
        cells["seq"] = seq_id
        head = (struct.pack("<IiII", SEQ_MAGIC, seq_id, 1, n) + cells.tobytes()
                + struct.pack("<II", 1 if v_trans else 0, n_layer))
        k_head = struct.pack("<iQ", tid, n_embd_k * dt.itemsize)
        v_head = (struct.pack("<iII", tid, dt.itemsize, n_embd_v) if v_trans
                  else struct.pack("<iQ", tid, n_embd_v * dt.itemsize))
        k_bytes, v_bytes = n * n_embd_k * dt.itemsize, n * n_embd_v * dt.itemsize
        total = len(head) + n_layer * (len(k_head) + k_bytes + len(v_head) + v_bytes)
        self.blob = bytearray(total)
        mv = memoryview(self.blob)
        mv[: len(head)] = head
        off = len(head)
        self._k: list[np.ndarray] = []
        self._v: list[np.ndarray] = []
        for _ in range(n_layer):
            mv[off : off + len(k_head)] = k_head
            off += len(k_head)
            self._k.append(np.frombuffer(self.blob, dt, n * n_embd_k, off).reshape(n, n_embd_k))
            off += k_bytes
        for _ in range(n_layer):
            mv[off : off + len(v_head)] = v_head
            off += len(v_head)
            if v_trans:
                arr = np.frombuffer(self.blob, dt, n * n_embd_v, off).reshape(n_embd_v, n).T
            else:
                arr = np.frombuffer(self.blob, dt, n * n_embd_v, off).reshape(n, n_embd_v)
            self._v.append(arr)
            off += v_bytes

    def k(self, layer: int) -> np.ndarray:
        return self._k[layer]

    def v(self, layer: int) -> np.ndarray:
        return self._v[layer]


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
