"""`edgekv bench lookup`: what the semantic layer costs a request that misses.

The index is filled with `entries` vectors of real prompts (the built-in manual's sentences
paired with questions, embedded by MiniLM); then prompts of several token lengths that match
nothing are routed (embed + HNSW search + tier decision) and, side by side in the same run,
prefilled cold by the engine, so the overhead is also given as a share of cold TTFT.
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .options import Subparsers, bench_parser, progress
from .report import environment, table
from .texts import MANUAL, QUESTIONS

__all__ = ["add_parser", "lookup_table", "run_cli", "run_lookup_bench"]

UNRELATED = (
    "The committee reviewed the quarterly budget and agreed to postpone the new library wing "
    "until the spring. Volunteers will repaint the reading room, and the children's section "
    "gets new shelves donated by a local carpenter. The treasurer noted that heating costs rose "
    "sharply after the old boiler failed in November, and asked members to approve a loan. "
) * 8


def run_lookup_bench(*, model: str | None = None, entries: int = 1000, runs: int = 20,
                     lengths: tuple[int, ...] = (16, 64, 128, 256), n_ctx: int = 2048,
                     progress: Any = None) -> dict[str, Any]:
    from edgekv.config import CacheConfig
    from edgekv.engines.llamacpp import LlamaCppAdapter
    from edgekv.semantic import MiniLMEmbedder, SemanticRouter, VectorIndex

    with tempfile.TemporaryDirectory(prefix="edgekv-lookup-") as tmp:
        cfg = CacheConfig(cache_dir=Path(tmp))
        embedder = MiniLMEmbedder(cfg.cache_dir)
        index = VectorIndex(embedder.dim)
        router = SemanticRouter(embedder, index, exact=cfg.semantic_exact,
                                partial=cfg.semantic_partial, k=cfg.semantic_k)
        sentences = [s.strip() for s in re.split(r"(?<=[.;])\s+", MANUAL) if len(s) > 20]
        texts = [f"{a} {b} {q}" for (a, b), q in zip(
            itertools.islice(itertools.cycle(itertools.permutations(sentences, 2)), entries),
            itertools.cycle(QUESTIONS))]
        for i in range(0, len(texts), 64):
            vecs = embedder.embed(texts[i : i + 64])
            for j, v in enumerate(vecs):
                index.add(f"{i + j:064x}", v)
        adapter = LlamaCppAdapter(model, n_ctx=n_ctx, memo_dir=cfg.cache_dir)
        try:
            points = []
            for n in lengths:
                ids = adapter.tokenize(UNRELATED)[:n]
                text = adapter.detokenize(ids[1:])
                router.route(text)  # warm-up
                routes, colds = [], []
                for r in range(runs):
                    t = time.perf_counter()
                    route = router.route(text)
                    routes.append((time.perf_counter() - t, route))
                    if r < 3:  # cold prefill, interleaved with the routing runs
                        adapter.clear_kv_cache()
                        t = time.perf_counter()
                        adapter.prefill(ids, align=cfg.chunk_size)
                        colds.append(time.perf_counter() - t)
                med = statistics.median(s for s, _ in routes)
                cold = statistics.median(colds)
                points.append({
                    "prompt_tokens": len(ids),
                    "lookup_ms_median": round(med * 1000, 3),
                    "embed_ms_median": round(
                        statistics.median(r.embed_s for _, r in routes) * 1000, 3),
                    "search_ms_median": round(
                        statistics.median(r.search_s for _, r in routes) * 1000, 3),
                    "cold_ttft_ms": round(cold * 1000, 3),
                    "share_of_cold_ttft": round(med / cold, 4),
                    "tier": routes[-1][1].tier.value,
                    "best_similarity": round(routes[-1][1].similarity, 4),
                })
                if progress:
                    progress(len(points), len(lengths))
        finally:
            adapter.close()
    return {"bench": "lookup", "index_entries": len(index), "runs": runs,
            "embedder": f"{embedder.name} (onnxruntime, {embedder.budget}-wordpiece head+tail)",
            "hnsw": {"connectivity": 16, "expansion_search": 50},
            "points": points, "environment": environment()}


def lookup_table(res: dict[str, Any]) -> str:
    rows = [[p["prompt_tokens"], p["lookup_ms_median"], p["embed_ms_median"], p["search_ms_median"],
             p["cold_ttft_ms"], f"{100 * p['share_of_cold_ttft']:.1f}%", p["tier"],
             p["best_similarity"]] for p in res["points"]]
    return table(["prompt tokens", "lookup ms (median)", "embed ms", "search ms", "cold TTFT ms",
                  "share", "tier", "best sim"], rows) + f"\nindex: {res['index_entries']} entries"


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    res = run_lookup_bench(model=args.model, entries=args.entries, runs=max(args.runs, 5),
                           n_ctx=args.n_ctx, progress=progress)
    return res, lookup_table(res)


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = bench_parser(sub, "lookup", "what the semantic layer costs a request that misses",
                     run_cli, n_ctx=True, runs=True)
    p.add_argument("--entries", type=int, default=1000, help="vectors in the index (default 1000)")
    return p
