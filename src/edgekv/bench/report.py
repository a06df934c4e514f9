"""Benchmark output: medians, environment, tables, and the reports each benchmark writes
(JSON result + Markdown page, with plots where a benchmark has them)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..markdown import table

__all__ = ["environment", "median_ms", "serve_table", "table", "write_bench_report", "write_json"]


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
    }


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
    a Markdown page beside it holding `text` (its table); `seed` adds PNG plots (`plots.py`),
    `stream` its TTFT-vs-bandwidth plot. Returns a line saying what was written."""
    out = write_json(path or f"bench-out/{name}.json", res)
    md = out.with_suffix(".md")
    if name == "seed":
        from .plots import write_seed_report

        return f"wrote {out}\nreport: {write_seed_report(res, md)} (with PNG plots beside it)"
    if name == "stream":
        from .stream import write_stream_plot

        png = write_stream_plot(res, out.with_suffix(".png"))
        md.write_text(
            f"# edgekv bench stream\n\n{text}\n\n(pred N): not run, predicted by the cost model "
            f"(above the {res['stream_deadline_s']:.0f} s deadline). Energy: "
            f"{res['energy_method']} (estimated).\n\n![TTFT vs bandwidth]({png.name})\n")
        return f"wrote {out}, {md} and {png}"
    md.write_text(text + "\n" if name == "serve" else f"# edgekv bench {name}\n\n{text}\n")
    return f"wrote {out} and {md}"


def serve_table(res: dict[str, Any]) -> str:
    """`edgekv bench serve`: one row per server."""
    def phase(m: dict[str, Any], key: str) -> str:
        p = m.get(key)
        return "-" if not p else (f"{p['ttft_ms_mean']} / {p['ttft_ms_p95']} "
                                  f"({100 * p['agreement_own_cache_off']:.0f}%)")

    rows = [[n, phase(m, "before_restart"), m.get("edgekv_ttft_ratio_before_restart", "-"),
             phase(m, "after_restart"), m["ttft_ms_mean"], m["ttft_ms_p95"], m["e2e_ms_mean"],
             f"{m['cached_tokens']}/{m['prompt_tokens']}",
             f"{100 * m['agreement_own_cache_off']:.1f}%",
             f"{100 * m['agreement_vs_plain']:.1f}%", m.get("edgekv_ttft_ratio", "-")]
            for n, m in res["servers"].items()]
    text = table(["server", "before restart: TTFT mean / p95 ms (= own cache-off)",
                  "vs EdgeKV before restart", "after restart: mean / p95 (= own)",
                  "all: TTFT mean", "p95", "e2e mean ms", "cached/prompt tokens",
                  "= own cache-off", "= plain", "all: vs EdgeKV"], rows)
    settings = [[n, *(m.get("resolved", {}).get(k) or "-" for k in
                      ("flash_attn", "n_slots", "prompt_cache", "threads", "system_info"))]
                for n, m in res["servers"].items()]
    return text + "\n\nResolved settings, from each server's own log:\n\n" + table(
        ["server", "flash attention", "slots", "prompt cache", "threads", "system info"],
        settings)
