"""The ONNX Runtime adapter: exported once with explicit KV inputs/outputs, exact same-engine
reuse through the cache, measured cross-engine injection."""

from __future__ import annotations

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, open_store
from edgekv.engines.base import FragmentSpec
from edgekv.engines.layout import can_inject, convert_fragment
from edgekv_bench.texts import MANUAL

from ..conftest import real_stack

real_stack("onnx engine", "onnxruntime", "transformers")

from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402
from edgekv.engines.onnx import OnnxAdapter  # noqa: E402

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def onnx(tmp_path_factory):
    a = OnnxAdapter(n_ctx=1024, memo_dir=tmp_path_factory.mktemp("onnx"))
    yield a
    a.close()


def test_export_is_cached_and_reuse_equals_cold(onnx, tmp_path):
    assert onnx.fingerprint.engine.startswith("onnxruntime/")
    assert onnx.weight_bytes > 10**7  # the exported graph with its weights
    cfg = CacheConfig(cache_dir=tmp_path)
    kv = EdgeKV(onnx, open_store(cfg), cfg)
    prompt = onnx.tokenize(MANUAL)[:300]
    cold = kv.generate(prompt, max_tokens=12, use_cache=False, keep_logits=True)
    kv.generate(prompt, max_tokens=1)
    warm = kv.generate(prompt, max_tokens=12, keep_logits=True)
    assert warm.cached_tokens == 256 and warm.tokens == cold.tokens
    assert all(np.array_equal(w, c) for w, c in zip(warm.step_logits, cold.step_logits))
    kv.close()


def test_llamacpp_fragment_converts_into_onnx(onnx):
    lc = LlamaCppAdapter(n_ctx=1024)
    try:
        ids = lc.tokenize(MANUAL)[:256]
        q = lc.tokenize("\nQuestion: what does an orange ring mean?\nAnswer:", add_bos=False)
        lc.clear_kv_cache()
        lc.prefill(ids, align=128)
        frags = lc.extract_fragments([FragmentSpec("a", 0, 128), FragmentSpec("b", 128, 256)])
        assert can_inject(frags[0], lc.fingerprint, onnx.fingerprint).kind == "no"  # measured
        assert can_inject(frags[0], lc.fingerprint, onnx.fingerprint,
                          allow={("llama.cpp", "onnxruntime"): True}).kind == "convert"
        onnx.clear_kv_cache()
        cold = onnx.prefill(ids + q, align=128)
        onnx.clear_kv_cache()
        onnx.inject_fragments([convert_fragment(f, onnx.fingerprint) for f in frags])
        warm = onnx.prefill(q, align=128)
        assert 0 < float(np.max(np.abs(warm - cold))) < 2.0
        assert int(np.argmax(warm)) == int(np.argmax(cold))
        # and back: an f32 fragment into llama.cpp is refused by default (measured < 100%)
        onnx_frag = onnx.extract_fragments([FragmentSpec("a", 0, 128)])[0]
        assert can_inject(onnx_frag, onnx.fingerprint, lc.fingerprint).kind == "no"
    finally:
        lc.close()
