"""MiniLM routing with the real embedder and the real engine: tiers and strict fidelity."""

from __future__ import annotations

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, open_router, open_store
from edgekv.chat import render_chat
from edgekv.semantic.embedder import minilm_dir
from edgekv_bench.texts import MANUAL, SYSTEM_PROMPT

from ..conftest import real_stack

real_stack("semantic stack", "onnxruntime", "usearch", check=minilm_dir)

from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402
from edgekv.semantic import MiniLMEmbedder  # noqa: E402

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return MiniLMEmbedder(tmp_path_factory.mktemp("emb"))


def test_embeddings_equal_sentence_transformers(embedder):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir()), device="cpu")
    texts = ["How long does the hub take to start?", "Le chat dort sur le canapé."]
    ref = st.encode(texts, normalize_embeddings=True)
    got = embedder.embed(texts)
    assert got.shape == (2, 384)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert np.min(np.sum(got * ref, axis=1)) > 0.9999


def test_paraphrase_is_close_and_unrelated_is_far(embedder):
    a, b, c = embedder.embed([
        "How long does the hub take to start?",
        "How much time does the hub need to boot up?",
        "Write a haiku about autumn leaves in Kyoto.",
    ])
    assert float(a @ b) >= 0.75
    assert float(a @ c) < 0.75


@pytest.fixture(scope="module")
def adapter():
    a = LlamaCppAdapter(n_ctx=2048)
    yield a
    a.close()


def chat(adapter, q):
    return render_chat(adapter.chat_template(), [
        {"role": "system", "content": SYSTEM_PROMPT + "\n\n" + MANUAL[:1800]},
        {"role": "user", "content": q}])


def test_paraphrase_reuses_verified_prefix_with_cold_identical_output(adapter, embedder, tmp_path):
    cfg = CacheConfig(cache_dir=tmp_path, reuse_granularity="chunk")
    store = open_store(cfg)
    kv = EdgeKV(adapter, store, cfg, router=open_router(embedder, store, cfg))
    kv.generate(chat(adapter, "How long does the hub take to start?"), max_tokens=4)
    prompt = chat(adapter, "How long does the hub need to start up?")
    cold = kv.generate(prompt, max_tokens=16, use_cache=False, keep_logits=True)
    warm = kv.generate(prompt, max_tokens=16, keep_logits=True)
    m = warm.match
    assert m.tier in ("exact", "partial"), m
    chain_only = (warm.prompt_tokens - 1) // 128 * 128
    assert m.exact_tokens == warm.cached_tokens == chain_only > 0
    assert not m.approximate
    assert warm.tokens == cold.tokens
    for w, c in zip(warm.step_logits, cold.step_logits):
        assert np.array_equal(w, c)
    unrelated = kv.generate("Write a haiku about autumn leaves in Kyoto.", max_tokens=2)
    assert unrelated.match.tier == "miss" and unrelated.cached_tokens == 0
    kv.close()


def test_partial_reuse_is_token_verified_but_not_claimed_exact(adapter, embedder, tmp_path):
    cfg = CacheConfig(cache_dir=tmp_path, partial_reuse=True, reuse_granularity="chunk")
    store = open_store(cfg)
    kv = EdgeKV(adapter, store, cfg, router=open_router(embedder, store, cfg))
    kv.generate(chat(adapter, "How long does the hub take to start?"), max_tokens=4)
    prompt = chat(adapter, "How long does the hub need to start up?")
    cold = kv.generate(prompt, max_tokens=1, use_cache=False)
    warm = kv.generate(prompt, max_tokens=1)
    chain_only = (warm.prompt_tokens - 1) // 128 * 128
    assert warm.cached_tokens > chain_only and not warm.match.batch_exact(128)
    assert warm.stored_fragments == 0  # not batch-exact KV is never stored
    # different batch shapes: equal or very close, never claimed identical
    assert float(np.max(np.abs(warm.first_logits - cold.first_logits))) < 0.5
    kv.close()


def test_a_model_loads_after_the_vector_index_is_made():
    """usearch's extension links libstdc++ statically: made before a llama.cpp model was
    loaded, every model load after it failed on its vocabulary (`std::bad_cast`). A fresh
    process, as a program that opens its router first would be."""
    import subprocess
    import sys

    code = ("from edgekv.semantic import VectorIndex\n"
            "VectorIndex(8)\n"
            "from edgekv.engines.llamacpp import LlamaCppAdapter\n"
            "a = LlamaCppAdapter(n_ctx=256)\n"
            "print(len(a.tokenize('Paris is the capital')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) > 0
