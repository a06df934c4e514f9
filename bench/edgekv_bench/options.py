"""What the `edgekv bench <name>` subcommands share: the common options (each bench takes only
those it uses: an option it does not take is an argparse error), the registration of a
bench's runner and report, progress on stderr, and the peers' default binaries.

A bench module registers itself with `add_parser(subparsers)`, which calls `bench_parser`
with its `run_cli(args) -> (result, table)` and, where its report is more than the JSON and a
Markdown page of the table (`report.write_bench_report`), its own writer."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from edgekv.errors import ConfigError

__all__ = ["ENGINES", "Report", "Run", "Subparsers", "bench_parser", "csv", "llama_server_opt",
           "llama_server_path", "progress", "stock_python_path"]

ENGINES = ("llamacpp", "torch", "onnx")


class Subparsers(Protocol):
    """What `ArgumentParser.add_subparsers` returns, as far as a bench uses it."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


Run = Callable[[argparse.Namespace], tuple[dict[str, Any], str]]
# (bench name, result, table, --json path or None) -> a line saying what was written
Report = Callable[[str, dict[str, Any], str, "str | None"], str]


def bench_parser(sub: Subparsers, name: str, help: str, run: Run, report: Report | None = None,
                 *, model: bool = True, n_ctx: bool = False, chunk_size: bool = False,
                 threads: str | None = None, runs: bool = False) -> argparse.ArgumentParser:
    """`edgekv bench <name>`'s parser with the shared options the bench uses: `--json`
    always; `--model` and `--cache-dir` (where a packaged model is assembled) unless
    `model=False`; `--n-ctx`, `--chunk-size`, `--runs` (default 5) where asked; `--threads`
    with `threads` as its help."""
    p = sub.add_parser(name, help=help, description=help)
    p.add_argument("--json", help=f"write the result here (default bench-out/{name}.json; a "
                   "Markdown page goes beside it)")
    if model:
        p.add_argument("--model",
                       help="GGUF file, or a packaged model: smollm2 (SmolLM2-135M-Instruct, "
                            "the default) or gemma3 (Gemma 3 270M)")
    p.add_argument("--cache-dir",
                   help="cache directory (default: $EDGEKV_CACHE_DIR or ~/.cache/edgekv)")
    if n_ctx:
        p.add_argument("--n-ctx", type=int, default=2048, help="context window (tokens)")
    if chunk_size:
        p.add_argument("--chunk-size", type=int, help="tokens per chunk (default 128)")
    if runs:
        p.add_argument("--runs", type=int, default=5, help="repeats (default 5)")
    if threads is not None:
        p.add_argument("--threads", type=int, help=threads)
    if report is None:
        from .report import write_bench_report

        report = write_bench_report
    p.set_defaults(bench=name, bench_run=run, bench_report=report)
    return p


def llama_server_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary (default: "
                   "build/llama-server/bin/llama-server, which `make llama-server` builds, "
                   "where present)")


def llama_server_path(given: str | None) -> Path | None:
    """llama.cpp's server binary for the benchmarks: the one given, else the one `make
    llama-server` builds, if it is there (the peer is skipped, and said so, where it is not)."""
    if given:
        return Path(given)
    built = Path("build/llama-server/bin/llama-server")
    return built if built.is_file() else None


def stock_python_path(given: str | None) -> Path | None:
    """The Python of a venv holding llama-cpp-python as a plain `pip install` builds it: the
    one given, else the one `make stock-llama-cpp-python` builds, if it is there."""
    if given:
        return Path(given)
    built = Path("build/stock-venv/bin/python")
    return built if built.is_file() else None


def stock_lib_path(given: str | None) -> Path | None:
    """The stock wheel's native libraries (LLAMA_CPP_LIB_PATH for the peers that run the
    .venv's llama-cpp-python): the directory given, else the one `make stock-lib` fills, if
    it is there."""
    if given:
        if not (Path(given) / "libllama.so").is_file():
            raise ConfigError(f"--stock-lib {given}: no libllama.so there; run `make "
                              "stock-lib` or give its directory")
        return Path(given)
    built = Path("build/stock-lib")
    return built if (built / "libllama.so").is_file() else None


def csv(value: str | None) -> tuple[str, ...]:
    """A comma-separated option as its non-empty items."""
    return tuple(x for x in (value or "").split(",") if x)


def progress(i: int, n: int) -> None:
    """`step i/n` on one stderr line."""
    print(f"\r  step {i}/{n}", end="" if i < n else "\n", file=sys.stderr, flush=True)
