"""`edgekv bench rag`: passage reuse (opt-in, approximate) against no cache and strict prefix
reuse, on questions over a pool of passages from Python's own documentation.

Each passage is one standard-library module's docstring opening and a few of its functions
(`inspect`, offline); each question asks which module provides a function named in exactly
one of the request's k (3-6) passages, which come in a random order: its answer is known.
Per request every mode runs on the same tokens, the cold run first (it is the reference),
then the others in an order that rotates from request to request:

- `nocache`: everything computed (the reference for quality);
- `prefix`: EdgeKV's strict reuse (exact; reuses only a common leading run of passages);
- `passage/0`, `epic/k16`, `epic/5%`... `blend/30%`: passage reuse with each policy and budget.

Quality against the cold run: first-token top-1 agreement, KL(cold || mode) of the first-token
distribution, greedy agreement up to the first divergence over `--max-tokens` (32) tokens, and
whether the answer names the right module. A mode's generation stops at its first divergence
from the cold tokens once the first `ANSWER_TOKENS` are out (the answer is judged on those).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .markdown import table
from .options import Subparsers, bench_parser
from .report import environment

__all__ = ["add_parser", "build_pool", "rag_table", "run_cli", "run_rag_bench"]

MODULES = ("json", "zlib", "math", "random", "itertools", "functools", "heapq", "bisect",
           "textwrap", "difflib", "base64", "hashlib", "shutil", "tempfile", "statistics",
           "fnmatch", "glob", "gzip", "bz2", "lzma", "csv", "string", "copy", "pprint",
           "struct", "binascii", "calendar", "operator", "secrets", "colorsys")
DEFAULT_BUDGETS = "0,k16,0.05,0.15,0.30"
ANSWER_TOKENS = 12  # the answer is judged on the first tokens, always generated
INSTRUCTION = "Answer using the passages.\n\n"


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def build_pool(tokenize: Callable[[str], list[int]], lo: int = 64, hi: int = 100,
               size: int = 14) -> list[dict[str, Any]]:
    """Up to `size` passages, one per module that yields `lo`..`hi` tokens: its docstring's
    first paragraph,
    then public functions (name(signature): first docstring line) until `hi` would be passed.
    Each records the functions it names (the facts questions ask about)."""
    pool: list[dict[str, Any]] = []
    seen: set[str] = set()
    for name in MODULES:
        if len(pool) >= size:
            break
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        text = f"Module {name}. {_first_paragraph(inspect.getdoc(mod) or '')}"
        funcs = []
        for fname, obj in sorted(vars(mod).items()):
            if fname.startswith("_") or not callable(obj) or inspect.isclass(obj) \
                    or fname in seen or getattr(obj, "__module__", name) not in (name, None,
                                                                              f"_{name}"):
                continue
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            line = f" Function {fname}: {_first_paragraph(doc).split('. ')[0].rstrip('.')}."
            if len(tokenize(text + line)) > hi:
                break
            text += line
            funcs.append(fname)
        if funcs and lo <= len(tokenize(text)) <= hi:
            seen.update(funcs)
            pool.append({"module": name, "text": text + "\n\n", "functions": funcs})
    return pool


def _workload(pool: Sequence[dict[str, Any]], requests: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        k = rng.randint(3, 6)
        chosen = rng.sample(range(len(pool)), k)  # a random order
        target = pool[rng.choice(chosen)]
        # a question the function's name does not answer by itself
        func = rng.choice([f for f in target["functions"] if target["module"] not in f.lower()]
                          or target["functions"])
        out.append({"passages": chosen, "answer": target["module"], "function": func,
                    "question": f"Question: Which module has the function {func}?\nAnswer: "
                                "The module"})
    return out


def _parse_budgets(spec: str) -> list[float]:
    out = []
    for b in spec.split(","):
        b = b.strip().lower()
        if b:
            out.append(float(b[1:]) if b.startswith("k") else float(b))
    return out


def _modes(budgets: Sequence[float]) -> list[tuple[str, str, float]]:
    """(label, policy, budget): budget 0 is one mode (no policy recomputes anything); EPIC
    at every budget, the blend policy at the fractional ones (its k form adds nothing)."""
    from edgekv.core.passages import PassagePolicy

    modes = [("nocache", "", 0.0), ("prefix", "", 0.0)]
    if 0 in budgets:
        modes.append(("passage/0", "epic", 0.0))
    for name in ("epic", "blend"):
        for b in budgets:
            if b > 0 and not (name == "blend" and b >= 1):
                modes.append((PassagePolicy(name, b).label, name, b))
    return modes


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x.astype(np.float64) - float(x.max()))
    return np.asarray(z / z.sum())


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p, q = _softmax(p_logits), _softmax(q_logits)
    return float(np.sum(p * (np.log(p + 1e-300) - np.log(q + 1e-300))))


def run_rag_bench(*, requests: int = 30, budgets: str = DEFAULT_BUDGETS, seed: int = 0,
                  max_tokens: int = 32, model: str | None = None, n_ctx: int = 2048,
                  chunk_size: int | None = None, cache_dir: str | None = None,
                  threads: int | None = None,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from edgekv import CacheConfig, EdgeKV, open_store
    from edgekv.config import default_cache_dir
    from edgekv.core.passages import PassagePolicy
    from edgekv.engines.llamacpp import LlamaCppAdapter

    say = progress or (lambda _m: None)
    adapter = LlamaCppAdapter(model, n_ctx=n_ctx, n_threads=threads)
    work = Path(tempfile.mkdtemp(prefix="edgekv-rag-"))
    probes = [Path(cache_dir or default_cache_dir()) / "probes"]
    kvs: list[Any] = []
    try:
        def cache(name: str, **kw: Any) -> Any:
            d = work / name
            if probes[0].is_dir():  # the probe's verdict for this build, not measured again
                shutil.copytree(probes[0], d / "probes")
            if chunk_size:
                kw["chunk_size"] = chunk_size
            cfg = CacheConfig(cache_dir=d, **kw)
            kv = EdgeKV(adapter, open_store(cfg), cfg)
            kvs.append(kv)
            if not probes[0].is_dir() and (d / "probes").is_dir():  # keep the verdict
                shutil.copytree(d / "probes", probes[0])
            return kv

        strict = cache("prefix")
        passage = cache("passage", passage_reuse=True, passage_policy="blend")
        pool = build_pool(lambda t: adapter.tokenize(t, add_bos=False))
        say(f"{len(pool)} passages from {len(MODULES)} modules")
        t = time.perf_counter()
        passage.warm_passages([p["text"] for p in pool], scores=True)
        warm_s = time.perf_counter() - t
        modes = _modes(_parse_budgets(budgets))
        work_items = _workload(pool, requests, seed)
        rows: list[dict[str, Any]] = []
        for i, req in enumerate(work_items):
            texts = [pool[j]["text"] for j in req["passages"]]
            layout = passage.passages.layout(INSTRUCTION + req["question"], texts, max_tokens)
            # the instruction sits after the passages, before the question
            cold = passage.generate(INSTRUCTION + req["question"], passages=texts,
                                    max_tokens=max_tokens, use_cache=False)
            ref = list(cold.tokens)
            order = modes[1:]
            rot = i % len(order)
            row: dict[str, Any] = {"request": i, "k": len(texts), "answer": req["answer"],
                                   "prompt_tokens": len(layout.tokens),
                                   "passage_tokens": sum(len(s.tokens) for s in layout.spans),
                                   "modes": {"nocache": _score(cold, cold, ref, req, layout,
                                                               adapter.detokenize)}}
            for label, policy, budget in order[rot:] + order[:rot]:
                stop = _stopper(ref)
                if label == "prefix":
                    r = strict.generate(layout.tokens, max_tokens=max_tokens, on_token=stop)
                else:
                    r = passage.generate(INSTRUCTION + req["question"], passages=texts,
                                         max_tokens=max_tokens, on_token=stop,
                                         passage_policy=PassagePolicy(policy, budget))
                row["modes"][label] = _score(r, cold, ref, req, layout, adapter.detokenize)
            rows.append(row)
            say(f"request {i + 1}/{len(work_items)}: k={len(texts)}, "
                f"{len(layout.tokens)} tokens, cold TTFT {cold.ttft_s * 1000:.0f} ms")
        res = {
            "benchmark": "rag", "environment": environment(),
            "model": str(adapter.model_path.name), "engine": adapter.build_info(),
            "threads": adapter.n_threads,
            "granularity": strict.granularity, "requests": requests, "seed": seed,
            "max_tokens": max_tokens, "answer_tokens": ANSWER_TOKENS,
            "pool": [{"module": p["module"], "tokens": len(adapter.tokenize(p["text"],
                                                                           add_bos=False)),
                      "functions": len(p["functions"])} for p in pool],
            "warm_s": round(warm_s, 3),
            "modes": _summary([m[0] for m in modes], rows), "rows": rows}
        res["recommendation"] = _recommend(res["modes"])
        return res
    finally:
        for kv in kvs:
            with contextlib.suppress(Exception):
                kv.store.close()
        adapter.close()
        shutil.rmtree(work, ignore_errors=True)


def _stopper(ref: Sequence[int]) -> Callable[[int], bool]:
    """Stop a mode's generation at its first divergence from the cold tokens, once the
    answer's first `ANSWER_TOKENS` are out."""
    seen: list[int] = []

    def on_token(tok: int) -> bool:
        seen.append(tok)
        n = len(seen)
        return n < ANSWER_TOKENS or (n <= len(ref) and seen == list(ref[:n]))

    return on_token


def _score(r: Any, cold: Any, ref: Sequence[int], req: dict[str, Any],
           layout: Any, detok: Callable[[Sequence[int]], str]) -> dict[str, Any]:
    toks = list(r.tokens)
    agree = 0
    for a, b in zip(toks, ref, strict=False):
        if a != b:
            break
        agree += 1
    start = layout.spans[0].start
    p_tokens = sum(len(s.tokens) for s in layout.spans)
    if r.passages is not None:
        reused = r.passages.reused_tokens
    else:
        reused = max(0, min(r.cached_tokens, layout.end) - start)
    answer_text = detok(toks[:ANSWER_TOKENS])
    return {
        "ttft_ms": round(r.ttft_s * 1000, 3),
        "reused_passage_share": round(reused / p_tokens, 4) if p_tokens else 0.0,
        "top1_agree": bool(np.argmax(r.first_logits) == np.argmax(cold.first_logits)),
        "kl_first": round(_kl(cold.first_logits, r.first_logits), 6),
        "greedy_agree": round(agree / len(ref), 4) if ref else 1.0,
        "correct": req["answer"].lower() in answer_text.lower(),
        "text": answer_text,
        "passages": r.passages.as_dict() if r.passages is not None else None,
    }


def _summary(labels: Sequence[str], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for m in labels:
        xs = [row["modes"][m] for row in rows if m in row["modes"]]
        if not xs:
            continue
        ttft = sorted(x["ttft_ms"] for x in xs)
        out[m] = {
            "ttft_ms_mean": round(statistics.fmean(ttft), 1),
            "ttft_ms_p95": round(ttft[min(len(ttft) - 1, math.ceil(0.95 * len(ttft)) - 1)], 1),
            "reused_passage_share": round(statistics.fmean(x["reused_passage_share"]
                                                           for x in xs), 4),
            "top1_agreement": round(statistics.fmean(x["top1_agree"] for x in xs), 4),
            "kl_first_mean": round(statistics.fmean(x["kl_first"] for x in xs), 5),
            "greedy_agreement": round(statistics.fmean(x["greedy_agree"] for x in xs), 4),
            "correct": round(statistics.fmean(x["correct"] for x in xs), 4),
            "n": len(xs)}
    return out


def _recommend(modes: dict[str, Any]) -> dict[str, Any]:
    """The default budget: the fastest passage mode whose first token agrees with the cold
    run's on at least 90% of requests and whose answers are right at least as often as the
    cold run's less 5 points; else the most faithful passage mode."""
    cold = modes["nocache"]
    cands = {m: s for m, s in modes.items() if m not in ("nocache", "prefix")}
    ok = {m: s for m, s in cands.items()
          if s["top1_agreement"] >= 0.9 and s["correct"] >= cold["correct"] - 0.05}
    if ok:
        best = min(ok, key=lambda m: ok[m]["ttft_ms_mean"])
        why = ("the fastest passage mode with first-token agreement >= 90% and answer "
               "correctness within 5 points of the cold run")
    else:
        best = max(cands, key=lambda m: (cands[m]["top1_agreement"],
                                         cands[m]["greedy_agreement"]))
        why = "no passage mode met 90% first-token agreement: the most faithful one"
    s = modes[best]
    return {"mode": best, "rule": why,
            "ttft_speedup_vs_nocache": round(cold["ttft_ms_mean"] / s["ttft_ms_mean"], 2)}


def write_pareto(res: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (key, name) in zip(axes, (("top1_agreement", "first-token top-1 agreement"),
                                      ("greedy_agreement", "greedy agreement (share of 32)")),
                               strict=True):
        pts = sorted((s["ttft_ms_mean"], s[key], m) for m, s in res["modes"].items())
        front, best = [], -1.0
        for x, y, _ in pts:
            if y > best:
                front.append((x, y))
                best = y
        ax.plot(*zip(*front, strict=True), "--", color="grey", lw=1, label="Pareto front")
        for x, y, m in pts:
            color = ("black" if m in ("nocache", "prefix") else
                     "tab:blue" if m.startswith("epic") else
                     "tab:orange" if m.startswith("blend") else "tab:red")
            ax.scatter(x, y, color=color)
            ax.annotate(m, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("TTFT mean (ms)")
        ax.set_ylabel(name)
        ax.set_ylim(-0.05, 1.08)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"edgekv bench rag: {res['requests']} requests, {res['model']} (passage reuse "
                 "is approximate)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rag_table(res: dict[str, Any], png: str | None = None) -> str:
    rows = [[m, s["ttft_ms_mean"], s["ttft_ms_p95"], f"{100 * s['reused_passage_share']:.0f}%",
             f"{100 * s['top1_agreement']:.0f}%", s["kl_first_mean"],
             f"{100 * s['greedy_agreement']:.0f}%", f"{100 * s['correct']:.0f}%"]
            for m, s in res["modes"].items()]
    rec = res["recommendation"]
    text = table(["mode", "TTFT mean ms", "p95", "passage tokens reused", "top-1 = cold",
                  "KL first token", "greedy agreement", "answer right"], rows)
    text += (f"\n\n{res['requests']} requests, k = 3-6 passages in random order "
             f"({len(res['pool'])} passages of Python documentation); model {res['model']}; "
             f"quality against the cold run. Recommended default: **{rec['mode']}** "
             f"({rec['rule']}; TTFT {rec['ttft_speedup_vs_nocache']}x faster than no cache).")
    if png:
        text += f"\n\n![TTFT against quality]({png})"
    return text


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """`edgekv bench rag [--requests N] [--budgets 0,k16,0.05,0.15,0.30] [--max-tokens 32]`."""
    res = run_rag_bench(
        requests=getattr(args, "requests", None) or 30,
        budgets=getattr(args, "budgets", None) or DEFAULT_BUDGETS,
        seed=getattr(args, "seed", 0) or 0, max_tokens=getattr(args, "max_tokens", None) or 32,
        model=getattr(args, "model", None), n_ctx=getattr(args, "n_ctx", None) or 2048,
        chunk_size=getattr(args, "chunk_size", None),
        cache_dir=getattr(args, "cache_dir", None), threads=getattr(args, "threads", None),
        progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    out = Path(getattr(args, "json", None) or "bench-out/rag.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    png = write_pareto(res, out.with_suffix(".png"))
    return res, rag_table(res, png.name)


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = bench_parser(sub, "rag", "passage reuse (approximate) against no cache and strict "
                     "prefix reuse, at recompute budgets", run_cli, n_ctx=True, chunk_size=True,
                     threads="engine threads (default: all cores)")
    p.add_argument("--requests", type=int, default=30, help="requests (default 30)")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS,
                   help=f"recompute budgets, comma-separated (default {DEFAULT_BUDGETS})")
    p.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    return p
