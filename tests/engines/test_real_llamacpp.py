"""The real engine and the real model: fidelity, reassembly, persistence, damage, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, UnsupportedLayout, open_store
from edgekv.engines.base import FragmentSpec
from edgekv.engines.models import default_model_path

from ..conftest import real_stack, share_probes

real_stack("real engine", "llama_cpp", check=default_model_path)

from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402

MODEL = default_model_path()

pytestmark = pytest.mark.real
CONTEXT = (Path(__file__).parents[2] / "bench/edgekv_bench/texts.py").read_text()


@pytest.fixture(scope="module")
def adapter():
    a = LlamaCppAdapter(MODEL, n_ctx=2048)
    yield a
    a.close()


@pytest.fixture
def kv(adapter, tmp_path):
    """Whole-chunk reuse, forced (the path of engines that fail the batch-invariance probe);
    reuse that ends at any token is tested in test_real_granularity.py."""
    cfg = CacheConfig(cache_dir=tmp_path, reuse_granularity="chunk")
    k = EdgeKV(adapter, open_store(cfg), cfg)
    yield k
    k.store.close()


def context_tokens(adapter, n=512):
    return adapter.tokenize(CONTEXT)[:n]


def test_warm_output_and_logits_equal_cold(kv, adapter):
    ctx = context_tokens(adapter)
    q1 = adapter.tokenize("\n\nQuestion: How many devices can one hub hold?\nAnswer:",
                          add_bos=False)
    q2 = adapter.tokenize("\n\nQuestion: What does an orange ring mean?\nAnswer:", add_bos=False)
    kv.generate(ctx + q1, max_tokens=4)  # fills the cache from another request
    cold = kv.generate(ctx + q2, max_tokens=16, use_cache=False, keep_logits=True)
    warm = kv.generate(ctx + q2, max_tokens=16, keep_logits=True)
    assert warm.cached_tokens == 512 and warm.computed_tokens == len(q2)
    assert len(warm.tokens) == 16 and warm.tokens == cold.tokens
    assert len(warm.step_logits) == 16
    for w, c in zip(warm.step_logits, cold.step_logits):
        assert np.array_equal(w, c)


def test_token_and_layer_range_fragments_reassemble_bit_identical(adapter):
    adapter.clear_kv_cache()
    adapter.prefill(context_tokens(adapter, 256), align=128)
    before = adapter.read_state_blob()
    specs = [FragmentSpec(f"k{t}", t, t + 128, lo, hi)
             for t in (0, 128) for lo, hi in ((0, 7), (7, 19), (19, 30))]
    frags = adapter.extract_fragments(specs)
    assert [f.keys.shape[0] for f in frags] == [7, 12, 11] * 2
    adapter.clear_kv_cache()
    assert adapter.inject_fragments(frags[::-1]) == 256  # any order
    assert adapter.read_state_blob() == before
    assert adapter.token_ids == context_tokens(adapter, 256)


def test_capabilities_and_the_public_llama_cpp_surface(adapter):
    """The protocols llama.cpp has, and the surface passage placement and the probe use:
    restore_cells keeps what is held and appends cells, bit for bit; decode is a raw batch;
    rope_info describes SmolLM2's plain RoPE."""
    from edgekv.engines.base import KVAdapter, ModelFile, ShiftableKV, WindowedKV
    from edgekv.engines.llamacpp_state import Cells

    assert isinstance(adapter, KVAdapter)
    assert isinstance(adapter, ShiftableKV | WindowedKV | ModelFile)
    assert adapter.n_vocab == 49152 and adapter.window.swa_layers == ()
    assert adapter.model_path == MODEL
    ids = adapter.tokenize(" caf\u00e9", add_bos=False)
    assert b"".join(adapter.token_bytes(t) for t in ids) == " caf\u00e9".encode()
    info = adapter.rope_info()
    assert (info.architecture, info.n_swa, info.rope_type, info.n_rot) == ("llama", 0, 0, 64)

    toks = context_tokens(adapter, 256)
    adapter.clear_kv_cache()
    adapter.prefill(toks, align=128)
    whole = adapter.read_state()
    k, v = np.array(whole.keys[:, 128:]), np.array(whole.values[:, 128:])
    adapter.clear_kv_cache()
    adapter.prefill(toks[:128], align=128)
    n = adapter.restore_cells([Cells(128, toks[128:], k, v, range(30))], 256,
                              keep=adapter.read_state())
    assert n == 256 and adapter.token_ids == toks
    assert np.array_equal(adapter.read_state().keys, whole.keys)
    # a raw decode of the next token sees what `prefill` of it sees after the same restore
    part = [Cells(128, toks[128:255], k[:, :127], v[:, :127], range(30))]
    adapter.restore_cells(part, 255, keep=_held(adapter, toks[:128]))
    (raw,) = adapter.decode([(toks[255], 255, 0, True)])
    adapter.restore_cells(part, 255, keep=_held(adapter, toks[:128]))
    assert np.array_equal(raw, adapter.prefill(toks[255:], align=128))
    adapter.clear_kv_cache()


def _held(adapter, toks):
    """What the engine holds after computing `toks` from an empty context."""
    adapter.clear_kv_cache()
    adapter.prefill(toks, align=128)
    return adapter.read_state()


def test_strided_fragment_is_refused_for_injection(adapter):
    adapter.clear_kv_cache()
    adapter.prefill(context_tokens(adapter, 128), align=128)
    frag = adapter.extract_fragments([FragmentSpec("k", 0, 128, 0, 30, 2)])[0]
    assert list(frag.layer_indices) == list(range(0, 30, 2))
    with pytest.raises(Exception, match="stride"):
        adapter.inject_fragments([frag])


def _cli(tmp_path: Path, prompt: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "edgekv", "generate", "--json", "--max-tokens", "12",
         "--cache-dir", str(share_probes(tmp_path)), prompt],
        capture_output=True, text=True, env=env, timeout=300, check=True)
    return json.loads(out.stdout)


def test_cache_persists_across_processes(tmp_path):
    prompt = CONTEXT[:1500] + "\n\nQuestion: What is the warranty?\nAnswer:"
    first = _cli(tmp_path, prompt)
    second = _cli(tmp_path, prompt)
    assert first["cached_tokens"] == 0 and first["stored_fragments"] >= 2
    assert second["cached_tokens"] >= 256 and second["source_tiers"][0] == "disk"
    assert second["tokens"] == first["tokens"]


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "foreign"])
def test_damaged_or_foreign_disk_entry_is_a_miss(adapter, tmp_path, damage):
    import dataclasses

    from edgekv.serial import decode_fragment, encode_fragment

    cfg = CacheConfig(cache_dir=tmp_path, reuse_granularity="chunk")
    prompt = context_tokens(adapter, 400) + adapter.tokenize(" Answer:", add_bos=False)
    kv = EdgeKV(adapter, open_store(cfg), cfg)
    cold = kv.generate(prompt, max_tokens=8)
    kv.store.close()
    key = kv.chunk_keys(prompt)[1]
    path = next(tmp_path.rglob(f"{key}.ekv"))
    blob = path.read_bytes()
    if damage == "corrupt":
        path.write_bytes(blob[:5000] + bytes([blob[5000] ^ 0xFF]) + blob[5001:])
    elif damage == "truncate":
        path.write_bytes(blob[: len(blob) // 3])
    else:
        frag = decode_fragment(blob)
        path.write_bytes(encode_fragment(dataclasses.replace(
            frag, model_fingerprint="0" * 64, content_hash="")))
    kv2 = EdgeKV(adapter, open_store(cfg), cfg)  # fresh RAM tier: reads come from disk
    warm = kv2.generate(prompt, max_tokens=8)
    kv2.store.close()
    assert warm.cached_tokens == 128  # chunk 0 reused, the damaged chunk 1 recomputed
    assert warm.tokens == cold.tokens
    assert np.array_equal(warm.first_logits, cold.first_logits)


def test_quantized_kv_cache_is_refused():
    with pytest.raises(UnsupportedLayout, match="f16 or f32"):
        LlamaCppAdapter(MODEL, n_ctx=256, type_k=8, type_v=8, flash_attn=True)


def test_flash_attention_layout_also_reuses_exactly(tmp_path):
    a = LlamaCppAdapter(MODEL, n_ctx=1024, flash_attn=True)
    try:
        cfg = CacheConfig(cache_dir=tmp_path, reuse_granularity="chunk")
        kv = EdgeKV(a, open_store(cfg), cfg)
        prompt = context_tokens(a, 300) + a.tokenize(" Answer:", add_bos=False)
        cold = kv.generate(prompt, max_tokens=8, use_cache=False)
        kv.generate(prompt, max_tokens=1)
        warm = kv.generate(prompt, max_tokens=8)
        assert a.read_state().v_trans is False  # V stored row-major with flash attention
        assert warm.cached_tokens == 256 and warm.tokens == cold.tokens
        assert np.array_equal(warm.first_logits, cold.first_logits)
        kv.store.close()
    finally:
        a.close()


def test_serve_and_generate_switch_flash_attention(tmp_path):
    """`--flash-attn` / `--no-flash-attn` reach the engine from `edgekv serve` and `edgekv
    generate`; without either, the engine's default: on with the batch-invariant build that
    `make setup` makes (the probe then decides the granularity as anywhere)."""
    from edgekv.cli import _open, build_parser
    from edgekv.serve.runner import load_edgekv

    cfg = CacheConfig(cache_dir=tmp_path, reuse_granularity="chunk")
    for flag, want in ((True, "flash_attn_type=1"), (False, "flash_attn_type=0")):
        kv = load_edgekv(MODEL, cfg, n_ctx=512, flash_attn=flag)
        try:
            assert want in kv.adapter.build_info()
        finally:
            kv.close()
    for argv, want in ((["--flash-attn"], True), (["--no-flash-attn"], False), ([], None)):
        args = build_parser().parse_args(["generate", "hi", *argv, "--no-semantic",
                                          "--n-ctx", "512", "--cache-dir", str(tmp_path)])
        kv = _open(args)
        try:
            a = kv.adapter
            assert a.flash_attn == (a.batch_invariant if want is None else want)
        finally:
            kv.close()


def test_the_setup_build_runs_the_batch_invariant_kernels_with_flash_attention():
    """`make setup` builds the engine from patches/llama.cpp: the loaded CPU backend carries
    the switch, EdgeKV turned it on (through the backend, not the environment), and flash
    attention is on by default."""
    from edgekv.engines.llamacpp import LlamaCppAdapter

    if os.environ.get("LLAMA_CPP_LIB_PATH") or os.environ.get("GGML_CPU_BATCH_INVARIANT") == "0":
        pytest.skip("another engine build or its stock kernels were asked for")
    before = dict(os.environ)
    a = LlamaCppAdapter(MODEL, n_ctx=256)
    try:
        assert a.batch_invariant and a.flash_attn
        assert dict(os.environ) == before
        assert "LLAMAFILE = 1" in a.build_info()
    finally:
        a.close()


ORDER = """
import os, subprocess, sys
if sys.argv[1] == "plain":  # llama.cpp loads and computes before EdgeKV is imported
    import llama_cpp
    llm = llama_cpp.Llama(sys.argv[2], n_ctx=64, verbose=False)
    llm.eval(llm.tokenize(b"hello there"))
    llm.close()
from edgekv.engines.llamacpp import LlamaCppAdapter
a = LlamaCppAdapter(sys.argv[2], n_ctx=256)
child = subprocess.run([sys.executable, "-c",
                        "import os; print(os.environ.get('GGML_CPU_BATCH_INVARIANT', 'unset'))"],
                       capture_output=True, text=True).stdout.strip()
print(child, a.batch_invariant, a.flash_attn)
a.close()
"""


def test_the_order_of_imports_does_not_matter_and_children_keep_the_stock_kernels():
    """The adapter sets the backend's mode at run time (patch 0008): where a plain
    llama-cpp-python loaded and computed first, EdgeKV still runs the batch-invariant kernels
    with flash attention (before the setter, that process got the stock kernels and
    whole-chunk reuse); and EdgeKV writes nothing into the environment, so a child process (a
    benchmark's peer) does not inherit the switch."""
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        pytest.skip("another engine build was asked for")
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_BATCH_INVARIANT"}
    got = {}
    for first in ("plain", "edgekv"):
        res = subprocess.run([sys.executable, "-c", ORDER, first, str(MODEL)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-800:]
        got[first] = res.stdout.split()[-3:]
    assert got["plain"] == ["unset", "True", "True"]
    assert got["edgekv"] == ["unset", "True", "True"]
    # GGML_CPU_BATCH_INVARIANT=0 still keeps the stock kernels
    res = subprocess.run([sys.executable, "-c", ORDER, "edgekv", str(MODEL)],
                         env={**env, "GGML_CPU_BATCH_INVARIANT": "0"}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-800:]
    assert res.stdout.split()[-3:] == ["0", "False", "False"]


def test_a_model_loading_on_one_thread_loses_no_other_threads_output(tmp_path):
    """llama-cpp-python points fds 1 and 2 at /dev/null while a model loads; EdgeKV's adapter
    does not, so a line another thread writes meanwhile arrives (a kv-server's "listening on",
    printed while its probe loaded a second context, was lost and its parent waited forever).
    llama.cpp's own chatter stays off stdout and stderr."""
    script = f"""
import os, sys, threading
from edgekv.engines.llamacpp import LlamaCppAdapter
done = threading.Event()
def load():
    for _ in range(3):
        LlamaCppAdapter({str(MODEL)!r}, n_ctx=512).close()
    done.set()
threading.Thread(target=load).start()
n = 0
while not done.is_set():
    os.write(1, b"out\\n"); os.write(2, b"err\\n"); n += 1
print(f"wrote {{n}}", flush=True)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    n = int(r.stdout.splitlines()[-1].split()[1])
    assert n > 0
    assert r.stdout.count("out\n") == n and r.stderr.count("err\n") == n
    assert set(r.stdout.splitlines()[:-1]) == {"out"} and set(r.stderr.splitlines()) == {"err"}
