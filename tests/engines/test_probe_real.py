"""The probe's new schedules on the real engine: several sequences in one llama_batch, and a
prompt of 2,000+ tokens."""

from __future__ import annotations

import pytest

from edgekv.engines.models import default_model_path

from ..conftest import real_stack

real_stack("real engine", "llama_cpp", check=default_model_path)

from edgekv.engines import probe, probe_batch  # noqa: E402
from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402
from edgekv.engines.probe_spec import SPEC_SCHEDULE  # noqa: E402

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def adapter():
    a = LlamaCppAdapter(default_model_path(), n_ctx=2048)
    yield a
    a.close()


def test_sequences_batched_together_are_compared_with_each_alone(adapter):
    toks = probe.probe_tokens(adapter)
    name, diff, same = probe_batch.multi_sequence_diff(adapter, toks, unified=False)
    assert name.startswith("3 sequences") and "stream" in name and same == (diff == 0.0)
    # the comparison can see a difference: a reference that fed another token at one decode
    # step differs from the batched run
    real_alone = probe_batch._alone

    def other_token(a, prompt, steps):
        return real_alone(a, prompt, steps[:-1] + [(steps[-1] + 1) % 1000])

    try:
        probe_batch._alone = other_token
        _, moved, same_moved = probe_batch.multi_sequence_diff(adapter, toks, unified=False)
    finally:
        probe_batch._alone = real_alone
    assert moved > 0 and not same_moved


def test_the_probe_runs_a_long_prompt_and_the_batch_schedule(adapter, tmp_path):
    # the answer this test process measured already for an engine of these settings (the
    # cache tests' probe: the same code, about 50 s), else measured here
    res = probe.load_or_probe(adapter, tmp_path)
    names = [n for n, _, _ in res.results]
    assert res.long_tokens == probe.LONG_PROBE_TOKENS >= 2000 and res.sequences == 3
    assert f"long {res.long_tokens}: 4 decode steps" in names
    assert any(n.startswith("3 sequences") for n in names)
    assert any(n.startswith("a prompt in pieces of 5, 16, 33, 69") for n in names)
    assert len(names) == len(probe.schedules(res.tokens)) + 2 + 2  # long 2; batch, split
    # recorded, not deciding the granularity: the unified-KV batch, and the draft schedule
    # (speculative decoding's, bit for bit on the setup build)
    notes = {n: (d, same) for n, d, same in res.notes}
    assert len(notes) == 2 and not set(notes) & set(names)
    assert any("unified KV" in n for n in notes)
    assert notes[SPEC_SCHEDULE] == (0.0, True)


def test_a_decode_step_is_the_same_at_any_thread_count():
    """Patch 0007 splits a decode step's KV segments across the threads; a row still merges its
    segments in one order, so the logits of a prompt past one segment (256 cells) and the decode
    steps after it are the same at 1, 2 and 3 threads. (Stock's split-KV path is not: its chunk
    bounds follow the thread count.)"""
    import numpy as np

    runs = []
    for threads in (1, 2, 3):
        a = LlamaCppAdapter(default_model_path(), n_ctx=2048, n_threads=threads)
        try:
            if not (a.batch_invariant and a.flash_attn):
                pytest.skip("the engine's batch-invariant kernels are not loaded")
            toks = probe.probe_tokens(a, 700)
            logits = a.prefill(toks, align=a.n_ctx)
            steps = [np.array(logits)]
            for _ in range(3):
                logits = a.prefill([int(np.argmax(logits))], align=a.n_ctx)
                steps.append(np.array(logits))
            runs.append(np.stack(steps))
        finally:
            a.close()
    assert all(np.array_equal(r, runs[0]) for r in runs[1:])
