"""Canonical layout conversions and the compatibility matrix (no engine needed)."""

import dataclasses

import numpy as np
import pytest

from edgekv.engines.layout import (
    can_inject,
    convert_fragment,
    from_head_major,
    rope_pair_perm,
    to_head_major,
)
from edgekv.keys import ModelFingerprint

BASE = dict(file_sha256="w", architecture="llama", n_layer=4, n_head_kv=2, head_dim_k=4,
            head_dim_v=4, kv_dtype="f16", engine="llama.cpp/0.3.36", rope="base=10000,dims=4")


def test_head_major_round_trips_are_exact():
    x = np.random.default_rng(0).standard_normal((5, 2 * 8)).astype(np.float32)
    for is_key in (True, False):
        hm = to_head_major(x, 2, is_key=is_key)
        assert hm.shape == (2, 5, 8)
        assert np.array_equal(from_head_major(hm, is_key=is_key), x)


def test_rope_pair_permutation_maps_halves_to_pairs():
    # canonical (llama.cpp) channel 2i is HF channel i; 2i+1 is HF channel d/2 + i
    assert rope_pair_perm(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    hf = np.arange(8, dtype=np.float32)[None, None, :]  # one head, one token
    assert from_head_major(hf, is_key=True)[0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert from_head_major(hf, is_key=False)[0].tolist() == list(range(8))  # V untouched


@pytest.mark.parametrize("field, value", [
    ("file_sha256", "other-weights"), ("architecture", "gemma3"), ("n_layer", 5),
    ("n_head_kv", 4), ("head_dim_k", 8), ("head_dim_v", 8), ("rope", "base=500000,dims=4"),
])
def test_each_mismatch_is_refused_with_its_reason(fragment_factory, field, value):
    src = ModelFingerprint(**BASE)
    dst = ModelFingerprint(**{**BASE, field: value, "engine": "torch/2.13.0"})
    f = fragment_factory(n_layer=4, width=8, fingerprint=src.digest)
    v = can_inject(f, src, dst)
    assert v.kind == "no" and field in v.reason and not v


def test_same_engine_yes_cross_engine_by_policy(fragment_factory):
    src = ModelFingerprint(**BASE)
    f = fragment_factory(n_layer=4, width=8, fingerprint=src.digest)
    assert can_inject(f, src, src).kind == "yes"
    torch_fp = ModelFingerprint(**{**BASE, "engine": "torch/2.13.0", "kv_dtype": "f32"})
    assert can_inject(f, src, torch_fp).kind == "no"  # off: not measured identical
    assert can_inject(f, src, torch_fp, allow={("llama.cpp", "torch"): True}).kind == "convert"
    back = convert_fragment(f, torch_fp)
    assert back.keys.dtype == np.float32 and np.array_equal(back.keys, f.keys.astype(np.float32))
    g = fragment_factory(n_layer=4, width=8, fingerprint=torch_fp.digest)
    assert can_inject(g, torch_fp, src).kind == "no"  # torch -> llama.cpp measured < 100%
    assert can_inject(g, torch_fp, src, allow={("torch", "llama.cpp"): True}).kind == "convert"
    wrong = dataclasses.replace(f, model_fingerprint="x" * 64, content_hash="")
    assert can_inject(wrong, src, src).kind == "no"
