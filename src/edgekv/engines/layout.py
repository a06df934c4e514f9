"""One canonical KV layout, converters to and from each engine's, and the compatibility check.

Canonical (what fragments hold): `keys/values[layer, token, n_head_kv * head_dim]`, f16 or
f32, with each head's K channels in llama.cpp's order. llama.cpp applies RoPE to interleaved
channel pairs (0,1), (2,3), ... while Hugging Face llama rotates the two halves (i, i + d/2);
the GGUF converter permutes the q/k weights so both compute the same attention, which leaves
the cached K channels permuted between the engines. So torch/ONNX K converts with a per-head
channel permutation on top of the head-major transpose ([heads, seq, dim] <-> [seq, heads*dim]);
V has no permutation.

`can_inject(fragment, source, adapter)` answers yes (same engine, same layout), convert (same
weights, architecture, layers, KV heads, head dims and RoPE; another engine or dtype, and the
pair is enabled), or no, with the reason. "no" means recompute, never an error in a request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..fragment import KVFragment
from ..keys import ModelFingerprint

__all__ = ["CROSS_ENGINE_REUSE", "Verdict", "can_inject", "convert_fragment",
           "from_head_major", "rope_pair_perm", "to_head_major"]

# Cross-engine reuse is enabled by default only for a pair that `edgekv bench engines`
# measured identical to the destination's cold run on every prompt (20 prompts x 32 greedy
# tokens, to the first divergence; docs/bench/engines.json, checked against this table by
# tests/engines/test_engines_bench.py); a pair never measured that way stays off. Keys are
# (source engine family, destination engine family). Measured: llama.cpp -> onnxruntime
# identical on 14/20 prompts (first divergence as early as token 3), onnxruntime -> llama.cpp
# 7/20 (token 0): both off. torch pairs: not measured on 20 prompts (too slow on the loaded
# 2-core machine; 3 prompts agreed before, which is not enough): off. Pass `allow` to
# `can_inject` to opt in.
CROSS_ENGINE_REUSE: dict[tuple[str, str], bool] = {
    ("llama.cpp", "onnxruntime"): False, ("onnxruntime", "llama.cpp"): False,
}


def rope_pair_perm(head_dim: int) -> np.ndarray:
    """Index map: canonical (llama.cpp) channel j holds HF channel perm[j]."""
    half = head_dim // 2
    return np.array([j // 2 if j % 2 == 0 else half + j // 2 for j in range(head_dim)])


def to_head_major(x: np.ndarray, n_head: int, *, is_key: bool) -> np.ndarray:
    """Canonical [token, heads*dim] -> HF [heads, token, dim]."""
    t, w = x.shape
    d = w // n_head
    y = x.reshape(t, n_head, d)
    if is_key:
        y = y[..., np.argsort(rope_pair_perm(d))]
    return np.ascontiguousarray(y.transpose(1, 0, 2))


def from_head_major(x: np.ndarray, *, is_key: bool) -> np.ndarray:
    """HF [heads, token, dim] -> canonical [token, heads*dim]."""
    h, t, d = x.shape
    y = x.transpose(1, 0, 2)
    if is_key:
        y = y[..., rope_pair_perm(d)]
    return np.ascontiguousarray(y.reshape(t, h * d))


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str  # "yes", "convert" or "no"
    reason: str = ""

    def __bool__(self) -> bool:
        return self.kind != "no"


def _family(engine: str) -> str:
    return engine.split("/", 1)[0]


def can_inject(fragment: KVFragment, source: ModelFingerprint, dest: ModelFingerprint,
               *, allow: dict[tuple[str, str], bool] | None = None) -> Verdict:
    if fragment.model_fingerprint != source.digest:
        return Verdict("no", "the fragment was not made by the stated source model/engine")
    if source.digest == dest.digest:
        return Verdict("yes")
    for name in ("file_sha256", "architecture", "n_layer", "n_head_kv", "head_dim_k",
                 "head_dim_v", "rope"):
        a, b = getattr(source, name), getattr(dest, name)
        if a != b:
            return Verdict("no", f"{name} differs: {a} vs {b}")
    pair = (_family(source.engine), _family(dest.engine))
    allowed = (allow if allow is not None else CROSS_ENGINE_REUSE).get(pair, False)
    if pair[0] != pair[1] and not allowed:
        return Verdict("no", f"{pair[0]} -> {pair[1]} reuse is not enabled (numerics differ; "
                             "see edgekv bench engines)")
    return Verdict("convert", f"{source.engine} {source.kv_dtype} -> {dest.engine} {dest.kv_dtype}")


def convert_fragment(fragment: KVFragment, dest: ModelFingerprint) -> KVFragment:
    """Re-type a canonical fragment for another engine of the same model (dtype and binding;
    the layout itself is canonical on both sides)."""
    dt = np.float16 if dest.kv_dtype == "f16" else np.float32
    return dataclasses.replace(
        fragment, model_fingerprint=dest.digest, content_hash="",
        keys=fragment.keys.astype(dt, copy=False), values=fragment.values.astype(dt, copy=False))
