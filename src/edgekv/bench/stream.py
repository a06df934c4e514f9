"""`edgekv bench stream`: all-local vs all-stream vs hybrid over a bandwidth x RTT sweep.

A real KV server process on loopback holds the contexts' chunks (precomputed by its own
engine); the device shapes its side of the connection (`netem.Shaper`: bandwidth, RTT). At
every point each strategy starts from an empty device cache; the hybrid planner's network
estimate comes from one probe transfer at that point (as a device keeps measuring its link),
its prefill cost from a start-up calibration. An all-stream run predicted to exceed
`stream_deadline_s` is not run: its TTFT is then reported as null with the prediction beside
it, labelled as such. Energy is estimated (CPU time x power + received bytes x radio energy).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import EdgeKV
from ..config import CacheConfig
from ..energy import CPU_W_PER_BUSY_CORE
from ..store import open_store
from ..stream.client import KVClient
from ..stream.costmodel import RADIO_J_PER_BYTE, RADIO_W_ACTIVE, CostModel
from ..stream.hybrid import HybridLoader
from ..stream.netem import Shaper
from ..texts import MANUAL, SYSTEM_PROMPT
from .report import environment, table

__all__ = ["run_stream_bench", "stream_table"]


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


def run_stream_bench(*, model: str | None = None,
                     bandwidths: tuple[float, ...] = (1, 5, 20, 100, 500),
                     rtts: tuple[float, ...] = (10, 80), contexts: tuple[int, ...] = (512, 1024),
                     stream_deadline_s: float = 40.0, max_tokens: int = 8,
                     progress: Any = None) -> dict[str, Any]:
    from ..engines.llamacpp import LlamaCppAdapter

    tmp = tempfile.TemporaryDirectory(prefix="edgekv-stream-")
    root = Path(tmp.name)
    proc, url = _start_server(root / "server", model)
    secret = bytes.fromhex((root / "server" / "secret").read_text())
    adapter = LlamaCppAdapter(model, n_ctx=max(contexts) + 256, memo_dir=root)
    base_cost = CostModel()
    base_cost.calibrate(adapter, 128, positions=(0, 4))
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
        total = len(bandwidths) * len(rtts) * len(contexts)
        for bw in bandwidths:
            for rtt in rtts:
                for n, p in prompts.items():
                    point = _point(adapter, url, secret, p, colds[n], bw, rtt, base_cost,
                                   stream_deadline_s, max_tokens, root)
                    point["context_tokens"] = n
                    points.append(point)
                    if progress:
                        progress(len(points), total)
    finally:
        proc.kill()
        proc.wait()
        adapter.close()
        tmp.cleanup()
    return {"bench": "stream", "points": points, "stream_deadline_s": stream_deadline_s,
            "energy_source": "estimated",
            "energy_method": ("process CPU s x 3 W + received bytes x 100 nJ/B + seconds the "
                              "radio was receiving x 0.8 W"),
            "calibration": {"prefill_a_s": round(base_cost.prefill_a_s, 4),
                            "prefill_b_s": round(base_cost.prefill_b_s, 4)},
            "environment": environment()}


def _point(adapter: Any, url: str, secret: bytes, prompt: list[int], cold: tuple[Any, Any],
           bw: float, rtt: float, base_cost: CostModel, deadline: float, max_tokens: int,
           root: Path) -> dict[str, Any]:
    """One sweep point: a link probe, then local, stream and hybrid from empty caches."""
    out: dict[str, Any] = {"bandwidth_mbps": bw, "rtt_ms": rtt, "ttft_ms": {}, "energy_j": {},
                           "wire_bytes": {}, "chunks": {}, "predicted_ms": {}}
    same = []
    # one probe transfer per point: the link estimate a device keeps from recent traffic
    probe_cfg = CacheConfig(cache_dir=root / f"probe-{bw}-{rtt}-{len(prompt)}")
    probe_kv = EdgeKV(adapter, open_store(probe_cfg), probe_cfg)
    probe_client = KVClient(url, secret, timeout_s=60, shaper=Shaper(bandwidth_mbps=bw, rtt_ms=rtt))
    gen = probe_client.stream(probe_kv.chunk_keys(prompt)[:1])
    probe = next(gen)
    gen.close()
    probe_kv.close()
    link = copy.deepcopy(base_cost)
    link.observe_rtt(rtt / 1000)
    link.observe_transfer(probe.wire_bytes, max(1e-4, probe.at_s - rtt / 1000))
    link.observe_wire_ratio(probe.wire_bytes, probe.fragment.nbytes if probe.fragment else 1)
    for strategy in ("local", "stream", "hybrid"):
        cfg = CacheConfig(cache_dir=root / f"dev-{bw}-{rtt}-{len(prompt)}-{strategy}")
        kv = EdgeKV(adapter, open_store(cfg), cfg)
        cost = copy.deepcopy(link)
        client = KVClient(url, secret, timeout_s=30, shaper=Shaper(bandwidth_mbps=bw, rtt_ms=rtt))
        h = HybridLoader(kv, client, cost)
        n_chunks = (len(prompt) - 1) // 128
        predicted_stream = rtt / 1000 + n_chunks * probe.wire_bytes * 8 / (bw * 1e6)
        out["predicted_ms"][strategy] = None
        if strategy == "stream" and predicted_stream > deadline:
            out["ttft_ms"][strategy] = None
            out["energy_j"][strategy] = None
            out["wire_bytes"][strategy] = None
            out["predicted_ms"]["stream"] = round(predicted_stream * 1000, 1)
            kv.close()
            continue
        c0 = time.process_time()
        r = h.generate(prompt, max_tokens=max_tokens, strategy=strategy, store=False)
        cpu = time.process_time() - c0
        kv.close()
        out["ttft_ms"][strategy] = round(r.ttft_s * 1000, 1)
        out["energy_j"][strategy] = round(cpu * CPU_W_PER_BUSY_CORE
                                          + r.wire_bytes * RADIO_J_PER_BYTE
                                          + r.stream_s * RADIO_W_ACTIVE, 3)
        out["wire_bytes"][strategy] = r.wire_bytes
        out["chunks"][strategy] = {"streamed": r.streamed_chunks, "computed": r.computed_chunks,
                                   "replans": r.replans, "fallback": r.fallback}
        if strategy == "hybrid" and r.plan is not None:
            out["predicted_ms"]["hybrid"] = round(r.plan.ttft_s * 1000, 1)
            out["plan"] = "".join("S" if a == "stream" else "C" for a in r.plan.actions)
        same.append(bool(np.array_equal(r.first_logits, cold[0]) and r.tokens == cold[1]))
    out["fidelity"] = 1.0 if all(same) else round(sum(same) / len(same), 3)
    return out


def _ttft_cell(p: dict[str, Any], strategy: str) -> str:
    """A point's measured TTFT, or the cost model's prediction where the run was skipped."""
    v = p["ttft_ms"][strategy]
    return f"{v:.0f}" if v is not None else f"(pred {p['predicted_ms'][strategy]:.0f})"


def stream_table(res: dict[str, Any]) -> str:
    rows = []
    for p in res["points"]:
        t = p["ttft_ms"]
        best_pure = min(x for x in (t["local"], t["stream"]) if x is not None)
        rows.append([p["context_tokens"], p["bandwidth_mbps"], p["rtt_ms"],
                     _ttft_cell(p, "local"), _ttft_cell(p, "stream"), _ttft_cell(p, "hybrid"),
                     p.get("plan", ""), f"{best_pure / t['hybrid']:.2f}x", p["fidelity"]])
    return table(["ctx", "Mbit/s", "RTT ms", "local ms", "stream ms", "hybrid ms", "plan",
                  "hybrid vs best pure", "fidelity"], rows)


def write_stream_plot(res: dict[str, Any], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(p["context_tokens"], p["rtt_ms"]) for p in res["points"]})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4), squeeze=False)
    for ax, (ctx, rtt) in zip(axes[0], keys):
        pts = sorted((p for p in res["points"] if (p["context_tokens"], p["rtt_ms"]) == (ctx, rtt)),
                     key=lambda p: p["bandwidth_mbps"])
        for s, style in (("local", "o-"), ("stream", "s--"), ("hybrid", "^-")):
            xs = [p["bandwidth_mbps"] for p in pts if p["ttft_ms"][s] is not None]
            ys = [p["ttft_ms"][s] for p in pts if p["ttft_ms"][s] is not None]
            ax.plot(xs, ys, style, label=s)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bandwidth (Mbit/s)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{ctx} tokens, RTT {rtt} ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
