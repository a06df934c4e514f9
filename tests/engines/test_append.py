"""`KVAdapter.append_fragments`: KV appended after what an engine holds equals the same KV
injected whole, and a refused append leaves the context as it was. The fake engine runs for
real; the torch and onnx adapters' own arrays are exercised without a model (their KV lives in
a DynamicCache / numpy arrays the adapter fills; no forward pass is needed to compare them)."""

from __future__ import annotations

import numpy as np
import pytest

from edgekv import IncompatibleFragment
from edgekv.engines.base import FragmentSpec
from edgekv.engines.fake import FakeAdapter
from edgekv.engines.shared import build_fragments
from edgekv.keys import ModelFingerprint

PROMPT = list(range(3, 3 + 64 * 3))


def chunks(a, n=3, c=64):
    a.clear_kv_cache()
    a.prefill(PROMPT[: n * c], align=c)
    return a.extract_fragments([FragmentSpec(f"k{i}", i * c, (i + 1) * c) for i in range(n)])


def test_fake_append_equals_inject_and_computing():
    a = FakeAdapter()
    frags = chunks(a)
    cold = a.prefill([9], align=64)
    a.clear_kv_cache()
    a.prefill(PROMPT[:64], align=64)  # chunk 0 computed here, chunks 1-2 arrive from elsewhere
    assert a.append_fragments(frags[1:]) == 192 and a.token_ids == PROMPT
    assert np.array_equal(a.prefill([9], align=64), cold)
    a.inject_fragments(frags[:1])
    assert a.append_fragments([]) == 64  # nothing to append: nothing changes
    assert a.append_fragments(frags[1:2]) == 128
    assert np.array_equal(a.extract_fragments([FragmentSpec("x", 64, 128)])[0].keys,
                          frags[1].keys)


def test_a_refused_append_leaves_the_context_as_it_was():
    a = FakeAdapter()
    frags = chunks(a)
    a.inject_fragments(frags[:1])
    with pytest.raises(IncompatibleFragment, match="gap"):
        a.append_fragments(frags[2:])  # chunk 1 is missing
    with pytest.raises(IncompatibleFragment, match="another model"):
        a.append_fragments(chunks(FakeAdapter(tag="other"))[1:2])
    assert a.token_ids == PROMPT[:64]
    small = FakeAdapter(n_ctx=100)
    small.inject_fragments(frags[:1])
    with pytest.raises(IncompatibleFragment, match="context"):
        small.append_fragments(frags[1:2])
    assert small.n_tokens == 64


FP = ModelFingerprint(file_sha256="w", architecture="llama", n_layer=3, n_head_kv=2,
                      head_dim_k=4, head_dim_v=4, kv_dtype="f32", engine="test/1",
                      rope="base=10000,dims=4")


def random_chunks(n=3, c=64):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((FP.n_layer, n * c, FP.n_embd_k)).astype(np.float32)
    v = rng.standard_normal((FP.n_layer, n * c, FP.n_embd_v)).astype(np.float32)
    specs = [FragmentSpec(f"k{i}", i * c, (i + 1) * c) for i in range(n)]
    return build_fragments(specs, FP, PROMPT[: n * c], lambda li, tok: (k[li, tok], v[li, tok]))


def bare(cls, **attrs):
    """An adapter object without its model: only the state the KV methods touch."""
    a = cls.__new__(cls)
    a.fingerprint, a._n_ctx = FP, 4096
    for name, value in attrs.items():
        setattr(a, name, value)
    a.clear_kv_cache()
    return a


def test_onnx_append_equals_inject():
    from edgekv.engines.onnx import OnnxAdapter

    frags = random_chunks()
    whole, parts = bare(OnnxAdapter), bare(OnnxAdapter)
    whole.inject_fragments(frags)
    parts.inject_fragments(frags[:1])
    assert parts.append_fragments(frags[1:]) == 192
    assert np.array_equal(parts._k, whole._k) and np.array_equal(parts._v, whole._v)
    assert parts.token_ids == whole.token_ids == PROMPT
    empty = bare(OnnxAdapter)
    empty.append_fragments(frags[:1])
    assert np.array_equal(empty._k, whole._k[:, :, :, :64])


def test_torch_append_equals_inject():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from edgekv.engines.torch import TorchAdapter

    frags = random_chunks()
    whole, parts = bare(TorchAdapter, _torch=torch), bare(TorchAdapter, _torch=torch)
    whole.inject_fragments(frags)
    parts.append_fragments(frags[:1])  # onto an empty context
    assert parts.append_fragments(frags[1:]) == 192
    for li in range(FP.n_layer):
        assert torch.equal(parts._cache.layers[li].keys, whole._cache.layers[li].keys)
        assert torch.equal(parts._cache.layers[li].values, whole._cache.layers[li].values)
    assert parts.token_ids == whole.token_ids == PROMPT
