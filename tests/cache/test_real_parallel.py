"""Several requests at once on the real engine (`--parallel`): slots of one llama.cpp context,
their prefill and decode tokens batched together, give each request the answer a plain
llama-cpp-python run with no cache gives it alone, bit for bit, cold and warm."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, open_store
from edgekv.engines.models import default_model_path
from edgekv.serve.slots import open_slots

from ..conftest import real_stack

real_stack("real engine", "llama_cpp", check=default_model_path)

from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402

from .test_real_granularity import chat, need_token_granularity, plain  # noqa: E402, F401

MODEL = default_model_path()
pytestmark = pytest.mark.real
QUESTIONS = ("How many devices can one hub hold?", "What does an orange ring mean?",
             "How do I reset the hub?", "Which app pairs a sensor, and how long does it take?")


@pytest.fixture(scope="module")
def adapter():
    a = LlamaCppAdapter(MODEL, n_ctx=2048)
    yield a
    a.close()


@pytest.fixture
def kv(adapter, tmp_path):
    cfg = CacheConfig(cache_dir=tmp_path)
    k = EdgeKV(adapter, open_store(cfg), cfg)
    yield k
    k.close()


def at_once(kv: EdgeKV, sequences, prompts: list[list[int]], max_tokens: int):
    """Every prompt on its own slot and thread, all started together."""
    out: list[object] = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        out[i] = kv.generate(prompts[i], max_tokens=max_tokens, sequence=sequences[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert all(r is not None for r in out), "a generation did not finish"
    return out


def test_batched_requests_equal_plain_llama_cpp_cold_and_warm(kv, adapter, plain):  # noqa: F811
    need_token_granularity(kv)
    slots = open_slots(kv, 4)
    try:
        assert slots.count == 4 and slots.sequences, slots.reason
        # three on the manual (~640 tokens) and one short prompt: batched with the long ones,
        # the short one's attention spans 768 cells (the longest stream, padded) instead of
        # 256 alone, and must still give the same numbers
        prompts = [adapter.tokenize(chat(adapter, [("user", q)])) for q in QUESTIONS[:3]]
        prompts.append(adapter.tokenize("Q: What is the capital of France?\nA:"))
        assert len(prompts[-1]) < 256 < len(prompts[0])
        cold = at_once(kv, slots.sequences, prompts, 16)
        batched = slots.stats()
        # the manual is computed once: the first of the three to match claims its chunks, the
        # other two wait for them to be stored and reuse them
        assert kv.inflight_waits == 2
        assert sorted(r.cached_tokens > 128 for r in cold[:3]) == [False, True, True]
        # the four were computed together: some step held several sequences' tokens
        assert batched["max_sequences"] >= 2 and batched["steps"] < sum(
            len(r.tokens) for r in cold)
        warm = at_once(kv, slots.sequences, prompts, 16)
        for p, c, w in zip(prompts, cold, warm, strict=True):
            first, out = plain(p, 16)
            assert list(c.tokens) == out and np.array_equal(c.first_logits, first)
            assert list(w.tokens) == out and np.array_equal(w.first_logits, first)
            if len(p) > 256:  # the manual, at least, came from the cache
                assert w.cached_tokens > 128
    finally:
        slots.close()


def test_prefill_cut_to_the_step_budget_beside_decoding_stays_exact(kv, adapter, plain):  # noqa: F811
    """A long prompt arriving while three generations run goes in pieces that fit the step
    budget (here so small that every such step takes the minimum piece), and every answer,
    the long one's too, equals plain llama-cpp-python's alone."""
    from edgekv.engines.llamacpp_slots import MIN_PIECE

    need_token_granularity(kv)
    slots = open_slots(kv, 4, step_budget_s=1e-4)
    try:
        assert slots.pool is not None and slots.pool.step_budget_s == 1e-4
        prompts = [adapter.tokenize(f"Q: {q}\nA:") for q in QUESTIONS[:3]]
        long = adapter.tokenize(chat(adapter, [("user", QUESTIONS[3])]))
        assert len(long) > 8 * MIN_PIECE
        out: list[object] = [None] * 4

        def run(i: int, toks: list[int], n: int) -> None:
            out[i] = kv.generate(toks, max_tokens=n, sequence=slots.sequences[i])

        threads = [threading.Thread(target=run, args=(i, p, 40)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while slots.pool.steps < 3 and time.monotonic() < deadline:  # the three decode
            time.sleep(0.005)
        threads.append(threading.Thread(target=run, args=(3, long, 8)))
        threads[-1].start()
        for t in threads:
            t.join(600)
        stats = slots.stats()
        assert stats["budgeted_steps"] > 0, stats  # the long prompt went in pieces
        assert stats["step_budget_seconds"] == 1e-4 and stats["step_token_seconds"] > 0
        for toks, r, n in zip([*prompts, long], out, (40, 40, 40, 8), strict=True):
            first, want = plain(toks, n)
            assert list(r.tokens) == want and np.array_equal(r.first_logits, first)
    finally:
        slots.close()


def test_a_slot_extracts_and_injects_its_own_sequence_only(kv, adapter):
    """Fragments read from one slot restore into another slot and continue exactly as the
    first, while a third slot's sequence is left as it was."""
    need_token_granularity(kv)
    slots = open_slots(kv, 3)
    try:
        a, b, c = slots.sequences
        toks = adapter.tokenize(chat(adapter, [("user", QUESTIONS[0])]))
        for s in (a, b, c):
            s.clear_kv_cache()
        c.prefill(toks[:40], align=adapter.n_ctx)
        a.prefill(toks[:-1], align=adapter.n_ctx)
        from edgekv.engines.base import FragmentSpec

        frags = a.extract_fragments([FragmentSpec("p", 0, 64, 0, None, parent_key="")])
        assert b.inject_fragments(frags) == 64 and b.token_ids == toks[:64]
        want = a.prefill(toks[-1:], align=adapter.n_ctx)
        got = b.prefill(toks[64:], align=adapter.n_ctx)
        assert np.array_equal(want, got)
        assert c.n_tokens == 40 and c.read_state().n_tokens == 40
    finally:
        slots.close()


def test_where_batching_is_not_exact_requests_run_one_at_a_time(adapter, tmp_path):
    cfg = CacheConfig(cache_dir=tmp_path, reuse_granularity="chunk")
    kv = EdgeKV(adapter, open_store(cfg), cfg)
    try:
        slots = open_slots(kv, 4)
        assert slots.sequences == () and slots.count == 1
        assert "whole chunks" in slots.reason
        assert slots.as_dict() == {"requested": 4, "slots": 1, "batched": False,
                                   "reason": slots.reason}
    finally:
        kv.close()
