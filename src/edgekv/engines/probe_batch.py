"""The probe's multi-sequence schedule for llama.cpp: several sequences' tokens in one batch.

A server answers several requests at once by putting each request's tokens in one llama_batch
under its own sequence id; the tokens of one request then share every mat-mul with the
others'. Reused KV (and the answer a warm request gets) equals a cold run only if a token's
numbers do not depend on which other sequences' tokens sit in its batch. This check decodes a
few sequences (prompts sharing a prefix, like chats sharing a system prompt) together, in a
second context of the same model with one sequence id each: their prompts in one batch, then
four decode steps with one token of every sequence per batch. Every sequence's logits at each
step are compared bit for bit with the same sequence decoded alone, in one batch, through the
adapter's own context (what a plain user of the engine gets). The KV is compared through the
logits of the later steps, which attend to it.

Two KV layouts, measured apart: one KV stream per sequence (llama.cpp `kv_unified=false`: a
sequence's cells start at 0, as when it runs alone) and one unified cache (`kv_unified=true`:
a sequence's cells sit after the others', masked cells between). Measured on this tree: with
per-sequence streams every build tried gave the alone logits bit for bit; with a unified cache
only flash attention's one-row path did (`GGML_CPU_USE_REF=1`), because every SIMD reduction
over the KV axis (softmax sums, V·softmax, the tiled flash-attention KV tiles) groups a
sequence's cells differently when other sequences' cells sit between them.

Engine-specific (llama.cpp sequence ids); other engines have no such schedule, and the probe
then says so in its record.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import EngineError

__all__ = ["MULTI_SEQ_STEPS", "multi_sequence_prompts", "multi_sequence_diff"]

MULTI_SEQ_STEPS = 4  # decode steps after the prompts, as in the single-sequence probe


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


def multi_sequence_diff(adapter: Any, tokens: Sequence[int], *,
                        unified: bool = True) -> tuple[str, float, bool] | None:
    """(schedule name, max |logit diff| vs each sequence alone, all identical), or None where
    the adapter is not a llama.cpp one (no sequence ids to batch). `unified`: one KV cache for
    every sequence (llama.cpp's kv_unified, where a sequence's cells follow the others'), else
    one KV stream per sequence."""
    llm = getattr(adapter, "_llm", None)
    lib = getattr(adapter, "_lib", None)
    if llm is None or lib is None or not hasattr(lib, "llama_batch_init"):
        return None
    seqs = multi_sequence_prompts(tokens)
    layout = "unified KV" if unified else "a KV stream each"
    name = (f"{len(seqs)} sequences in one batch, {layout} (prompts, {MULTI_SEQ_STEPS} "
            "decode steps)")
    ref = [_alone(adapter, p, s) for p, s in seqs]

    src = llm.context_params
    params = type(src)()
    ctypes.memmove(ctypes.byref(params), ctypes.byref(src), ctypes.sizeof(src))
    total = sum(len(p) + len(s) for p, s in seqs)
    params.n_seq_max = len(seqs)
    params.n_ctx = max(1024, total + 64)
    params.n_batch = max(int(src.n_batch), total)
    params.kv_unified = unified
    ctx = lib.llama_init_from_model(llm.model, params)
    if not ctx:
        raise EngineError("llama.cpp could not create the multi-sequence probe context")
    n_vocab = int(adapter._n_vocab)
    batch = lib.llama_batch_init(max(total, len(seqs)), 0, len(seqs))
    diff, same = 0.0, True
    try:
        def decode(items: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
            """items: (token, position, sequence id, wants logits)."""
            batch.n_tokens = len(items)
            for i, (tok, pos, seq, want) in enumerate(items):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1 if want else 0
            rc = lib.llama_decode(ctx, batch)
            if rc != 0:
                raise EngineError(f"llama_decode returned {rc} in the multi-sequence probe")
            out = []
            for i, (_, _, _, want) in enumerate(items):
                if want:
                    ptr = lib.llama_get_logits_ith(ctx, i)
                    out.append(np.array(np.ctypeslib.as_array(ptr, shape=(n_vocab,)),
                                        dtype=np.float32, copy=True))
            return out

        items = [(t, pos, s, pos == len(p) - 1)
                 for s, (p, _) in enumerate(seqs) for pos, t in enumerate(p)]
        got = [[x] for x in decode(items)]
        for step in range(MULTI_SEQ_STEPS):
            step_items = [(steps[step], len(p) + step, s, True)
                          for s, (p, steps) in enumerate(seqs)]
            for s, x in enumerate(decode(step_items)):
                got[s].append(x)
        for r_seq, g_seq in zip(ref, got, strict=True):
            for r, g in zip(r_seq, g_seq, strict=True):
                d = float(np.max(np.abs(r - g)))
                diff = max(diff, d)
                same = same and d == 0.0
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
    return name, diff, same
