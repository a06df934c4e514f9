"""One build's measurements for `edgekv bench kernels`, in its own process.

The orchestrator (`kernels.py`) starts this module with the build's environment (its
LLAMA_CPP_LIB_PATH, its kernel switches) so that each build's native libraries are the only
ones loaded in the process: `python -m edgekv_bench.kernels_worker SPEC_JSON`. It prints one
JSON object on its last line of stdout.

Tasks (SPEC_JSON's "tasks"):
- "speed": one cold prefill of 512 and of 2,048 tokens (one batch each, like a plain user) and
  64 greedy decode steps after a 16-token prompt and after the 2,048-token one, each step timed
  (seconds; the orchestrator runs this once per round and takes medians: a step's median, not
  the total, so that a burst of load on the shared machine moves a few steps, not the figure);
- "probe": the batch-invariance probe (`engines/probe.py`, every schedule);
- "divergence": per prompt, 64 greedy tokens after the prompt fed as a reuse would feed it
  (its first 3/5 as one batch, standing for a cached prefix, then the rest) against the same
  prompt in one batch: the index of the first differing token (64 where none differs).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

__all__ = ["divergence_prompts", "first_divergence", "main"]

DIVERGENCE_TOKENS = 64  # greedy tokens compared per prompt (issue 20)
DECODE_PROMPT, DECODE_TOKENS = 16, 64  # decode steps timed, after a short prompt


def divergence_prompts(n: int) -> list[str]:
    """`n` chat-like prompts from the benchmark corpus (a deployment's system text, then one
    user question), varied over the clusters and wordings; deterministic."""
    from .corpus import load_clusters

    clusters = load_clusters()
    out = []
    for i in range(n):
        c = clusters[i % len(clusters)]
        intent = c.intents[(i // len(clusters)) % len(c.intents)]
        out.append(f"{c.system[:1500]}\n\nUser: {intent[i % len(intent)]}\nAssistant:")
    return out


def _greedy(adapter: Any, logits: np.ndarray, n: int,
            times: list[float] | None = None) -> list[int]:
    """`n` greedy decode steps from `logits`, their tokens; each step's seconds appended to
    `times` where given."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = adapter.prefill([tok], align=adapter.n_ctx)
        if times is not None:
            times.append(time.perf_counter() - t0)
    return out


def first_divergence(adapter: Any, prompt: str) -> int:
    """First index where the split-fed run's greedy tokens leave the one-batch run's."""
    toks = adapter.tokenize(prompt)
    cut = len(toks) * 3 // 5
    adapter.clear_kv_cache()
    ref = _greedy(adapter, adapter.prefill(toks, align=adapter.n_ctx), DIVERGENCE_TOKENS)
    adapter.clear_kv_cache()
    adapter.prefill(toks[:cut], align=adapter.n_ctx)
    got = _greedy(adapter, adapter.prefill(toks[cut:], align=adapter.n_ctx), DIVERGENCE_TOKENS)
    adapter.clear_kv_cache()
    return next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b),
                DIVERGENCE_TOKENS)


def _speed(adapter: Any) -> dict[str, Any]:
    from edgekv.engines.probe import probe_tokens

    out: dict[str, Any] = {}
    for n in (512, 2048):
        toks = probe_tokens(adapter, n)
        adapter.clear_kv_cache()
        t0 = time.perf_counter()
        logits = adapter.prefill(toks, align=adapter.n_ctx)
        out[f"prefill_{n}_s"] = time.perf_counter() - t0
    # decode over a long context: attention reads 2,048+ cells a step
    _greedy(adapter, logits, DECODE_TOKENS, out.setdefault("decode_2048_steps_s", []))
    toks = probe_tokens(adapter, DECODE_PROMPT)
    adapter.clear_kv_cache()
    logits = adapter.prefill(toks, align=adapter.n_ctx)
    _greedy(adapter, logits, DECODE_TOKENS, out.setdefault("decode_steps_s", []))
    adapter.clear_kv_cache()
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    from edgekv.engines.llamacpp import LlamaCppAdapter
    from edgekv.engines.probe import probe_batch_invariance

    kwargs: dict[str, Any] = {"flash_attn": bool(spec.get("flash_attn"))}
    adapter = LlamaCppAdapter(spec["model"], n_ctx=int(spec.get("n_ctx", 2304)),
                              n_threads=spec.get("threads"), **kwargs)
    res: dict[str, Any] = {"build_info": adapter.build_info()}
    try:
        tasks = spec.get("tasks", ["speed"])
        if "speed" in tasks:
            res.update(_speed(adapter))
        if "probe" in tasks:
            p = probe_batch_invariance(adapter)
            res["probe"] = {"identical": sum(d == 0.0 and s for _, d, s in p.results),
                            "total": len(p.results), "failed": list(p.failed),
                            "results": [list(r) for r in p.results], "seconds": p.seconds,
                            "long_tokens": p.long_tokens, "sequences": p.sequences}
        if "divergence" in tasks:
            res["first_divergence"] = [first_divergence(adapter, q)
                                       for q in divergence_prompts(int(spec["prompts"]))]
    finally:
        adapter.close()
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
