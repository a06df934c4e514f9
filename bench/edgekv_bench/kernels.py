"""`edgekv bench kernels`: is exact reuse paid for in speed? Stock llama.cpp beside EdgeKV's
builds, per model and weight type (issue 20).

Rows (JSON contract, keys stable): `{"rows": [{"model", "weights", "build", "flash_attn",
"prefill_tok_s_512", "prefill_tok_s_2048", "decode_tok_s", "probe_identical", "probe_total",
"first_divergence_mean"}]}`, `build` one of:

- `stock`: llama-cpp-python as a plain `pip install` builds it (ggml's defaults: native,
  llamafile on; `make stock-lib`), flash attention off, its llama-bench beside it;
- `stock_fa`: the same with flash attention on;
- `edgekv_before`: EdgeKV's build before the patch series (this CPU's flags, llamafile off),
  flash attention off;
- `edgekv`: the build `make setup` makes (patches/llama.cpp, llamafile on), the .venv's own
  llama-cpp-python, with its batch-invariant kernels on (GGML_CPU_BATCH_INVARIANT=1) and flash
  attention on: EdgeKV's defaults.

Every build runs in its own process (`kernels_worker.py`, LLAMA_CPP_LIB_PATH set to the build's
libraries), so no two builds' kernels share a process. The contract's speeds come from that one
harness for every row (llama-cpp-python, one batch per prompt, as a plain user runs it); the
stock rows (and the patched one, where its llama-bench is built) also carry llama-bench's own
figures (`llama_bench_*`). Rounds are interleaved (every row once per round, the order rotated)
and each figure is the median over the rounds with its [min, max] spread beside it. A round's
decode speed (after a 16-token prompt, and after the 2,048-token one) is one over the median of
its 64 timed steps, so a burst of load on a shared machine moves a few steps rather than the
figure; steps over their total time is beside it (`decode_tok_s_whole`,
`decode_tok_s_after_2048_whole`). The probe
and the divergence are deterministic and run once per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekv.errors import EdgeKVError

from .options import Subparsers, bench_parser

__all__ = ["add_parser", "Build", "BUILDS", "ensure_quantized", "kernels_table", "run_cli",
           "run_kernels_bench"]

BUILDS = ("stock", "stock_fa", "edgekv_before", "edgekv")
# SmolLM2 requantized from the packaged Q4_1 (no F16 original ships): other kernels, not other
# model quality, is what these rows compare
REQUANT = ("Q8_0", "Q4_0")
MODELS = ("smollm2-q4_1", "smollm2-q8_0", "smollm2-q4_0", "gemma3-q4_k_m")
# every other name: smollm2-<type> (requantized) or synthetic-<shape>-<type>
# (edgekv_bench.synthetic: random weights, labelled synthetic in every row)
MORE_MODELS = ("smollm2-q4_k_m", "smollm2-q5_k_m", "smollm2-q6_k", "smollm2-q3_k_m",
               "smollm2-iq4_xs")
# the emulated (aarch64) rows' default: the CI stand-ins (the packaged models take about an
# hour each under qemu: --models smollm2-q4_1,... runs them)
EMULATED_BUILDS = ("edgekv", "stock")  # stock: the cross build with the switch off
# the emulated rows that also run the probe's 2,040-token schedules (the rest: pending)
# The emulated rows that run the probe's 2,040-token schedules too: MODEL (at every level) or
# MODEL@ARCH. The CI stand-ins run them at one level each: what is long there (the attention
# over 2,040 cells, past Gemma 3's window) is the same code at both levels, whose kernels the
# short schedules and the kernel check cover at each; emulated, the long schedules were two
# thirds of the check's time (CI ran 59.8 of its 60 minutes with them at both levels).
LONG_MODELS = ("synthetic-smollm2-2l-q4_k_m@aarch64-dotprod",
               "synthetic-gemma3-2l-q4_k_m@aarch64-i8mm")
INVARIANT = "GGML_CPU_BATCH_INVARIANT"


@dataclass(frozen=True, slots=True)
class Build:
    name: str
    lib: Path | None  # LLAMA_CPP_LIB_PATH; None: the .venv's own llama-cpp-python libraries
    flash_attn: bool
    env: dict[str, str] = field(default_factory=dict)
    llama_bench: Path | None = None  # this build's llama-bench, where there is one
    note: str = ""  # where the build is not the one named (said in the row)


def default_builds(root: Path = Path(".")) -> dict[str, Build]:
    """Where `make` puts each build: build/stock-lib (`make stock-lib`), build/edgekv-before-lib
    (`make edgekv-before-lib`), the .venv's own llama-cpp-python (`make setup`: EdgeKV's
    patched engine) and build/llama-server/bin/llama-bench (`make llama-server`).

    Where the stock wheel is not built (`make stock-lib` takes 5-10 minutes on 2 idle cores),
    the stock rows run on the .venv's patched libraries with the batch-invariant mode off: each
    patch is gated on its switch, so those are the stock kernels, compiled with this CPU's
    flags; the row says so in `note`. Every row sets GGML_CPU_BATCH_INVARIANT itself (EdgeKV
    turns it on where the environment does not say)."""
    stock_lib: Path | None = root / "build/stock-lib"
    note = ""
    if stock_lib is not None and not (stock_lib / "libllama.so").exists():
        stock_lib = None
        note = ("stock kernels from the .venv's patched build with GGML_CPU_BATCH_INVARIANT=0 "
                "(the stock wheel, make stock-lib, was not built)")
    bench = next((p for p in (root / "build/llama-server/bin/llama-bench",
                              root / "build/stock/bin/llama-bench") if p.is_file()), None)
    patched_bench = root / "build/patched-tools/bin/llama-bench"
    off, on = {INVARIANT: "0"}, {INVARIANT: "1"}
    return {
        "stock": Build("stock", stock_lib, False, off, bench, note),
        "stock_fa": Build("stock_fa", stock_lib, True, off, bench, note),
        "edgekv_before": Build("edgekv_before", root / "build/edgekv-before-lib", False, off),
        "edgekv": Build("edgekv", None, True, on,
                        patched_bench if patched_bench.exists() else None),
    }


def ensure_quantized(cache_dir: Path, llama_quantize: Path, source: Path) -> dict[str, Path]:
    """SmolLM2 in Q8_0 and Q4_0 in `<cache dir>/models/`, made from `source` (the packaged
    Q4_1) with llama.cpp's own llama-quantize (`--allow-requantize`) the first time."""
    from .synthetic import quantize

    out = {}
    for qtype in REQUANT:
        dst = Path(cache_dir) / "models" / f"{source.stem.rsplit('.', 1)[0]}.{qtype}-from-Q4_1.gguf"
        if not dst.exists():
            quantize(source, dst, qtype.lower(), requantize=True, llama_quantize=llama_quantize)
        out[qtype] = dst
    return out


def model_paths(cache_dir: Path, llama_quantize: Path,
                names: Sequence[str]) -> dict[str, tuple[Path, str]]:
    """name -> (GGUF path, weight type label). SmolLM2's other weight types and the synthetic
    models are made the first time (edgekv_bench.synthetic), with `llama_quantize` where it
    is built, else with llama-cpp-python's llama_model_quantize (the same function)."""
    from edgekv.engines.models import resolve_model

    from .synthetic import ensure_model, parse_name

    out: dict[str, tuple[Path, str]] = {}
    for n in names:
        if n == "gemma3-q4_k_m":
            out[n] = (resolve_model("gemma3", cache_dir), "Q4_K_M")
            continue
        try:
            shape, wtype = parse_name(n)
        except EdgeKVError as e:
            raise EdgeKVError(f"unknown model {n!r}; pick from "
                              f"{', '.join(MODELS + MORE_MODELS)} or synthetic-<shape>-<type> "
                              f"({e})") from None
        path = ensure_model(n, cache_dir, llama_quantize if llama_quantize.is_file() else None)
        label = wtype.upper()
        if shape == "smollm2" and wtype != "q4_1":
            label += " (requantized from Q4_1)"
        elif shape != "smollm2":
            label += " (synthetic: random weights)"
        out[n] = (path, label)
    return out


def _worker(build: Build, spec: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    env = {**os.environ, **build.env, "HF_HUB_OFFLINE": "1"}
    env.pop("LLAMA_CPP_LIB_PATH", None)
    if build.lib is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(build.lib.resolve())
    res = subprocess.run([sys.executable, "-m", "edgekv_bench.kernels_worker", json.dumps(spec)],
                         capture_output=True, text=True, env=env, timeout=timeout)
    if res.returncode != 0 or not res.stdout.strip():
        raise EdgeKVError(f"{build.name} worker failed (rc {res.returncode}): "
                          f"{res.stderr.strip()[-600:]}")
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def _llama_bench(build: Build, model: Path, threads: int) -> dict[str, float]:
    """One llama-bench run (pp512, pp2048, tg32; one repetition: the rounds repeat it)."""
    assert build.llama_bench is not None
    cmd = [str(build.llama_bench), "-m", str(model), "-p", "512,2048", "-n", "32", "-r", "1",
           "-t", str(threads), "-fa", "1" if build.flash_attn else "0", "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, **build.env})
    if res.returncode != 0:
        raise EdgeKVError(f"llama-bench failed for {build.name}: {res.stderr.strip()[-400:]}")
    out = {}
    for r in json.loads(res.stdout):
        key = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        out[key] = float(r["avg_ts"])
    return out


def _stat(values: Sequence[float], digits: int = 1) -> tuple[float | None, list[float] | None]:
    if not values:
        return None, None
    return round(statistics.median(values), digits), [round(min(values), digits),
                                                       round(max(values), digits)]


def run_kernels_bench(models: Sequence[str] | None = None, builds: Sequence[str] = BUILDS,
                      runs: int = 5, prompts: int = 20, threads: int | None = None,
                      cache_dir: Path | None = None, root: Path = Path("."),
                      llama_quantize: Path | None = None, arches: Sequence[str] | None = None,
                      long_models: Sequence[str] = LONG_MODELS,
                      progress: Any = None) -> dict[str, Any]:
    """Rows for every (arch, model, build): this machine's own arch natively (speeds, probe,
    divergence), the aarch64 ones under qemu (probe only; emulated.py)."""
    from edgekv.config import default_cache_dir

    from .emulated import ARCHES, host_arch
    from .report import environment
    from .synthetic import CI_STANDINS

    host = host_arch()
    arches = list(arches or [host])
    bad = [a for a in arches if a not in ARCHES]
    if bad:
        raise EdgeKVError(f"unknown arch(es) {', '.join(bad)}; pick from {', '.join(ARCHES)}")
    foreign = [a for a in arches if a != host and ARCHES[a].level is None]
    if foreign:
        raise EdgeKVError(f"{', '.join(foreign)}: not this machine ({host}), and only aarch64 "
                          "is emulated here: run the bench on such a machine")
    native = host in arches
    if models is None:
        models = MODELS if native else CI_STANDINS
    cache_dir = Path(cache_dir or default_cache_dir())
    threads = threads or os.cpu_count() or 1
    paths = model_paths(cache_dir, llama_quantize or root / "build/llama-server/bin/llama-quantize",
                        models)
    t0 = time.time()
    rows = (_native_rows(models, builds, paths, runs, prompts, threads, root, host, progress)
            if native else [])
    emulated = [ARCHES[a] for a in arches if a != host]
    if emulated:
        rows += _emulated_rows(models, builds, paths, emulated, long_models, root, progress)
    return {"rows": rows, "ratios": stock_ratios(rows), "runs": runs, "prompts": prompts,
            "threads": threads, "arches": arches,
            "models": list(models), "builds": list(builds), "seconds": round(time.time() - t0),
            "environment": environment()}


def _model_keys(name: str, path: Path) -> dict[str, Any]:
    from .synthetic import is_synthetic, model_params

    return {"params": model_params(path), "synthetic": is_synthetic(name)}


def _native_rows(models: Sequence[str], builds: Sequence[str],
                 paths: dict[str, tuple[Path, str]], runs: int, prompts: int, threads: int,
                 root: Path, host: str, progress: Any) -> list[dict[str, Any]]:
    specs = default_builds(root)
    chosen = [specs[b] for b in builds]
    for b in chosen:
        if b.lib is not None and not (b.lib / "libllama.so").exists():
            raise EdgeKVError(f"build {b.name}: {b.lib}/libllama.so is missing (see the "
                              "Makefile: stock-lib, edgekv-before-lib)")
    cells = [(m, b) for m in models for b in chosen]
    speed: dict[tuple[str, str], list[dict[str, float]]] = {(m, b.name): [] for m, b in cells}
    bench: dict[tuple[str, str], list[dict[str, float]]] = {(m, b.name): [] for m, b in cells}
    quality: dict[tuple[str, str], dict[str, Any]] = {}
    for rnd in range(runs):
        order = cells[rnd % len(cells):] + cells[: rnd % len(cells)]  # rotate: interleaved
        for i, (m, b) in enumerate(order):
            if progress:
                progress(f"round {rnd + 1}/{runs}: {m} {b.name} ({i + 1}/{len(order)})")
            tasks = ["speed"] + (["probe", "divergence"] if rnd == 0 else [])
            spec = {"model": str(paths[m][0]), "flash_attn": b.flash_attn, "threads": threads,
                    "tasks": tasks, "prompts": prompts}
            r = _worker(b, spec)
            speed[(m, b.name)].append(r)
            if rnd == 0:
                quality[(m, b.name)] = {k: r[k] for k in ("probe", "first_divergence",
                                                          "build_info")}
            if b.llama_bench is not None:
                bench[(m, b.name)].append(_llama_bench(b, paths[m][0], threads))
    rows = []
    for m, b in cells:
        s, q = speed[(m, b.name)], quality[(m, b.name)]
        div = q["first_divergence"]
        row: dict[str, Any] = {
            "model": m, "weights": paths[m][1], "build": b.name, "flash_attn": b.flash_attn,
            "arch": host, "emulated": False, **_model_keys(m, paths[m][0]),
            **speeds(s),
            "probe_identical": q["probe"]["identical"], "probe_total": q["probe"]["total"],
            "first_divergence_mean": round(sum(div) / len(div), 2), "first_divergence": div,
            "probe_failed": q["probe"]["failed"], "probe_seconds": round(q["probe"]["seconds"], 1),
            "speed_source": "llama-cpp-python (kernels_worker)", "runs": len(s),
            "lib": str(b.lib) if b.lib else ".venv", "env": b.env, "build_info": q["build_info"],
            "note": b.note, "llama_bench": str(b.llama_bench) if b.llama_bench else None,
        }
        lb = bench[(m, b.name)]
        for key in ("pp512", "pp2048", "tg32"):
            row[f"llama_bench_{key}"], row[f"llama_bench_{key}_spread"] = _stat(
                [x[key] for x in lb if key in x])
        rows.append(row)
    return rows


NULL_SPEEDS = {f"{k}{suffix}": None for k in ("prefill_tok_s_512", "prefill_tok_s_2048",
                                             "decode_tok_s", "decode_tok_s_after_2048")
               for suffix in ("", "_spread")}


def runs_long(model: str, arch: str, long_models: Sequence[str]) -> bool:
    """Whether the emulated row (`arch`, `model`) runs the long schedules: `long_models` names
    the model, the model at that arch (`MODEL@ARCH`), or is 'all'."""
    return "all" in long_models or model in long_models or f"{model}@{arch}" in long_models


def _emulated_rows(models: Sequence[str], builds: Sequence[str],
                   paths: dict[str, tuple[Path, str]], arches: Sequence[Any],
                   long_models: Sequence[str], root: Path, progress: Any) -> list[dict[str, Any]]:
    """The probe of every (arch, model, build) under qemu: `edgekv` with the switch on (flash
    attention on, EdgeKV's defaults), `stock` the same cross build with it off (each patch is
    gated on it: ggml's own kernels). No speeds: qemu's are not a device's."""
    from .emulated import run_emulated

    which = [b for b in builds if b in EMULATED_BUILDS]
    cells = [(a, m, b) for a in arches for m in models for b in which]
    results = run_emulated([(a, paths[m][0], b == "edgekv",
                             2040 if runs_long(m, a.name, long_models) else 0)
                            for a, m, b in cells], root=root, progress=progress)
    rows = []
    for (a, m, b), r in zip(cells, results, strict=True):
        if "error" in r:  # the probe did not finish: no verdict, and the row says why
            r = {"results": [], "notes": [], "pending": [], "seconds": None,
                 "flash_attn": None, **r}
        failed = [n for n, d, same in r["results"] if not (d == 0.0 and same)]
        rows.append({
            "model": m, "weights": paths[m][1], "build": b, "flash_attn": bool(r["flash_attn"]),
            "arch": a.name, "emulated": True, **_model_keys(m, paths[m][0]), **NULL_SPEEDS,
            "probe_identical": len(r["results"]) - len(failed), "probe_total": len(r["results"]),
            "first_divergence_mean": None, "probe_failed": failed,
            "probe_results": r["results"], "probe_notes": r["notes"],
            "probe_pending": r["pending"], "error": r.get("error"),
            "probe_seconds": None if r["seconds"] is None else round(r["seconds"], 1),
            "speed_source": None, "runs": 0, "qemu_cpu": a.qemu_cpu, "march": a.march,
            "system_info": r.get("system_info"), "batch_invariant": r.get("batch_invariant"),
            "note": ("emulated (qemu-user): exactness only, no speed; probe seconds are qemu's"
                     + ("" if b == "edgekv" else "; stock kernels: EdgeKV's cross build with "
                        "GGML_CPU_BATCH_INVARIANT=0")),
            **{f"llama_bench_{k}": None for k in ("pp512", "pp2048", "tg32")},
        })
    return rows


def speeds(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A row's speeds from its rounds' worker results: each figure's median over the rounds
    and its [min, max] spread. A round's decode speed is 1 / its median step (a burst of load
    moves a few steps, not the figure); `*_whole` is steps over their total time."""
    out: dict[str, Any] = {}
    for n in (512, 2048):
        out[f"prefill_tok_s_{n}"], out[f"prefill_tok_s_{n}_spread"] = _stat(
            [n / x[f"prefill_{n}_s"] for x in rounds])
    for key, steps in (("decode_tok_s", "decode_steps_s"),
                       ("decode_tok_s_after_2048", "decode_2048_steps_s")):
        out[key], out[f"{key}_spread"] = _stat(
            [1 / statistics.median(x[steps]) for x in rounds])
        out[f"{key}_whole"] = _stat([len(x[steps]) / sum(x[steps]) for x in rounds])[0]
    out["decode_steps"] = len(rounds[0]["decode_steps_s"])
    # every round's figures, in the order they ran (the medians above are over these)
    out["round_figures"] = [{
        **{f"prefill_tok_s_{n}": round(n / x[f"prefill_{n}_s"], 1) for n in (512, 2048)},
        "decode_tok_s": round(1 / statistics.median(x["decode_steps_s"]), 1),
        "decode_tok_s_after_2048": round(1 / statistics.median(x["decode_2048_steps_s"]), 1),
    } for x in rounds]
    return out


def kernels_table(res: dict[str, Any]) -> str:
    from .report import table

    head = ["arch", "model", "weights", "params", "build", "FA", "prefill 512 tok/s",
            "prefill 2048 tok/s",
            "decode tok/s", "decode after 2048 tok/s", "llama-bench pp512 / pp2048 / tg32",
            "probe", "first divergence"]

    def fmt(v: Any, spread: Any) -> str:
        return "-" if v is None else f"{v:g} ({spread[0]:g}-{spread[1]:g})"

    def params(n: Any) -> str:
        return "-" if not n else f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"

    body = []
    for r in res["rows"]:
        lb = " / ".join("-" if r[f"llama_bench_{k}"] is None else f"{r[f'llama_bench_{k}']:g}"
                        for k in ("pp512", "pp2048", "tg32"))
        arch = r.get("arch", "-") + (" (qemu)" if r.get("emulated") else "")
        body.append([arch, r["model"], r["weights"], params(r.get("params")), r["build"],
                     "on" if r["flash_attn"] else "off",
                     fmt(r["prefill_tok_s_512"], r["prefill_tok_s_512_spread"]),
                     fmt(r["prefill_tok_s_2048"], r["prefill_tok_s_2048_spread"]),
                     fmt(r["decode_tok_s"], r["decode_tok_s_spread"]),
                     fmt(r.get("decode_tok_s_after_2048"), r.get("decode_tok_s_after_2048_spread")),
                     lb,
                     "did not finish" if r.get("error") else
                     f"{r['probe_identical']}/{r['probe_total']}"
                     + (" (+pending: " + ", ".join(r["probe_pending"]) + ")"
                        if r.get("probe_pending") else ""),
                     "-" if r["first_divergence_mean"] is None
                     else f"{r['first_divergence_mean']:g}"])
    steps = next((r.get("decode_steps") for r in res["rows"]), None)
    note = (f"Medians over {res['runs']} interleaved rounds (min-max in brackets), "
            f"{res['threads']} threads; a round's decode speed is 1 / its median step "
            f"({steps or 'its'} greedy steps; the rows' decode_tok_s_whole: steps / their "
            f"total time); first divergence: mean over {res['prompts']} prompts of "
            "the first of 64 greedy tokens that differs from the one-batch run (64 = none).")
    if any(r.get("emulated") for r in res["rows"]):
        note += (" Rows marked (qemu) ran under qemu-user: exactness only. qemu gives no "
                 "faithful speed, so their speeds are null; their probe ran the C++ probe "
                 "(probe/edgekv_probe.cpp) on EdgeKV's cross build (scripts/arm_check.sh), "
                 "stock = the same build with GGML_CPU_BATCH_INVARIANT=0.")
    if any(r.get("synthetic") for r in res["rows"]):
        note += (" synthetic-* models have random weights (edgekv_bench.synthetic): for "
                 "speed, KV size and exactness only, never for answers.")
    native = [r for r in res["rows"] if not r.get("emulated")]
    if native and (res["runs"] < 5 or res["prompts"] < 20 or len(res["models"]) < len(MODELS)):
        note += (" REDUCED RUN: fewer rounds, prompts or models than the full matrix "
                 f"(runs {res['runs']}, prompts {res['prompts']}, models "
                 f"{', '.join(res['models'])}).")
    notes = sorted({f"{r['build']}: {r['note']}" for r in res["rows"] if r.get("note")})
    if notes:
        note += " " + "; ".join(notes) + "."
    out = table(head, body) + "\n\n" + note
    if res.get("ratios"):
        out += "\n\n" + table(["model", "edgekv / fastest stock: prefill 512", "prefill 2048",
                                "decode", "decode after 2048"],
                               [[r["model"]] + ["-" if r[k] is None else f"{r[k]:.3f}x"
                                                for k in RATIO_KEYS] for r in res["ratios"]])
        out += ("\n\nEach ratio: the edgekv row's median over the faster of the stock and "
                "stock_fa rows' medians for that figure.")
    return out


RATIO_KEYS = ("prefill_tok_s_512", "prefill_tok_s_2048", "decode_tok_s", "decode_tok_s_after_2048")
# in the JSON's ratios too, not in the table: decode as steps over their total time
WHOLE_KEYS = ("decode_tok_s_whole", "decode_tok_s_after_2048_whole")


def stock_ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model: the edgekv row's figures over the fastest stock configuration's (stock or
    stock_fa, whichever is faster for that figure)."""
    out = []
    native = [r for r in rows if not r.get("emulated")]
    for model in dict.fromkeys(r["model"] for r in native):
        mine = next((r for r in native if r["model"] == model and r["build"] == "edgekv"), None)
        stock = [r for r in native if r["model"] == model and r["build"] in ("stock", "stock_fa")]
        if mine is None or not stock:
            continue
        ratio: dict[str, Any] = {"model": model, "arch": mine.get("arch")}
        for k in RATIO_KEYS + WHOLE_KEYS:
            best = max((r[k] for r in stock if r.get(k)), default=None)
            ratio[k] = round(mine[k] / best, 3) if best and mine.get(k) else None
        out.append(ratio)
    return out


def run_cli(args: Any) -> tuple[dict[str, Any], str]:
    """`edgekv bench kernels`: --models, --builds (default all), --runs, --prompts, --threads."""
    models = tuple(x for x in (getattr(args, "models", None) or "").split(",") if x) or None
    arches = tuple(x for x in (getattr(args, "arch", None) or "").split(",") if x) or None
    long_models = tuple(x for x in (getattr(args, "long_models", None) or
                                    ",".join(LONG_MODELS)).split(",") if x)
    builds = tuple(x for x in (getattr(args, "builds", None) or ",".join(BUILDS)).split(",") if x)
    bad = [b for b in builds if b not in BUILDS]
    if bad:
        raise EdgeKVError(f"unknown build(s) {', '.join(bad)}; pick from {', '.join(BUILDS)}")
    cache_dir = Path(args.cache_dir) if getattr(args, "cache_dir", None) else None

    def progress(msg: str) -> None:
        print(f"\r  {msg:<70}", end="", file=sys.stderr, flush=True)

    res = run_kernels_bench(models, builds, runs=args.runs,
                            prompts=getattr(args, "prompts", None) or 20,
                            threads=args.threads, cache_dir=cache_dir, arches=arches,
                            long_models=long_models, progress=progress)
    print(file=sys.stderr)
    return res, kernels_table(res)


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = bench_parser(sub, "kernels", "stock llama.cpp beside EdgeKV's builds per model and "
                     "weight type: speed and batch invariance", run_cli,
                     model=False, runs=True, threads="engine threads (default: all cores)")
    p.add_argument("--models", default=None,
                   help=f"comma-separated models (default: {','.join(MODELS)}; with only "
                   "emulated --arch, the CI stand-ins). Also smollm2-<type> (requantized from "
                   f"the packaged Q4_1: {','.join(MORE_MODELS)}) and synthetic-<shape>-<type> "
                   "(random weights: shapes smollm2-2l, gemma3-2l, smollm2-360m, llama3.2-1b, "
                   "smollm2-1.7b), made in the cache dir the first time")
    p.add_argument("--arch", default=None,
                   help="comma-separated arch rows (default: this machine's own): "
                   "x86_64-avx512, x86_64-avx2, aarch64-dotprod, aarch64-i8mm; the aarch64 "
                   "ones run the probe under qemu on the cross builds of scripts/arm_check.sh")
    p.add_argument("--long-models", default=",".join(LONG_MODELS),
                   help="emulated rows that also run the probe's 2,040-token schedules: "
                   "MODEL (every --arch) or MODEL@ARCH, comma-separated ('all' for every "
                   "one; the rest list them as pending)")
    p.add_argument("--builds", default=",".join(BUILDS),
                   help=f"comma-separated builds (default: {','.join(BUILDS)})")
    p.add_argument("--prompts", type=int, default=20,
                   help="prompts for the first divergence (default 20)")
    return p
