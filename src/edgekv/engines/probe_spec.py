"""The probe's draft-verification schedule: may drafted tokens be checked in one batch?

Speculative decoding (`spec`) feeds the last token and k drafts in one batch with logits at
every position, keeps the drafts the model would have produced, and removes the cells of the
rest. Its output equals plain decoding only if (1) a position's logits in that batch equal the
logits of the same position decoded alone, although the batch asks for k + 1 output rows
where a decode step asks for one (the output layer's mat-mul then runs over several rows),
(2) the KV the batch writes for the kept drafts equals what decode steps write, and (3) the
removed cells leave no trace: the steps after the removal compute what they would have
computed had the rejected drafts never been fed.

The schedule checks the three at once, against plain decoding of the same text: after a
prompt, `DRAFTS + 1` tokens decoded one at a time (the reference), versus the first
`KEPT` of them plus `DRAFTS + 1 - KEPT` wrong tokens in one batch, logits at every position,
the wrong tokens' cells removed, then the remaining tokens decoded one at a time. Every
position's logits and the KV of every position are compared bit for bit. Speculation runs
only where this passes (`probe.speculation_check`); the result is one row of the probe's record
(`ProbeResult.notes`: measured, not deciding the reuse granularity).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import DraftVerifier, FragmentSpec, KVAdapter

__all__ = ["DRAFTS", "KEPT", "SPEC_SCHEDULE", "draft_verify_diff"]

DRAFTS = 7  # a verification batch of 8 tokens: the last token and 7 drafts
KEPT = 5  # tokens of the batch that are right (the last token and 4 drafts); 3 rejected
SPEC_SCHEDULE = (f"draft verify: 1 + {DRAFTS} drafts in one batch, logits at every position, "
                 f"{DRAFTS + 1 - KEPT} rejected and removed, vs {DRAFTS + 1} decode steps")


def _kv(adapter: KVAdapter, n: int) -> tuple[np.ndarray, np.ndarray]:
    f = adapter.extract_fragments([FragmentSpec("probe-spec", 0, n)])[0]
    return np.asarray(f.keys), np.asarray(f.values)


def draft_verify_diff(adapter: KVAdapter,
                      tokens: Sequence[int]) -> tuple[str, float, bool] | None:
    """(SPEC_SCHEDULE, max |logit diff| over every position, logits and KV all identical), or
    None where the adapter cannot verify drafts. `tokens`: the prompt, then the
    `DRAFTS + 1` tokens decoded; the engine's context is left empty."""
    if not isinstance(adapter, DraftVerifier):
        return None
    toks = [int(t) for t in tokens]
    steps = toks[-(DRAFTS + 1):]
    prompt = toks[: -(DRAFTS + 1)]
    vocab = int(adapter.n_vocab)
    big = adapter.n_ctx  # an alignment no batch reaches: the prompt is one batch
    try:
        adapter.clear_kv_cache()
        adapter.prefill(prompt, align=big)
        ref = [adapter.prefill([t], align=1) for t in steps]
        ref_k, ref_v = _kv(adapter, len(toks))

        adapter.clear_kv_cache()
        adapter.prefill(prompt, align=big)
        wrong = [(t + 1) % vocab for t in steps[KEPT:]]
        got = adapter.verify(steps[:KEPT] + wrong)[:KEPT]
        adapter.truncate(len(prompt) + KEPT)
        got += [adapter.prefill([t], align=1) for t in steps[KEPT:]]
        k, v = _kv(adapter, len(toks))
    finally:
        adapter.clear_kv_cache()
    diff = max(float(np.max(np.abs(r - g))) for r, g in zip(ref, got, strict=True))
    same = diff == 0.0 and bool(np.array_equal(k, ref_k) and np.array_equal(v, ref_v))
    return SPEC_SCHEDULE, diff, same
