"""The lab's commands. `edgekv` finds them as plugins (the entry points of group
`edgekv.commands` in `bench/pyproject.toml`) and hands each the rest of its command line:
`edgekv bench NAME ...` (every benchmark and harness, each with its own options, runner and
report: `add_parser`, `options.bench_parser`) and `edgekv demo` (what `make run` shows)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from edgekv.config import CacheConfig
from edgekv.engines.models import resolve_model

__all__ = ["BENCHES", "HARNESS_BENCHES", "bench", "bench_parser", "demo"]

BENCHES = ("reuse", "lookup", "seed", "stream", "engines", "codec", "serve", "rag", "kernels",
           "pressure", "spec")
HARNESS_BENCHES = ("faults", "fuzz")  # the fault matrix and the fuzz supervisor (edgekv_harness)


def bench_parser() -> argparse.ArgumentParser:
    """`edgekv bench`: one subcommand per benchmark, each with its own options."""
    p = argparse.ArgumentParser(
        prog="edgekv bench",
        description="Benchmarks; each writes its result as JSON (--json) and a Markdown page "
                    "beside it. `edgekv bench NAME --help` lists its options.")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name in BENCHES:
        importlib.import_module(f"edgekv_bench.{name}").add_parser(bsub)
    for name in HARNESS_BENCHES:
        importlib.import_module(f"edgekv_harness.{name}").add_parser(bsub)
    return p


def _resolve_model(args: argparse.Namespace) -> None:
    """`--model` names a GGUF file or a packaged model's alias: resolved once, to a path."""
    if getattr(args, "model", None) is not None:
        cache_dir = Path(args.cache_dir) if getattr(args, "cache_dir", None) else None
        args.model = str(resolve_model(args.model, CacheConfig.from_env(cache_dir=cache_dir)
                                       .cache_dir))


def bench(argv: list[str]) -> int:
    """`edgekv bench NAME [options]`: run it, print its table, write its JSON and page."""
    args = bench_parser().parse_args(argv)
    _resolve_model(args)
    res, text = args.bench_run(args)
    print(text)
    print(args.bench_report(args.bench, res, text, args.json))
    if res.get("failed_rows"):  # e.g. a fault row whose harness crashed: not a pass
        print(f"edgekv bench {args.bench}: {len(res['failed_rows'])} row(s) failed: "
              f"{', '.join(map(str, res['failed_rows']))}", file=sys.stderr)
        return 1
    return 0


def demo(argv: list[str]) -> int:
    """`edgekv demo`: cold vs warm on real prompts, the same output (what `make run` shows)."""
    from .demo import run_demo

    p = argparse.ArgumentParser(prog="edgekv demo", description=demo.__doc__)
    p.add_argument("--model", help="GGUF file, or a packaged model: smollm2 (the default) or "
                   "gemma3")
    p.add_argument("--n-ctx", type=int, default=2048, help="context window (tokens)")
    p.add_argument("--cache-dir",
                   help="cache directory (default: $EDGEKV_CACHE_DIR or ~/.cache/edgekv)")
    args = p.parse_args(argv)
    _resolve_model(args)
    return run_demo(model=args.model, n_ctx=args.n_ctx, cache_dir=args.cache_dir)
