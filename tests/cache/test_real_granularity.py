"""Reuse granularity on the real engine: where llama.cpp passed the batch-invariance probe,
reuse that ends mid-chunk (and the next chat turn, answer included) gives the output of a plain
llama-cpp-python run with no cache, bit for bit; where the probe failed, whole chunks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, open_store
from edgekv.chat import render_chat
from edgekv.engines import probe as probe_mod
from edgekv.engines.models import default_model_path

from ..conftest import real_stack, require_real

real_stack("real engine", "llama_cpp", check=default_model_path)

import llama_cpp  # noqa: E402

from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402

MODEL = default_model_path()
pytestmark = pytest.mark.real
MANUAL = (Path(__file__).parents[2] / "bench/edgekv_bench/texts.py").read_text()[:2500]


@pytest.fixture(scope="module")
def adapter():
    a = LlamaCppAdapter(MODEL, n_ctx=2048)
    yield a
    a.close()


@pytest.fixture(scope="module")
def plain(adapter):
    """Plain llama-cpp-python, no cache, its default batching: what a user runs, with the
    engine's attention path (flash attention on the batch-invariant build, EdgeKV's default)."""
    llm = llama_cpp.Llama(str(MODEL), n_ctx=2048, n_threads=adapter.n_threads,
                          n_threads_batch=adapter.n_threads, verbose=False,
                          flash_attn=adapter.flash_attn)

    def run(tokens: list[int], max_tokens: int) -> tuple[np.ndarray, list[int]]:
        llm.reset()
        llm.eval(tokens)
        first = last = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()
        out: list[int] = []
        for _ in range(max_tokens):
            tok = int(np.argmax(last))
            out.append(tok)
            if tok == llm.token_eos():
                break
            llm.eval([tok])
            last = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
        return first, out

    yield run
    llm.close()


@pytest.fixture
def kv(adapter, tmp_path):
    cfg = CacheConfig(cache_dir=tmp_path)
    k = EdgeKV(adapter, open_store(cfg), cfg)
    yield k
    k.close()


def need_token_granularity(kv: EdgeKV) -> None:
    """The README claims token-granular exact reuse for the build `make setup` produces: under
    `make test` a build that fails the probe fails these tests instead of skipping them."""
    if not kv.token_exact:
        why = f"this build is not batch-invariant ({kv.granularity_reason})"
        if require_real():
            pytest.fail(why + ": the build `make setup` produces must pass the probe")
        pytest.skip(why + "; the fallback is tested below")


def chat(adapter, turns: list[tuple[str, str]]) -> str:
    msgs = [{"role": "system", "content": "Answer from this manual.\n\n" + MANUAL}]
    msgs += [{"role": r, "content": c} for r, c in turns]
    return render_chat(adapter.chat_template(), msgs)


def test_probe_runs_once_and_is_recorded(kv, tmp_path):
    p = kv.probe
    assert p is not None and p.sensitivity > 0 and p.seconds > 0
    names = [s.name for s in probe_mod.schedules(p.tokens)]
    names += [s.name for s in probe_mod.long_schedules(p.long_tokens)] if p.long_tokens else []
    assert [r[0] for r in p.results][: len(names)] == names
    # + the sequences batch and the split prefill beside decode steps
    assert len(p.results) == len(names) + (2 if p.sequences else 0)
    [recorded] = (tmp_path / "probes").glob("*.json")  # exactly one record, this engine's
    again = probe_mod.ProbeResult.from_json(json.loads(recorded.read_text()))
    assert again.key == p.key and again.results == p.results
    assert p.invariant == (not p.failed)


def test_reuse_ending_mid_chunk_equals_plain_llama_cpp(kv, adapter, plain):
    need_token_granularity(kv)
    kv.generate(chat(adapter, [("user", "How many devices can one hub hold?")]), max_tokens=4)
    tokens = adapter.tokenize(chat(adapter, [("user", "What does an orange ring mean?")]))
    warm = kv.generate(tokens, max_tokens=16)
    assert warm.cached_tokens % 128 != 0 and warm.cached_tokens > 128
    first, out = plain(tokens, 16)
    assert np.array_equal(warm.first_logits, first)
    assert list(warm.tokens) == out


def test_next_chat_turn_reuses_the_answer_and_equals_plain(kv, adapter, plain):
    need_token_granularity(kv)
    q1 = [("user", "What does an orange ring mean?")]
    r1 = kv.generate(chat(adapter, q1), max_tokens=24)
    turn2 = chat(adapter, q1 + [("assistant", r1.text), ("user", "And a blue one?")])
    tokens = adapter.tokenize(turn2)
    r2 = kv.generate(tokens, max_tokens=16)
    # the previous prompt and (nearly) all of the answer come from the cache
    assert r2.cached_tokens >= r1.prompt_tokens + len(r1.tokens) - 4
    first, out = plain(tokens, 16)
    assert np.array_equal(r2.first_logits, first) and list(r2.tokens) == out


def test_probe_failure_falls_back_to_whole_chunks_and_says_so(adapter, tmp_path, monkeypatch,
                                                               capsys):
    """A recorded failing probe (as written on a build that is not batch-invariant) forces the
    fallback: whole-chunk reuse, chunk-aligned prefill, reported by `cache stats`."""
    # the module's own probe answer (its `kv` fixture probed this adapter), else a new one
    real = probe_mod.load_or_probe(adapter, tmp_path / "measured")
    assert real.invariant and not real.pending
    failing = probe_mod.ProbeResult(
        False, real.key, real.describe, real.tokens,
        tuple((n, 0.5 if n == "lone last token" else d, s) for n, d, s in real.results),
        real.sensitivity, real.seconds, real.measured_at)
    path = probe_mod.probe_path(tmp_path / "probes", real.key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(failing.to_json()))
    monkeypatch.setattr(probe_mod, "_memo", {})
    cfg = CacheConfig(cache_dir=tmp_path)
    kv = EdgeKV(adapter, open_store(cfg), cfg)
    try:
        assert kv.granularity == "chunk" and "lone last token" in kv.granularity_reason
        kv.generate(chat(adapter, [("user", "How many devices can one hub hold?")]), max_tokens=2)
        tokens = adapter.tokenize(chat(adapter, [("user", "What does an orange ring mean?")]))
        warm = kv.generate(tokens, max_tokens=8)
        cold = kv.generate(tokens, max_tokens=8, use_cache=False)
        assert warm.cached_tokens % 128 == 0 and warm.cached_tokens >= 256
        assert np.array_equal(warm.first_logits, cold.first_logits) and warm.tokens == cold.tokens
    finally:
        kv.close()
    from edgekv.cli import main

    assert main(["cache", "stats", "--cache-dir", str(tmp_path), "--json"]) == 0
    [p] = json.loads(capsys.readouterr().out)["probes"]
    assert p["granularity"] == "chunk" and p["failed"] == ["lone last token"]
