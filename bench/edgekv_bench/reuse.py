"""`edgekv bench reuse`: cold prefill vs warm reuse, side by side in one run.

A context of exactly `context_tokens` tokens (the built-in manual, cut to length) is followed by
a short question. The cache is filled once; then each run asks a question four ways, in
rotating order so drift of the machine hits all alike: cold (no cache), warm from RAM, warm from
disk with the files in the page cache (RAM tier emptied first, as in a fresh process), and from
disk with a cold page cache (the store's files dropped from it with `posix_fadvise(DONTNEED)`,
checked with `mincore`: what a fresh boot or a long idle pays). The KV-reuse claim is only
counted if the warm logits and greedy tokens equal the cold ones. `sweep` repeats the
measurement for context lengths that are not multiples of the chunk size, so the reuse that
ends inside a chunk is measured too.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import mmap
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgekv.config import CacheConfig
from edgekv.core.pipeline import EdgeKV, GenerationResult
from edgekv.store import open_store

from .options import ENGINES, Subparsers, bench_parser, csv, progress
from .report import environment, median_ms, table
from .texts import MANUAL, QUESTIONS, SYSTEM_PROMPT

__all__ = ["add_parser", "drop_page_cache", "reuse_table", "run_cli", "run_reuse_bench"]

log = logging.getLogger(__name__)

MODES = ("cold", "warm", "disk", "disk_cold")
SWEEP = (300, 517, 777, 1000)  # none a multiple of the 128-token chunk


def build_context(kv: EdgeKV, context_tokens: int) -> list[int]:
    text = SYSTEM_PROMPT + "\n\n" + MANUAL
    ids = kv.adapter.tokenize(text)
    while len(ids) < context_tokens:  # longer contexts repeat the manual
        ids += kv.adapter.tokenize("\n\n" + MANUAL, add_bos=False)
    return ids[:context_tokens]


def _resident_pages(path: Path) -> tuple[int, int]:
    """(pages of `path` in the page cache, pages in all), by `mincore` on a mapping."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return -1, n
        try:
            if libc.mincore(addr, size, vec) != 0:
                return -1, n
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec), n


def drop_page_cache(root: Path) -> dict[str, int]:
    """Evict every file under `root` from the page cache (`posix_fadvise(DONTNEED)`: no root
    needed; clean pages only, so files are synced first) and count the pages still resident
    afterwards, so a cold read is known to be cold."""
    files = [p for p in Path(root).rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    resident = total = 0
    for p in files:
        r, t = _resident_pages(p)
        resident, total = resident + max(r, 0), total + t
    return {"files": len(files), "pages": total, "pages_resident_after_drop": resident}


def _measure(kv: EdgeKV, cache_dir: Path, context: list[int], questions: list[list[int]],
             runs: int, max_tokens: int, progress: Any) -> dict[str, Any]:
    kv.generate(context + questions[-1], max_tokens=1)  # fills the cache (and warms up)
    got: dict[str, list[GenerationResult]] = {m: [] for m in MODES}
    diffs, equal, dropped = [], [], []
    for r in range(runs):
        prompt = context + questions[r % len(questions)]
        this: dict[str, GenerationResult] = {}
        for mode in np.roll(MODES, r):
            if mode in ("disk", "disk_cold"):
                kv.store.clear_tier("ram")  # type: ignore[attr-defined]
            if mode == "disk_cold":
                dropped.append(drop_page_cache(cache_dir))
            this[mode] = kv.generate(prompt, max_tokens=max_tokens, use_cache=mode != "cold",
                                     store=False)
        for m in MODES:
            got[m].append(this[m])
        for m in MODES[1:]:
            diffs.append(float(np.max(np.abs(this[m].first_logits - this["cold"].first_logits))))
            equal.append(this[m].tokens == this["cold"].tokens)
        if progress:
            progress(r + 1, runs)
    cold = float(np.median([g.ttft_s for g in got["cold"]]))
    return {
        "context_tokens": len(context),
        "chunk_remainder": len(context) % kv.config.chunk_size,
        **{f"{m}_ttft_ms": median_ms([g.ttft_s for g in got[m]]) for m in MODES},
        **{f"speedup_{m}": round(cold / float(np.median([g.ttft_s for g in got[m]])), 2)
           for m in MODES[1:]},
        "cached_tokens_warm": got["warm"][0].cached_tokens,
        "prompt_tokens": got["warm"][0].prompt_tokens,
        "logits_max_abs_diff": max(diffs),
        "greedy_tokens_equal": all(equal),
        "page_cache_drop": dropped[-1] if dropped else None,
        "breakdown_ms": {m: {"lookup": median_ms([g.lookup_s for g in got[m]]),
                             "inject": median_ms([g.inject_s for g in got[m]]),
                             "prefill": median_ms([g.prefill_s for g in got[m]])}
                         for m in MODES},
        "ttft_ms": {m: [round(g.ttft_s * 1000, 3) for g in got[m]] for m in MODES},
        "_results": got,
    }


def run_reuse_bench(*, model: str | None = None, runs: int = 5, context_tokens: int = 512,
                    max_tokens: int = 16, chunk_size: int = 128, n_ctx: int = 2048,
                    cache_dir: Path | None = None, progress: Any = None,
                    engine: str = "llamacpp", sweep: Sequence[int] = SWEEP,
                    n_threads: int | None = None) -> dict[str, Any]:
    from edgekv.engines import open_adapter

    tmp = None
    if cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="edgekv-bench-")
        cache_dir = Path(tmp.name)
    cfg = CacheConfig(chunk_size=chunk_size, cache_dir=cache_dir)
    adapter = open_adapter(engine, model, n_ctx=n_ctx, memo_dir=cache_dir,
                           **({"n_threads": n_threads} if n_threads else {}))
    store = open_store(cfg)
    kv = EdgeKV(adapter, store, cfg)
    try:
        questions = [adapter.tokenize(f"\n\nQuestion: {q}\nAnswer:", add_bos=False)
                     for q in QUESTIONS]
        points = []
        for n in [context_tokens, *(s for s in sweep if s != context_tokens)]:
            if n + max(map(len, questions)) + max_tokens > n_ctx:
                log.warning("context %d does not fit n_ctx %d; skipped", n, n_ctx)
                continue
            points.append(_measure(kv, cache_dir, build_context(kv, n), questions, runs,
                                   max_tokens, progress))
        main = points[0]
        got = main.pop("_results")
        for p in points[1:]:
            p.pop("_results")
        result = {
            "bench": "reuse",
            "context_tokens": main["context_tokens"],
            "question_tokens": [len(questions[r % len(questions)]) for r in range(runs)],
            "runs": runs,
            "max_tokens": max_tokens,
            "chunk_size": chunk_size,
            "reuse_granularity": kv.granularity,
            "threads": adapter.n_threads,
            "cold_ttft_ms": main["cold_ttft_ms"],
            "warm_ttft_ms": main["warm_ttft_ms"],
            "warm_disk_ttft_ms": main["disk_ttft_ms"],
            "warm_disk_cold_ttft_ms": main["disk_cold_ttft_ms"],
            "speedup": main["speedup_warm"],
            "speedup_disk": main["speedup_disk"],
            "speedup_disk_cold": main["speedup_disk_cold"],
            "logits_max_abs_diff": max(p["logits_max_abs_diff"] for p in points),
            "greedy_tokens_equal": all(p["greedy_tokens_equal"] for p in points),
            "cached_tokens_warm": main["cached_tokens_warm"],
            "computed_tokens_warm": [g.computed_tokens for g in got["warm"]],
            "page_cache_drop": main["page_cache_drop"],
            "breakdown_ms": {"cold": main["breakdown_ms"]["cold"],
                             "warm": main["breakdown_ms"]["warm"],
                             "warm_disk": main["breakdown_ms"]["disk"],
                             "warm_disk_cold": main["breakdown_ms"]["disk_cold"]},
            "ttft_ms": {"cold": main["ttft_ms"]["cold"], "warm": main["ttft_ms"]["warm"],
                        "warm_disk": main["ttft_ms"]["disk"],
                        "warm_disk_cold": main["ttft_ms"]["disk_cold"]},
            "sweep": points,
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


def reuse_table(res: dict[str, Any]) -> str:
    rows = [
        ["cold (no cache)", res["cold_ttft_ms"], "1.00x", 0],
        ["warm (RAM tier)", res["warm_ttft_ms"], f"{res['speedup']:.2f}x",
         res["cached_tokens_warm"]],
        ["warm (disk tier, page cache warm)", res["warm_disk_ttft_ms"],
         f"{res['speedup_disk']:.2f}x", res["cached_tokens_warm"]],
        ["warm (disk tier, page cache dropped)", res["warm_disk_cold_ttft_ms"],
         f"{res['speedup_disk_cold']:.2f}x", res["cached_tokens_warm"]],
    ]
    out = table(["mode", "TTFT median ms", "speedup", "reused tokens"], rows) + (
        f"\ncontext {res['context_tokens']} tokens, {res['runs']} runs; logits max |diff| "
        f"{res['logits_max_abs_diff']}; greedy {res['max_tokens']} tokens equal: "
        f"{res['greedy_tokens_equal']}")
    sweep = res.get("sweep", [])
    if sweep:
        out += "\n\n" + table(
            ["context", "mod chunk", "reused/prompt", "cold ms", "RAM ms", "disk ms",
             "disk cold-cache ms", "RAM x", "disk cold x", "equal"],
            [[p["context_tokens"], p["chunk_remainder"],
              f"{p['cached_tokens_warm']}/{p['prompt_tokens']}", p["cold_ttft_ms"],
              p["warm_ttft_ms"], p["disk_ttft_ms"], p["disk_cold_ttft_ms"],
              f"{p['speedup_warm']:.2f}x", f"{p['speedup_disk_cold']:.2f}x",
              p["greedy_tokens_equal"]] for p in sweep])
    return out


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    res = run_reuse_bench(model=args.model, runs=args.runs, context_tokens=args.context_tokens,
                          max_tokens=args.max_tokens or 16, chunk_size=args.chunk_size or 128,
                          n_ctx=args.n_ctx, progress=progress, engine=args.engine,
                          sweep=tuple(int(x) for x in csv(args.sweep)), n_threads=args.threads)
    return res, reuse_table(res)


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = bench_parser(sub, "reuse", "cold prefill vs warm reuse from RAM and disk, side by "
                     "side", run_cli, n_ctx=True, chunk_size=True, runs=True,
                     threads="engine threads, the same for every mode "
                     "(default: all cores)")
    p.add_argument("--context-tokens", type=int, default=512, help="prompt length (default 512)")
    p.add_argument("--sweep", default="300,517,777,1000",
                   help="more context lengths (not multiples of the chunk), '' for none")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    p.add_argument("--engine", choices=ENGINES, default="llamacpp", help="the engine under test")
    return p
