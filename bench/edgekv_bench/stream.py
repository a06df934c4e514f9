"""`edgekv bench stream`: local vs all-stream vs hybrid (SparKV) over a link sweep and variants.

A real KV server process (`edgekv kv-server`) holds the contexts' chunks (precomputed by its own
engine); the device shapes its side of the connection (`netem.Shaper`, in the client: this
kernel has no sch_netem and tc needs root). Server and device share one host, one CPU and one
build (`setup` in the JSON says so): the server's CPU time competes with the device's.

Points: a bandwidth x RTT grid, then link variants at one grid point: RTT jitter, segment loss,
a planner prior for the bandwidth 4x too high and 4x too low (no probe: corrected only by what
the request itself measures), and a link whose bandwidth drops 10x halfway through the chunk
bytes (the executor computes chunks that are overdue and re-plans: `executed` shows which).
At a grid point the planner's estimate is what the device measured: the RTT of a `/v1/info`
call (the client's own timing, never the configured value; both are in the JSON) and one probe
chunk's transfer. Each point runs every mode `repeats` times, the order rotated per repeat, each
run from an empty device cache; the JSON and table give the mean, median and spread.

Modes (the grid; a variant runs stream and hybrid, and its plain reference is the grid's:
plain compute does not depend on the link): `plain` is `EdgeKV.generate` with no streaming at
all (what a device without a server does); `local` (with `with_local`) computes every chunk
through the executor; `stream` streams every chunk (skipped where predicted above
`stream_deadline_s`: reported as null with the prediction); `hybrid` plans per chunk. All of
these start once the loader's background server check has finished (a device that keeps a
session). `hybrid_new`, run where the plan is all-compute (low bandwidth), builds its loader
right before the request: the check and session are then still under way, so it shows whether
anything on the network sits on an all-compute request's critical path.
Energy is estimated (CPU time x power + received bytes x radio energy).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekv.config import CacheConfig
from edgekv.core.pipeline import EdgeKV
from edgekv.energy import CPU_W_PER_BUSY_CORE
from edgekv.store import open_store
from edgekv.stream.client import KVClient
from edgekv.stream.costmodel import RADIO_J_PER_BYTE, RADIO_W_ACTIVE, CostModel
from edgekv.stream.hybrid import HybridLoader, HybridResult
from edgekv.stream.shaper import Shaper

from .options import Subparsers, bench_parser, csv, progress
from .report import environment, table
from .texts import MANUAL, SYSTEM_PROMPT

__all__ = ["add_parser", "Link", "run_cli", "run_stream_bench", "spread", "stream_table",
           "write_report"]

SETUP_NOTE = ("server and device run on one host from one build and share its CPU cores (the "
              "server's encode/encrypt competes with the device's prefill); the link is "
              "emulated in the client (netem.Shaper), not by the kernel")
ALL_COMPUTE_MAX_MBPS = 5.0  # grid points at or below this run hybrid_new (all-compute plans)


@dataclass(frozen=True, slots=True)
class Link:
    """One point's link: what the shaper does, and what the planner is told beforehand."""

    bandwidth_mbps: float
    rtt_ms: float
    variant: str = "grid"
    jitter_ms: float = 0.0
    loss: float = 0.0
    prior_factor: float | None = None  # planner's prior bandwidth = true x this; no probe
    drop_to_mbps: float | None = None  # bandwidth after half the prompt's chunk bytes

    def shaper(self, seed: int, chunk_wire: int, n_chunks: int) -> Shaper:
        half = n_chunks * chunk_wire // 2 if self.drop_to_mbps else None
        return Shaper(bandwidth_mbps=self.bandwidth_mbps, rtt_ms=self.rtt_ms, loss=self.loss,
                      seed=seed, jitter_ms=self.jitter_ms, change_after_bytes=half,
                      changed_bandwidth_mbps=self.drop_to_mbps)


def spread(values: list[float]) -> dict[str, Any]:
    """Mean, median and spread of one mode's runs (ms)."""
    v = sorted(values)
    p10, p90 = (float(x) for x in np.percentile(v, [10, 90]))
    return {"n": len(v), "mean": round(statistics.fmean(v), 1),
            "median": round(statistics.median(v), 1), "min": round(v[0], 1),
            "max": round(v[-1], 1), "p10": round(p10, 1), "p90": round(p90, 1),
            "stdev": round(statistics.stdev(v), 1) if len(v) > 1 else 0.0,
            "runs": [round(x, 1) for x in values]}


def _start_server(tmp: Path, model: str | None) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "edgekv", "kv-server", "--port", "0", "--cache-dir", str(tmp),
           "--secret-file", str(tmp / "secret")]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"kv-server did not start: {line!r}")
    return proc, line.split("listening on ")[1].split()[0]


def _links(bandwidths: tuple[float, ...], rtts: tuple[float, ...], variants: bool,
           at: tuple[float, float]) -> list[Link]:
    """The grid, then the variants at `at` = (bandwidth, RTT): there the planner's choice
    depends on the link (a chunk's transfer takes about as long as its compute), so a wrong
    prior or a drop changes the plan. The drop starts at 3x that bandwidth (streaming wins)
    and falls 10x (computing wins)."""
    out = [Link(bw, rtt) for bw in bandwidths for rtt in rtts]
    if variants:
        bw, rtt = at
        out += [Link(bw, rtt, "jitter", jitter_ms=20.0),
                Link(bw, rtt, "loss", loss=0.02),
                Link(bw, rtt, "prior x4", prior_factor=4.0),
                Link(bw, rtt, "prior /4", prior_factor=0.25),
                Link(round(bw * 3, 2), rtt, "drop 10x", drop_to_mbps=round(bw * 0.3, 3))]
    return out


def crossover_mbps(cost: CostModel, chunk_wire_bytes: float) -> float:
    """The bandwidth at which one chunk's transfer takes as long as computing it here."""
    return round(chunk_wire_bytes * 8 / max(cost.compute_s(0), 1e-3) / 1e6, 1)


def run_stream_bench(*, model: str | None = None,
                     bandwidths: tuple[float, ...] = (1, 5, 20, 100, 500),
                     rtts: tuple[float, ...] = (10, 80), contexts: tuple[int, ...] = (512,),
                     stream_deadline_s: float = 12.0, max_tokens: int = 8, repeats: int = 5,
                     variants: bool = True, variant_at: tuple[float, float] | None = None,
                     n_threads: int | None = None, with_local: bool = False,
                     progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    from edgekv.engines.llamacpp import LlamaCppAdapter

    tmp = tempfile.TemporaryDirectory(prefix="edgekv-stream-")
    root = Path(tmp.name)
    proc, url = _start_server(root / "server", model)
    secret = bytes.fromhex((root / "server" / "secret").read_text())
    adapter = LlamaCppAdapter(model, n_ctx=max(contexts) + 256, memo_dir=root,
                              n_threads=n_threads)
    base_cost = CostModel()
    base_cost.calibrate(adapter, 128, positions=(0, 4))
    wire = 128 * adapter.fingerprint.kv_bytes_per_token * base_cost.wire_ratio
    variant_at = variant_at or (crossover_mbps(base_cost, wire), min(rtts))
    links = _links(bandwidths, rtts, variants, variant_at)
    points = []
    try:
        text = SYSTEM_PROMPT + "\n\n" + MANUAL
        ids = adapter.tokenize(text)
        while len(ids) < max(contexts):
            ids += adapter.tokenize("\n\n" + MANUAL, add_bos=False)
        q = adapter.tokenize("\nQuestion: what does an orange ring mean?\nAnswer:", add_bos=False)
        prompts = {n: ids[:n] + q for n in contexts}
        colds = {}
        for n, p in prompts.items():
            KVClient(url, secret, timeout_s=120).precompute(p)
            adapter.clear_kv_cache()
            logits = adapter.prefill(p, align=128)
            colds[n] = (logits, adapter.generate(logits, max_tokens).tokens)
        jobs = [(n, link) for link in links for n in contexts
                if link.variant == "grid" or n == min(contexts)]
        for n, link in jobs:
            bench = _Point(adapter, url, secret, prompts[n], colds[n], link, base_cost, root,
                           max_tokens, with_local)
            point = bench.run(repeats, stream_deadline_s)
            point["context_tokens"] = n
            points.append(point)
            if progress:
                progress(len(points), len(jobs))
    finally:
        proc.kill()
        proc.wait()
        adapter.close()
        tmp.cleanup()
    for pt in points:
        refs = [g["ttft_ms"]["plain"] for g in points if g["variant"] == "grid"
                and g["context_tokens"] == pt["context_tokens"] and g["ttft_ms"].get("plain")]
        if "plain" not in pt["ttft_ms"] and refs:
            pt["plain_ref_ms"] = round(statistics.fmean(refs), 1)
    return {"bench": "stream", "points": points, "stream_deadline_s": stream_deadline_s,
            "repeats": repeats, "order": "modes rotated by one place per repeat",
            "threads": adapter.n_threads,
            "setup": SETUP_NOTE, "honesty": SETUP_NOTE,
            "variant_at": {"bandwidth_mbps": variant_at[0], "rtt_ms": variant_at[1],
                           "why": "the calibrated crossover: one chunk's transfer ~ its compute"},
            "all_compute_vs_local": _all_compute_summary(points),
            "energy_source": "estimated",
            "energy_method": ("process CPU s x 3 W + received bytes x 100 nJ/B + seconds the "
                              "radio was receiving x 0.8 W"),
            "calibration": {"prefill_a_s": round(base_cost.prefill_a_s, 4),
                            "prefill_b_s": round(base_cost.prefill_b_s, 4)},
            "environment": environment()}


class _Point:
    """One sweep point: measure the link (unless the point gives the planner a wrong prior),
    then every mode `repeats` times in rotating order, each from an empty device cache."""

    def __init__(self, adapter: Any, url: str, secret: bytes, prompt: list[int],
                 cold: tuple[Any, Any], link: Link, base_cost: CostModel, root: Path,
                 max_tokens: int, with_local: bool = False) -> None:
        self.adapter, self.url, self.secret, self.prompt = adapter, url, secret, prompt
        self.cold, self.link, self.root, self.max_tokens = cold, link, root, max_tokens
        self.n_chunks = (len(prompt) - 1) // 128
        self.tag = f"{link.variant}-{link.bandwidth_mbps}-{link.rtt_ms}-{len(prompt)}"
        self.rtts_ms: list[float] = []
        self.with_local = with_local
        self.cost, self.chunk_wire = self._measure(base_cost)

    def _client(self, seed: int) -> KVClient:
        return KVClient(self.url, self.secret, timeout_s=30,
                        shaper=self.link.shaper(seed, self.chunk_wire, self.n_chunks))

    def _measure(self, base: CostModel) -> tuple[CostModel, int]:
        """The device's link estimate: the RTT of an info call (the client's own clock) and
        one probe chunk (its wire size; its transfer time unless the prior is the point)."""
        link = copy.deepcopy(base)
        cfg = CacheConfig(cache_dir=self.root / f"probe-{self.tag}")
        kv = EdgeKV(self.adapter, open_store(cfg), cfg)
        client = KVClient(self.url, self.secret, timeout_s=60,
                          shaper=Shaper(bandwidth_mbps=self.link.bandwidth_mbps,
                                        rtt_ms=self.link.rtt_ms, jitter_ms=self.link.jitter_ms,
                                        loss=self.link.loss, seed=1000))
        t = time.perf_counter()
        client.info()
        rtt = time.perf_counter() - t
        self.rtts_ms.append(rtt * 1000)
        gen = client.stream(kv.chunk_keys(self.prompt)[:1])
        probe = next(gen)
        gen.close()
        kv.close()
        raw = probe.fragment.nbytes if probe.fragment else 1
        link.observe_wire_ratio(probe.wire_bytes, raw)
        if self.link.prior_factor is None:
            link.observe_rtt(rtt)
            link.observe_transfer(probe.wire_bytes, max(1e-4, probe.at_s - rtt))
        else:
            link.bandwidth_Bps = self.link.bandwidth_mbps * 1e6 / 8 * self.link.prior_factor
        return link, probe.wire_bytes

    def _predicted_stream_s(self) -> float:
        bw = self.link.bandwidth_mbps
        if self.link.drop_to_mbps:  # half the bytes at each bandwidth
            bw = 2 / (1 / bw + 1 / self.link.drop_to_mbps)
        return self.link.rtt_ms / 1000 + self.n_chunks * self.chunk_wire * 8 / (bw * 1e6)

    def run(self, repeats: int, deadline: float) -> dict[str, Any]:
        # plain local compute does not depend on the link: variants compare with the grid's
        # (`plain_ref_ms`); `local` (the executor's chunk-by-chunk compute) runs with `local`
        modes = (["plain", "stream", "hybrid"] if self.link.variant == "grid"
                 else ["stream", "hybrid"])
        if self.with_local and self.link.variant == "grid":
            modes.insert(1, "local")
        all_compute = (self.link.variant == "grid"
                       and self.link.bandwidth_mbps <= ALL_COMPUTE_MAX_MBPS)
        if all_compute:
            modes.append("hybrid_new")
        skip_stream = self._predicted_stream_s() > deadline
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(repeats):
            for m in modes[r % len(modes):] + modes[: r % len(modes)]:
                if m == "stream" and skip_stream:
                    continue
                runs[m].append(self._once(m, r))
        return self._summarize(modes, runs, skip_stream)

    def _once(self, mode: str, rep: int) -> dict[str, Any]:
        cfg = CacheConfig(cache_dir=self.root / f"dev-{self.tag}-{mode}-{rep}")
        h = (None if mode == "plain" else
             HybridLoader(self._client(rep), copy.deepcopy(self.cost),
                          strategy="hybrid" if mode == "hybrid_new" else mode))
        kv = EdgeKV(self.adapter, open_store(cfg), cfg, fill=h)
        try:
            if h is not None and mode != "hybrid_new":  # a device that keeps a session
                h.wait_ready(60)
            c0 = time.process_time()
            g = kv.generate(self.prompt, max_tokens=self.max_tokens, store=False,
                            approximate=False)
            cpu = time.process_time() - c0
            if h is None:
                return {"ttft_s": g.ttft_s, "cpu_s": cpu, "wire": 0, "stream_s": 0.0,
                        "same": self._same(g.first_logits, g.tokens)}
            h.wait_ready(60)
            r: HybridResult = g.fill_report
            return {"ttft_s": g.ttft_s, "cpu_s": cpu, "wire": r.wire_bytes,
                    "stream_s": r.stream_s, "same": self._same(g.first_logits, g.tokens),
                    "streamed": r.streamed_chunks, "computed": r.computed_chunks,
                    "replans": r.replans, "switched": r.switched, "fallback": r.fallback,
                    "executed": r.executed, "handed_back": r.handed_back,
                    "plan": "".join("S" if a == "stream" else "C" if a == "compute" else "L"
                                    for a in r.plan.actions) if r.plan else None,
                    "predicted_s": r.plan.ttft_s if r.plan else None,
                    "plan_ms": r.plan_s * 1000, "setup_ms": (h.setup_s or 0.0) * 1000,
                    "rtt_measured_ms": (h.rtt_measured_s or 0.0) * 1000,
                    "planner_rtt_ms": self.cost.rtt_s * 1000}
        finally:
            kv.close()

    def _same(self, logits: np.ndarray, tokens: tuple[int, ...]) -> bool:
        return bool(np.array_equal(logits, self.cold[0]) and tokens == self.cold[1])

    def _summarize(self, modes: list[str], runs: dict[str, list[dict[str, Any]]],
                   skip_stream: bool) -> dict[str, Any]:
        link = self.link
        measured = [x["rtt_measured_ms"] for m in modes for x in runs[m] if "rtt_measured_ms" in x]
        out: dict[str, Any] = {
            "bandwidth_mbps": link.bandwidth_mbps, "rtt_ms": link.rtt_ms, "variant": link.variant,
            "link": {"jitter_ms": link.jitter_ms, "loss": link.loss,
                     "prior_factor": link.prior_factor, "drop_to_mbps": link.drop_to_mbps,
                     "drop_after_bytes": (self.n_chunks * self.chunk_wire // 2
                                          if link.drop_to_mbps else None)},
            "rtt_configured_ms": link.rtt_ms,
            "rtt_measured_ms": round(statistics.median(self.rtts_ms + measured), 1),
            "planner_rtt_ms": round(self.cost.rtt_s * 1000, 1),
            "planner_bandwidth_mbps": round(self.cost.bandwidth_Bps * 8 / 1e6, 1),
            "ttft_ms": {}, "ttft_ms_median": {}, "ttft_spread": {}, "energy_j": {},
            "wire_bytes": {}, "chunks": {}, "predicted_ms": {}, "fidelity_by_mode": {}}
        same = []
        for m in modes:
            rs = runs[m]
            out["predicted_ms"][m] = None
            if not rs:
                out["ttft_ms"][m] = out["ttft_ms_median"][m] = None
                out["energy_j"][m] = out["wire_bytes"][m] = None
                out["predicted_ms"][m] = round(self._predicted_stream_s() * 1000, 1)
                continue
            sp = spread([x["ttft_s"] * 1000 for x in rs])
            out["ttft_ms"][m], out["ttft_ms_median"][m], out["ttft_spread"][m] = (
                sp["mean"], sp["median"], sp)
            out["energy_j"][m] = round(statistics.fmean(
                x["cpu_s"] * CPU_W_PER_BUSY_CORE + x["wire"] * RADIO_J_PER_BYTE
                + x["stream_s"] * RADIO_W_ACTIVE for x in rs), 3)
            out["wire_bytes"][m] = int(statistics.fmean(x["wire"] for x in rs))
            if m != "plain":
                out["chunks"][m] = {k: [x[k] for x in rs] for k in (
                    "streamed", "computed", "replans", "switched", "fallback", "executed",
                    "handed_back", "plan_ms", "setup_ms")}
            if m in ("hybrid", "hybrid_new") and rs[0]["plan"] is not None:
                out["predicted_ms"][m] = round(1000 * statistics.fmean(
                    x["predicted_s"] for x in rs), 1)
            if m == "hybrid":
                out["plan"] = rs[0]["plan"]
                out["plans"] = sorted({x["plan"] for x in rs})
                out["executed"] = [x["executed"] for x in rs]
            out["fidelity_by_mode"][m] = round(sum(x["same"] for x in rs) / len(rs), 3)
            same += [x["same"] for x in rs]
        out["fidelity"] = 1.0 if all(same) else round(sum(same) / len(same), 3)
        if skip_stream:
            out["stream_skipped"] = "predicted above the deadline"
        # per-repeat ratios (adjacent runs of the same repeat share the machine's state)
        for a, b in (("hybrid", "plain"), ("hybrid_new", "plain"), ("hybrid", "local")):
            if runs.get(a) and runs.get(b):
                ratios = [x["ttft_s"] / y["ttft_s"] for x, y in zip(runs[a], runs[b])]
                out.setdefault("ratios", {})[f"{a}/{b}"] = {
                    "median": round(statistics.median(ratios), 3),
                    "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
        return out


def _all_compute_summary(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where the hybrid planned all-compute: its TTFT against plain local compute."""
    out = []
    for p in points:
        if "hybrid_new" not in p["ttft_ms"] or p["ttft_ms"]["hybrid_new"] is None:
            continue
        out.append({"context_tokens": p["context_tokens"], "bandwidth_mbps": p["bandwidth_mbps"],
                    "rtt_ms": p["rtt_ms"], "plans": p.get("plans"),
                    "plain_ms": p["ttft_spread"]["plain"],
                    "hybrid_ms": p["ttft_spread"]["hybrid"],
                    "hybrid_new_ms": p["ttft_spread"]["hybrid_new"],
                    "ratios": p.get("ratios", {}),
                    "hybrid_plan_ms": p["chunks"]["hybrid"]["plan_ms"],
                    "hybrid_new_setup_ms": p["chunks"]["hybrid_new"]["setup_ms"]})
    return out


def _cell(p: dict[str, Any], m: str) -> str:
    """Mean [min-max] ± stdev, or the prediction where the run was skipped."""
    if m not in p["ttft_ms"]:
        return ""
    if p["ttft_ms"][m] is None:
        return f"(pred {p['predicted_ms'][m]:.0f})"
    s = p["ttft_spread"][m]
    return (f"{s['mean']:.0f} (med {s['median']:.0f}, {s['min']:.0f}-{s['max']:.0f}, "
            f"sd {s['stdev']:.0f})")


def stream_table(res: dict[str, Any]) -> str:
    rows = []
    with_local = any("local" in p["ttft_ms"] for p in res["points"])
    for p in res["points"]:
        t = p["ttft_ms"]
        best_pure = min(x for x in (t.get("local"), t.get("stream"),
                                    t.get("plain") or p.get("plain_ref_ms")) if x is not None)
        rows.append([p["context_tokens"], p.get("variant", "grid"), f"{p['bandwidth_mbps']:.4g}",
                     p["rtt_ms"], p.get("rtt_measured_ms", ""),
                     _cell(p, "plain") or f"(grid: {p.get('plain_ref_ms', 0):.0f})",
                     *([_cell(p, "local")] if with_local else []), _cell(p, "stream"),
                     _cell(p, "hybrid"),
                     "/".join(p.get("plans", [p.get("plan", "")])),
                     " ".join(sorted(set(p.get("executed", [])))),
                     f"{best_pure / t['hybrid']:.2f}x", p["fidelity"]])
    head = (f"TTFT ms over {res.get('repeats', 1)} repeats per mode ({res.get('order', '')}): "
            "mean (median, min-max, stdev). Setup: " + res.get("setup", SETUP_NOTE) + ".")
    cols = ["ctx", "link", "Mbit/s", "RTT ms", "RTT measured", "plain",
            *(["local"] if with_local else []), "stream", "hybrid", "plan", "executed",
            "hybrid vs best pure", "fidelity"]
    out = [head, "", table(cols, rows)]
    ac = res.get("all_compute_vs_local") or []
    if ac:
        rows2 = [[a["context_tokens"], a["bandwidth_mbps"], a["rtt_ms"], "/".join(a["plans"] or []),
                  f"{a['plain_ms']['mean']:.0f}", f"{a['hybrid_ms']['mean']:.0f}",
                  f"{a['hybrid_new_ms']['mean']:.0f}",
                  _ratio(a, "hybrid/plain"), _ratio(a, "hybrid_new/plain"),
                  f"{statistics.fmean(a['hybrid_plan_ms']):.2f}",
                  f"{statistics.fmean(a['hybrid_new_setup_ms']):.1f}"] for a in ac]
        out += ["", "All-compute plans against plain local compute (ratio: median over repeats "
                "of the per-repeat TTFT ratio [min-max]; hybrid_new: loader built just before "
                "the request, its server check still running in the background):", "",
                table(["ctx", "Mbit/s", "RTT ms", "plan", "plain ms", "hybrid ms",
                       "hybrid_new ms", "hybrid/plain", "hybrid_new/plain", "plan ms",
                       "setup ms (background)"], rows2)]
    return "\n".join(out)


def _ratio(a: dict[str, Any], key: str) -> str:
    r = a["ratios"].get(key)
    return f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]" if r else ""


def write_stream_plot(res: dict[str, Any], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [p for p in res["points"] if p.get("variant", "grid") == "grid"]
    keys = sorted({(p["context_tokens"], p["rtt_ms"]) for p in grid})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4), squeeze=False)
    for ax, (ctx, rtt) in zip(axes[0], keys):
        pts = sorted((p for p in grid if (p["context_tokens"], p["rtt_ms"]) == (ctx, rtt)),
                     key=lambda p: p["bandwidth_mbps"])
        for s, style in (("local", "o-"), ("stream", "s--"), ("hybrid", "^-")):
            sel = [p for p in pts if p["ttft_ms"].get(s) is not None]
            xs = [p["bandwidth_mbps"] for p in sel]
            ys = [p["ttft_ms"][s] for p in sel]
            if "ttft_spread" in (sel[0] if sel else {}):
                lo = [p["ttft_ms"][s] - p["ttft_spread"][s]["min"] for p in sel]
                hi = [p["ttft_spread"][s]["max"] - p["ttft_ms"][s] for p in sel]
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, label=s, capsize=3)
            else:
                ax.plot(xs, ys, style, label=s)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bandwidth (Mbit/s)")
        ax.set_ylabel("TTFT (ms), mean with min-max")
        ax.set_title(f"{ctx} tokens, RTT {rtt} ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    res = run_stream_bench(model=args.model, bandwidths=tuple(map(float, csv(args.bandwidths))),
                           rtts=tuple(map(float, csv(args.rtts))),
                           contexts=tuple(int(x) for x in csv(args.contexts)),
                           stream_deadline_s=args.stream_deadline,
                           repeats=max(args.runs, 5), n_threads=args.threads,
                           progress=progress)
    return res, stream_table(res)


def write_report(name: str, res: dict[str, Any], text: str, path: str | None) -> str:
    """The JSON, a Markdown page and the TTFT-vs-bandwidth plot beside it."""
    from .report import write_json

    out = write_json(path or f"bench-out/{name}.json", res)
    md = out.with_suffix(".md")
    png = write_stream_plot(res, out.with_suffix(".png"))
    md.write_text(
        f"# edgekv bench stream\n\n{text}\n\n(pred N): not run, predicted by the cost model "
        f"(above the {res['stream_deadline_s']:.0f} s deadline). Energy: "
        f"{res['energy_method']} (estimated).\n\n![TTFT vs bandwidth]({png.name})\n")
    return f"wrote {out}, {md} and {png}"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = bench_parser(sub, "stream", "local vs all-stream vs hybrid (SparKV) over a link "
                     "sweep", run_cli, write_report, runs=True,
                     threads="engine threads (default: all cores)")
    p.add_argument("--bandwidths", default="1,5,20,100,500", help="Mbit/s list")
    p.add_argument("--rtts", default="10,80", help="RTT ms list")
    p.add_argument("--contexts", default="512,1024", help="context token counts")
    p.add_argument("--stream-deadline", type=float, default=40.0,
                   help="all-stream runs predicted longer than this are not run (s)")
    return p
