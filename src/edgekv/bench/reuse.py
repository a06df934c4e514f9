"""`edgekv bench reuse`: cold prefill vs warm reuse, side by side in one run.

A context of exactly `context_tokens` tokens (the built-in manual, cut to length) is followed by
a short question. The cache is filled once; then each run asks a question three ways, in
rotating order so drift of the machine hits all alike: cold (no cache), warm from RAM, warm from
disk (RAM tier emptied first, as in a fresh process). The KV-reuse claim is only counted if
the warm logits and greedy tokens equal the cold ones.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import EdgeKV, GenerationResult
from ..config import CacheConfig
from ..store import open_store
from ..texts import MANUAL, QUESTIONS, SYSTEM_PROMPT
from .report import environment, median_ms, table

__all__ = ["run_reuse_bench"]

log = logging.getLogger(__name__)


def build_context(kv: EdgeKV, context_tokens: int) -> list[int]:
    text = SYSTEM_PROMPT + "\n\n" + MANUAL
    ids = kv.adapter.tokenize(text)
    while len(ids) < context_tokens:  # longer contexts repeat the manual
        ids += kv.adapter.tokenize("\n\n" + MANUAL, add_bos=False)
    return ids[:context_tokens]


def run_reuse_bench(*, model: str | None = None, runs: int = 5, context_tokens: int = 512,
                    max_tokens: int = 16, chunk_size: int = 128, n_ctx: int = 2048,
                    cache_dir: Path | None = None, progress: Any = None,
                    engine: str = "llamacpp") -> dict[str, Any]:
    from ..engines import open_adapter

    tmp = None
    if cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="edgekv-bench-")
        cache_dir = Path(tmp.name)
    cfg = CacheConfig(chunk_size=chunk_size, cache_dir=cache_dir)
    adapter = open_adapter(engine, model, n_ctx=n_ctx, memo_dir=cache_dir)
    store = open_store(cfg)
    kv = EdgeKV(adapter, store, cfg)
    try:
        context = build_context(kv, context_tokens)
        questions = [adapter.tokenize(f"\n\nQuestion: {q}\nAnswer:", add_bos=False)
                     for q in QUESTIONS]
        kv.generate(context + questions[-1], max_tokens=1)  # warm-up + fills the cache
        cold: list[GenerationResult] = []
        warm: list[GenerationResult] = []
        disk: list[GenerationResult] = []
        diffs, equal = [], []
        for r in range(runs):
            prompt = context + questions[r % len(questions)]
            got: dict[str, GenerationResult] = {}
            for mode in np.roll(["cold", "warm", "disk"], r):
                if mode == "disk":
                    store.clear_tier("ram")
                got[mode] = kv.generate(prompt, max_tokens=max_tokens, use_cache=mode != "cold",
                                        store=False)
            cold.append(got["cold"])
            warm.append(got["warm"])
            disk.append(got["disk"])
            for w in (got["warm"], got["disk"]):
                diffs.append(float(np.max(np.abs(w.first_logits - got["cold"].first_logits))))
                equal.append(w.tokens == got["cold"].tokens)
            if progress:
                progress(r + 1, runs)
        result = {
            "bench": "reuse",
            "context_tokens": len(context),
            "question_tokens": [len(questions[r % len(questions)]) for r in range(runs)],
            "runs": runs,
            "max_tokens": max_tokens,
            "chunk_size": chunk_size,
            "cold_ttft_ms": median_ms([g.ttft_s for g in cold]),
            "warm_ttft_ms": median_ms([g.ttft_s for g in warm]),
            "warm_disk_ttft_ms": median_ms([g.ttft_s for g in disk]),
            "speedup": round(_median_s(cold) / _median_s(warm), 2),
            "speedup_disk": round(_median_s(cold) / _median_s(disk), 2),
            "logits_max_abs_diff": max(diffs),
            "greedy_tokens_equal": all(equal),
            "cached_tokens_warm": warm[0].cached_tokens,
            "computed_tokens_warm": [g.computed_tokens for g in warm],
            "breakdown_ms": {
                m: {"lookup": median_ms([g.lookup_s for g in gs]),
                    "inject": median_ms([g.inject_s for g in gs]),
                    "prefill": median_ms([g.prefill_s for g in gs])}
                for m, gs in (("cold", cold), ("warm", warm), ("warm_disk", disk))
            },
            "ttft_ms": {m: [round(g.ttft_s * 1000, 3) for g in gs]
                        for m, gs in (("cold", cold), ("warm", warm), ("warm_disk", disk))},
            "model": str(adapter.model_path.name),  # type: ignore[attr-defined]
            "engine": adapter.fingerprint.engine,
            "environment": environment(),
        }
        return result
    finally:
        store.close()
        adapter.close()
        if tmp is not None:
            tmp.cleanup()


def _median_s(runs: list[GenerationResult]) -> float:
    return float(np.median([g.ttft_s for g in runs]))


def reuse_table(res: dict[str, Any]) -> str:
    rows = [
        ["cold (no cache)", res["cold_ttft_ms"], "1.00x", 0],
        ["warm (RAM tier)", res["warm_ttft_ms"], f"{res['speedup']:.2f}x",
         res["cached_tokens_warm"]],
        ["warm (disk tier)", res["warm_disk_ttft_ms"], f"{res['speedup_disk']:.2f}x",
         res["cached_tokens_warm"]],
    ]
    return table(["mode", "TTFT median ms", "speedup", "reused tokens"], rows) + (
        f"\ncontext {res['context_tokens']} tokens, {res['runs']} runs; logits max |diff| "
        f"{res['logits_max_abs_diff']}; greedy {res['max_tokens']} tokens equal: "
        f"{res['greedy_tokens_equal']}")
