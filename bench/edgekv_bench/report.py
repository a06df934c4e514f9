"""Benchmark output: medians, environment, tables, and the default report (JSON result +
Markdown page). It imports no benchmark: a bench with plots writes them itself."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .markdown import table

__all__ = ["environment", "median_ms", "table", "write_bench_report", "write_json"]


def median_ms(seconds: Sequence[float]) -> float:
    return round(statistics.median(seconds) * 1000.0, 3)


def environment() -> dict[str, Any]:
    try:
        import llama_cpp
        llama_version = llama_cpp.__version__
    except ImportError:
        llama_version = None
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "llama_cpp_python": llama_version,
        "cpu": _cpu_model(),
        "commit": _commit(),
        "argv": list(sys.argv),
    }


def _cpu_model() -> str | None:
    """The CPU's model name and its widest vector extension (the machine kind a figure ran
    on); None where /proc/cpuinfo cannot be read."""
    from edgekv.engines.probe import cpu_identity

    name, flags = cpu_identity()
    wide = next((f for f in ("amx_tile", "avx512f", "avx2", "asimddp") if f in flags), None)
    return None if not name else f"{name} ({wide})" if wide else name


def _commit() -> str | None:
    """The checkout's commit (with `-dirty` where the tree has changes) the run used."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head.strip() + ("-dirty" if dirty.strip() else "")


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, p)
    return p


def write_bench_report(name: str, res: dict[str, Any], text: str,
                       path: str | Path | None = None) -> str:
    """Write benchmark `name`'s result as JSON at `path` (default `bench-out/<name>.json`) and
    a Markdown page beside it holding `text` (its table). A bench whose report has more (the
    seed's plots, the stream's TTFT plot) registers its own writer (`options.bench_parser`).
    Returns a line saying what was written."""
    out = write_json(path or f"bench-out/{name}.json", res)
    md = out.with_suffix(".md")
    md.write_text(f"# edgekv bench {name}\n\n{text}\n")
    return f"wrote {out} and {md}"
