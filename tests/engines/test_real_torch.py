"""The PyTorch adapter on the same GGUF weights: exact same-engine reuse, measured cross-engine."""

from __future__ import annotations

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, open_store
from edgekv.engines.base import FragmentSpec
from edgekv.engines.layout import can_inject, convert_fragment
from edgekv_bench.texts import MANUAL

from ..conftest import real_stack

real_stack("torch engine", "torch", "transformers", "gguf", "accelerate")

from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402
from edgekv.engines.torch import TorchAdapter  # noqa: E402

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def engines():
    t, lc = TorchAdapter(n_ctx=1024), LlamaCppAdapter(n_ctx=1024)
    yield t, lc
    t.close()
    lc.close()


def test_torch_reuse_through_the_cache_equals_cold(engines, tmp_path):
    t, _ = engines
    cfg = CacheConfig(cache_dir=tmp_path)
    kv = EdgeKV(t, open_store(cfg), cfg)
    prompt = t.tokenize(MANUAL)[:300]
    cold = kv.generate(prompt, max_tokens=12, use_cache=False, keep_logits=True)
    kv.generate(prompt, max_tokens=1)
    warm = kv.generate(prompt, max_tokens=12, keep_logits=True)
    assert warm.cached_tokens == 256 and warm.tokens == cold.tokens
    assert all(np.array_equal(w, c) for w, c in zip(warm.step_logits, cold.step_logits))
    kv.close()


def test_torch_layer_split_extract_inject_round_trip(engines):
    t, _ = engines
    t.clear_kv_cache()
    ids = t.tokenize(MANUAL)[:128]
    t.prefill(ids, align=128)
    whole = t.extract_fragments([FragmentSpec("w", 0, 128)])[0]
    parts = t.extract_fragments([FragmentSpec("a", 0, 128, 0, 11),
                                 FragmentSpec("b", 0, 128, 11, 30)])
    t.clear_kv_cache()
    t.inject_fragments(parts)
    again = t.extract_fragments([FragmentSpec("w", 0, 128)])[0]
    assert np.array_equal(again.keys, whole.keys) and np.array_equal(again.values, whole.values)


def test_llamacpp_fragment_converts_into_torch(engines):
    t, lc = engines
    ids = lc.tokenize(MANUAL)[:256]
    q = lc.tokenize("\nQuestion: how many devices can one hub hold?\nAnswer:", add_bos=False)
    lc.clear_kv_cache()
    lc.prefill(ids, align=128)
    frags = lc.extract_fragments([FragmentSpec("a", 0, 128), FragmentSpec("b", 128, 256)])
    assert can_inject(frags[0], lc.fingerprint, t.fingerprint,
                      allow={("llama.cpp", "torch"): True}).kind == "convert"
    assert can_inject(frags[0], t.fingerprint, lc.fingerprint).kind == "no"  # wrong source
    t.clear_kv_cache()
    cold = t.prefill(ids + q, align=128)
    t.clear_kv_cache()
    t.inject_fragments([convert_fragment(f, t.fingerprint) for f in frags])
    warm = t.prefill(q, align=128)
    diff = float(np.max(np.abs(warm - cold)))
    assert 0 < diff < 2.0  # different numerics (Q4 kernels + f16 KV vs f32): measured, bounded
    assert int(np.argmax(warm)) == int(np.argmax(cold))
