"""The probe's multi-sequence schedule for llama.cpp: several sequences' tokens in one batch.

A server answers several requests at once by putting each request's tokens in one llama_batch
under its own sequence id; the tokens of one request then share every mat-mul with the
others'. Reused KV (and the answer a warm request gets) equals a cold run only if a token's
numbers do not depend on which other sequences' tokens sit in its batch. This check decodes a
few sequences (prompts sharing a prefix, like chats sharing a system prompt) together, in a
second context of the same model with one sequence id each: their prompts in one batch, then
four decode steps with one token of every sequence per batch. A second schedule is what a
server's step budget does (`llamacpp_slots`, stall-free prefill): two sequences decode while
the third's prompt goes in pieces of uneven sizes, one piece beside each of their steps.
Every sequence's logits at each step are compared bit for bit with the same sequence decoded
alone, in one batch, through the adapter's own context (what a plain user of the engine
gets). The KV is compared through the
logits of the later steps, which attend to it.

Two KV layouts, measured apart: one KV stream per sequence (llama.cpp `kv_unified=false`: a
sequence's cells start at 0, as when it runs alone) and one unified cache (`kv_unified=true`:
a sequence's cells sit after the others', masked cells between). Measured on this tree: with
per-sequence streams every build tried gave the alone logits bit for bit; with a unified cache
only flash attention's one-row path did (`GGML_CPU_USE_REF=1`), because every SIMD reduction
over the KV axis (softmax sums, V·softmax, the tiled flash-attention KV tiles) groups a
sequence's cells differently when other sequences' cells sit between them.

Engine-specific (llama.cpp sequence ids): an adapter that can run it is a `MultiSequenceKV`
(`LlamaCppAdapter.sequence_context`); other engines have no such schedule, and the probe then
says so in its record.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import EngineError

__all__ = ["MULTI_SEQ_STEPS", "SPLIT_PIECES", "MultiSequenceKV", "multi_sequence_diff",
           "multi_sequence_prompts", "split_prefill_diff"]

MULTI_SEQ_STEPS = 4  # decode steps after the prompts, as in the single-sequence probe
SPLIT_PIECES = (5, 16, 33)  # a prompt's first pieces beside decode steps (the rest: the 4th)


class SequenceDecoder(Protocol):
    """A context holding several sequences (`llamacpp.SequenceContext`)."""

    def decode(self, items: Sequence[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """One batch of (token, position, sequence id, wants logits); the logits asked for."""
        ...

    def __enter__(self) -> SequenceDecoder: ...

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None: ...


@runtime_checkable
class MultiSequenceKV(Protocol):
    """An adapter that can decode several sequences in one batch, in a second context of its
    model (`LlamaCppAdapter.sequence_context`)."""

    def sequence_context(self, n_seq: int, n_tokens: int, *,
                         unified: bool) -> SequenceDecoder: ...


def multi_sequence_prompts(tokens: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """(prompt, decode tokens) per sequence: three prompts of different lengths that share a
    prefix (a system prompt), each followed by the text's next tokens as decode input."""
    cuts = (97, 150, 123)
    if len(tokens) < max(cuts) + MULTI_SEQ_STEPS:
        raise EngineError(f"the multi-sequence probe needs {max(cuts) + MULTI_SEQ_STEPS} "
                          f"tokens, got {len(tokens)}")
    return [(list(tokens[:c]), list(tokens[c : c + MULTI_SEQ_STEPS])) for c in cuts]


def _alone(adapter: Any, prompt: list[int], steps: list[int]) -> list[np.ndarray]:
    """One sequence alone through the adapter: the prompt in one batch, then one token a step."""
    adapter.clear_kv_cache()
    out = [adapter.prefill(prompt, align=adapter.n_ctx)]
    for t in steps:
        out.append(adapter.prefill([t], align=adapter.n_ctx))
    adapter.clear_kv_cache()
    return out


def _compare(ref: list[list[np.ndarray]], got: list[list[np.ndarray]]) -> tuple[float, bool]:
    """Max |logit diff| of each sequence's steps against alone, and whether all are equal."""
    diff, same = 0.0, True
    for r_seq, g_seq in zip(ref, got, strict=True):
        for r, g in zip(r_seq, g_seq, strict=True):
            d = float(np.max(np.abs(r - g)))
            diff = max(diff, d)
            same = same and d == 0.0
    return diff, same


def multi_sequence_diff(adapter: Any, tokens: Sequence[int], *,
                        unified: bool = True) -> tuple[str, float, bool] | None:
    """(schedule name, max |logit diff| vs each sequence alone, all identical), or None where
    the adapter is not a llama.cpp one (no sequence ids to batch). `unified`: one KV cache for
    every sequence (llama.cpp's kv_unified, where a sequence's cells follow the others'), else
    one KV stream per sequence."""
    if not isinstance(adapter, MultiSequenceKV):
        return None
    seqs = multi_sequence_prompts(tokens)
    layout = "unified KV" if unified else "a KV stream each"
    name = (f"{len(seqs)} sequences in one batch, {layout} (prompts, {MULTI_SEQ_STEPS} "
            "decode steps)")
    ref = [_alone(adapter, p, s) for p, s in seqs]
    total = sum(len(p) + len(s) for p, s in seqs)
    with adapter.sequence_context(len(seqs), total, unified=unified) as ctx:
        items = [(t, pos, s, pos == len(p) - 1)
                 for s, (p, _) in enumerate(seqs) for pos, t in enumerate(p)]
        got = [[x] for x in ctx.decode(items)]
        for step in range(MULTI_SEQ_STEPS):
            step_items = [(steps[step], len(p) + step, s, True)
                          for s, (p, steps) in enumerate(seqs)]
            for s, x in enumerate(ctx.decode(step_items)):
                got[s].append(x)
    return (name, *_compare(ref, got))


def split_prefill_diff(adapter: Any, tokens: Sequence[int]) -> tuple[str, float, bool] | None:
    """(schedule name, max |logit diff| vs each sequence alone, all identical): two sequences'
    prompts in one batch, then the third's prompt in pieces (`SPLIT_PIECES`, then the rest),
    each batched with one decode token of each of the two, then the third's decode steps;
    one KV stream per sequence. None where the adapter has no sequence ids."""
    if not isinstance(adapter, MultiSequenceKV):
        return None
    seqs = multi_sequence_prompts(tokens)
    (pa, sa), (pb, sb), (pc, sc) = seqs
    cuts = [0, *(sum(SPLIT_PIECES[: i + 1]) for i in range(len(SPLIT_PIECES))), len(pc)]
    if cuts[-2] >= len(pc) or len(cuts) - 1 != MULTI_SEQ_STEPS:
        raise EngineError(f"the split-prefill probe needs a prompt of more than {cuts[-2]} "
                          f"tokens and {len(cuts) - 1} pieces")
    pieces = ", ".join(str(b - a) for a, b in zip(cuts, cuts[1:]))
    name = (f"a prompt in pieces of {pieces} tokens beside 2 sequences' decode steps, a KV "
            "stream each")
    ref = [_alone(adapter, p, s) for p, s in seqs]
    total = sum(len(p) + len(s) for p, s in seqs)
    got: list[list[np.ndarray]] = [[], [], []]
    with adapter.sequence_context(len(seqs), total, unified=False) as ctx:
        items = [(t, pos, s, pos == len(p) - 1)
                 for s, p in ((0, pa), (1, pb)) for pos, t in enumerate(p)]
        for s, x in enumerate(ctx.decode(items)):
            got[s].append(x)
        for step, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
            step_items = [(sa[step], len(pa) + step, 0, True), (sb[step], len(pb) + step, 1, True)]
            step_items += [(pc[i], i, 2, i == hi - 1) for i in range(lo, hi)]
            out = ctx.decode(step_items)
            got[0].append(out[0])
            got[1].append(out[1])
            if hi == len(pc):
                got[2].append(out[2])
        for step, t in enumerate(sc):
            got[2] += ctx.decode([(t, len(pc) + step, 2, True)])
    return (name, *_compare(ref, got))
