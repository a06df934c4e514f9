"""Placing cached passages at new positions in a llama.cpp context (passage reuse, opt-in).

A passage's KV is cached as computed at one position; in another request it sits elsewhere.
RoPE rotates each K pair by `position * theta_i`, and rotations add, so K at position p+d is
K at p rotated by `d * theta_i`: that is what llama.cpp's own K-shift (`llama_memory_seq_add`)
computes on the cache. It is done here on the extracted tensors instead (numpy, float32, then
back to the KV dtype), for two reasons: `llama_memory_seq_add` shifts cells already in the
context, while a cached passage enters through a state blob (`llama_state_seq_set_data`),
which wipes the sequence and takes the blob's positions as they are; and llama.cpp only
decodes a sequence at consecutive positions after its last cell, so the recompute of chosen
tokens has to happen as the context is built, run by run, not in place afterwards.

V carries no position, so it moves unchanged. The rotation follows ggml's `rope_ext` with
`ext_factor = 0` and `attn_factor = 1`: "normal" style rotates pairs (2i, 2i+1) (llama,
SmolLM2), NEOX pairs (i, i + n_rot/2) (Qwen, Gemma, Phi); only the first `n_rot` dimensions of
each head turn. Anything else (M-RoPE, YaRN or other scaled RoPE, sliding-window layers) is
refused by `rope_spec` with the reason.

The adapter is reached only through its public llama.cpp surface (`LlamaBoundary`, the part
of `LlamaCppAdapter` used here): `rope_info`, `read_state`, `read_state_blob`,
`restore_cells` (the adapter's one state restore), `decode` and `shift_cells`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import EngineError, UnsupportedLayout
from .base import KVAdapter, KVRun
from .llamacpp_state import CellBlock, Cells, SeqState, parse_seq_state

__all__ = ["LlamaBoundary", "LlamaCppPassages", "PlacedRun", "RopeInfo", "RopeSpec",
           "rope_spec"]

PlacedRun = KVRun  # the runs `LlamaCppPassages.build` takes (`passages.PlacedRun`)

_STYLES = {0: "norm", 2: "neox"}  # LLAMA_ROPE_TYPE_NORM, LLAMA_ROPE_TYPE_NEOX


@dataclass(frozen=True, slots=True)
class RopeInfo:
    """How a model rotates K, as llama.cpp loaded it (`LlamaCppAdapter.rope_info`)."""

    architecture: str
    n_swa: int  # sliding window (0: none)
    rope_type: int  # llama.cpp's LLAMA_ROPE_TYPE_* (-1: no RoPE)
    scaling: str  # the GGUF's rope.scaling.type, lower case ("none" if absent)
    n_rot: int  # rotated dimensions per head
    freq_base: float
    freq_scale: float  # llama_model_rope_freq_scale_train


class LlamaBoundary(KVAdapter, Protocol):
    """What passage placement uses of `LlamaCppAdapter`: the adapter protocol and the public
    llama.cpp surface below (this module never imports `llamacpp`)."""

    def rope_info(self) -> RopeInfo: ...

    def read_state(self) -> SeqState: ...

    def read_state_blob(self) -> bytes: ...

    def restore_cells(self, blocks: Sequence[CellBlock], n: int, *,
                      keep: SeqState | None = None) -> int: ...

    def decode(self, items: Sequence[tuple[int, int, int, bool]]) -> list[np.ndarray]: ...

    def shift_cells(self, delta: int) -> None: ...


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """How a model rotates K: enough to move K from one position to another."""

    style: str  # "norm" or "neox"
    n_rot: int  # rotated dimensions per head (from the start of the head)
    head_dim: int
    freq_base: float
    freq_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.style not in ("norm", "neox"):
            raise UnsupportedLayout(f"RoPE style {self.style!r}: only norm and neox shift")
        if not 0 < self.n_rot <= self.head_dim or self.n_rot % 2:
            raise UnsupportedLayout(f"RoPE over {self.n_rot} of {self.head_dim} dims")

    def rotate(self, keys: np.ndarray, delta: np.ndarray | int) -> np.ndarray:
        """`keys[..., token, n_head * head_dim]` moved by `delta` positions (one per token, or
        one for all), in the keys' dtype. Computed in float64 angles, float32 products."""
        if np.all(np.asarray(delta) == 0):
            return keys
        *lead, n_tok, width = keys.shape
        if width % self.head_dim:
            raise UnsupportedLayout(f"K width {width} is not a multiple of {self.head_dim}")
        d = np.broadcast_to(np.asarray(delta, np.float64), (n_tok,))
        half = self.n_rot // 2
        # ggml: theta_scale = base^(-2/n_dims); theta_i = p * freq_scale * theta_scale^i
        inv = self.freq_scale * np.power(self.freq_base, -2.0 * np.arange(half) / self.n_rot)
        ang = d[:, None] * inv[None, :]  # [token, half]
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        k = keys.astype(np.float32).reshape(*lead, n_tok, width // self.head_dim, self.head_dim)
        out = k.copy()
        if self.style == "norm":
            x0, x1 = k[..., 0 : self.n_rot : 2], k[..., 1 : self.n_rot : 2]
            lo, hi = slice(0, self.n_rot, 2), slice(1, self.n_rot, 2)
        else:
            x0, x1 = k[..., :half], k[..., half : self.n_rot]
            lo, hi = slice(0, half), slice(half, self.n_rot)
        c, s = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        out[..., lo] = x0 * c - x1 * s
        out[..., hi] = x0 * s + x1 * c
        return out.reshape(keys.shape).astype(keys.dtype)


def rope_spec(adapter: LlamaBoundary) -> RopeSpec:
    """The model's RoPE as a `RopeSpec`, or `UnsupportedLayout` saying why its passages cannot
    be moved: sliding-window layers (their cells are dropped as the window moves, so a
    passage's cached KV is not what the layer attends to), M-RoPE / vision RoPE (positions are
    several numbers per token), scaled RoPE other than linear (YaRN, LongRoPE: the rotation is
    not a plain delta), models without RoPE."""
    info = adapter.rope_info()
    arch, rtype, scaling = info.architecture, info.rope_type, info.scaling
    if info.n_swa > 0:
        raise UnsupportedLayout(
            f"{arch} has sliding-window attention layers (window "
            f"{info.n_swa}); passage reuse needs every layer to keep "
            "every cell. Use strict prefix reuse for this model")
    if rtype not in _STYLES:
        what = {-1: "no RoPE", 8: "M-RoPE", 40: "interleaved M-RoPE", 24: "vision RoPE"}
        raise UnsupportedLayout(
            f"{arch} uses {what.get(rtype, f'RoPE type {rtype}')}; passage reuse can only "
            "re-rotate plain (normal or NEOX) RoPE. Use strict prefix reuse for this model")
    if scaling not in ("none", "linear"):
        raise UnsupportedLayout(f"{arch} uses {scaling} RoPE scaling; passage reuse re-rotates "
                                "only unscaled or linearly scaled RoPE")
    return RopeSpec(style=_STYLES[rtype], n_rot=info.n_rot,
                    head_dim=adapter.fingerprint.head_dim_k, freq_base=info.freq_base,
                    freq_scale=info.freq_scale)


class LlamaCppPassages:
    """Builds a context from cached runs and computed runs, in order (see the module doc)."""

    def __init__(self, adapter: LlamaBoundary) -> None:
        self.adapter = adapter
        self.rope = rope_spec(adapter)
        self.restores = 0  # state blobs written (each one copies the whole context)

    def shift_keys(self, keys: np.ndarray, delta: int) -> np.ndarray:
        """`keys[layer, token, width]` moved by `delta` positions (`RopeSpec.rotate`)."""
        return self.rope.rotate(keys, delta)

    def build(self, runs: Sequence[PlacedRun]) -> int:
        """Extend what the engine holds by `runs`: consecutive cached runs go in with one
        state restore (holding the context so far, then them), computed runs are evaluated
        after them, seeing everything before. Returns the new length."""
        a = self.adapter
        pending: list[PlacedRun] = []
        for run in runs:
            if run.keys is None:
                if pending:
                    self._restore(pending)
                    pending = []
                a.prefill(run.tokens, align=a.n_ctx)
            else:
                pending.append(run)
        if pending:
            self._restore(pending)
        return a.n_tokens

    def layer_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V [token, width] of one layer of what the engine holds (copies)."""
        state = self.adapter.read_state()
        return np.array(state.keys[layer]), np.array(state.values[layer])

    def decode_at(self, tokens: Sequence[int], start: int, *, clear: bool = True) -> None:
        """Evaluate `tokens` at positions start, start+1, ... (in an empty context, where
        llama.cpp takes any first position, unless `clear` is False): the reference for
        "computed at p" in the shift tests. The adapter's token bookkeeping is not kept."""
        if clear:
            self.adapter.clear_kv_cache()
        n = len(tokens)
        self.adapter.decode([(int(t), start + i, 0, i == n - 1) for i, t in enumerate(tokens)])

    def llama_shift(self, delta: int) -> None:
        """llama.cpp's own K-shift: every cell of seq 0 moved by `delta` positions
        (`llama_memory_seq_add`; K is re-rotated at the next decode). The reference the
        rotation here is tested against."""
        self.adapter.shift_cells(delta)

    def positions_kv(self) -> tuple[np.ndarray, np.ndarray]:
        """All cells' positions and K [layer, cell, width] as llama.cpp holds them, whatever
        their positions (`read_state` wants 0..n-1; `decode_at` leaves others)."""
        buf = self.adapter.read_state_blob()
        pos = _cell_positions(memoryview(buf))
        n = len(pos)
        if not n:
            return pos, np.zeros((0,))
        # rewrite the positions as 0..n-1 in a copy and parse that
        copy = bytearray(buf)
        for i in range(n):
            struct.pack_into("<i", copy, 16 + 12 * i, i)
        fp = self.adapter.fingerprint
        state = parse_seq_state(copy, n_layer=fp.n_layer, n_embd_k=fp.n_embd_k,
                                n_embd_v=fp.n_embd_v)
        return pos, np.array(state.keys)

    # -- private helpers -----------------------------------------------------------------

    def _restore(self, runs: Sequence[PlacedRun]) -> None:
        """Replace the sequence with what it holds followed by `runs` (one blob, written by
        the adapter's own restore)."""
        a = self.adapter
        held = a.n_tokens
        state = a.read_state() if held else None
        n = held + sum(len(r.tokens) for r in runs)
        if n > a.n_ctx:
            raise EngineError(f"{n} tokens exceed the context window ({a.n_ctx})")
        layers = range(a.fingerprint.n_layer)
        blocks: list[Cells] = []
        pos = held
        for r in runs:
            assert r.keys is not None and r.values is not None
            blocks.append(Cells(pos, [int(t) for t in r.tokens], r.keys, r.values, layers))
            pos += len(r.tokens)
        a.restore_cells(blocks, n, keep=state)
        self.restores += 1


def _cell_positions(buf: memoryview) -> np.ndarray:
    """The cell positions of a one-stream sequence-state blob (see `llamacpp_state`)."""
    (n,) = struct.unpack_from("<I", buf, 12)
    cells = np.frombuffer(buf, dtype=np.dtype([("pos", "<i4"), ("n", "<u4"), ("s", "<i4")]),
                          count=n, offset=16)
    return np.array(cells["pos"])
