"""The seed benchmark's report: a terminal table, Markdown and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import table

__all__ = ["seed_table", "write_seed_report"]

LABELS = {"plain": "llama-cpp plain", "nocache": "no cache", "string": "string cache",
          "llama_ram_cache": "LlamaRAMCache", "state_seq": "state_seq peer (50 lines)",
          "llama_server": "llama-server prompt cache",
          "llama_server_nocache": "llama-server --no-cache-prompt",
          "edgekv_strict": "EdgeKV strict",
          "edgekv_chunk": "EdgeKV whole chunks",
          "edgekv_approx": "EdgeKV approx"}


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def seed_table(res: dict[str, Any]) -> str:
    """One row per mode. `fidelity` is against the mode's own cache-off run, `vs plain`
    against plain llama-cpp-python (see the results' `fidelity_reference`)."""
    refs = res.get("fidelity_reference", {}).get("by_mode", {})
    rows = []
    for name, m in res["modes"].items():
        reused, computed = m["reused_tokens"], m["computed_tokens"]
        fid = _share(m["fidelity"])
        rows.append([
            LABELS.get(name, name), f"{m['ttft_ms_mean']:.0f}", f"{m['ttft_ms_p50']:.0f}",
            f"{m['ttft_ms_p95']:.0f}", f"{m['ttft_speedup_vs_nocache']:.2f}x",
            f"{m['total_ms_mean']:.0f}" if "total_ms_mean" in m else "-",
            f"{100 * m['hit_rate']:.1f}%", f"{reused}/{reused + computed}",
            f"{fid} ({refs[name]})" if name in refs else fid,
            _share(m.get("fidelity_vs_plain")), f"{100 * m['memory_traffic_ratio']:.1f}%",
            f"{m['energy_j']:.1f} J / {m['energy_mah']:.3f} mAh ({m['energy_source']})"
            if m["energy_j"] is not None else "not measured (server process)",
        ])
    return table(["mode", "TTFT mean ms", "p50", "p95", "vs no cache", "total ms",
                  "hit rate", "reused/prompt tokens", "fidelity (vs)", "vs plain",
                  "mem traffic", "energy"], rows) + "\n\n" + breakdown_table(res)


def breakdown_table(res: dict[str, Any]) -> str:
    """Where each mode's time to the first token went (mean ms per request), and the saving
    after it: lookup, load (a llama state or the KV inject), eval (prefill + first token)."""
    rows = [[LABELS.get(n, n), *(f"{b[k]:.1f}" for k in ("lookup", "load", "eval", "save"))]
            for n, m in res["modes"].items() if (b := m.get("ttft_breakdown_ms"))]
    return table(["mode", "lookup ms", "load ms", "eval ms", "save ms (after TTFT)"], rows)


def _plots(res: dict[str, Any], out: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["modes"])
    labels = [LABELS.get(n, n) for n in names]
    files = []

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.boxplot([res["modes"][n]["ttft_ms"] for n in names], showfliers=True)
    ax.set_xticks(range(1, len(names) + 1), labels, rotation=15)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title(f"TTFT per mode, {res['requests']} requests, {res['model']}")
    fig.tight_layout()
    files.append(f"{stem}-ttft.png")
    fig.savefig(out / files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    tiers = ["exact", "partial", "miss"]
    x = range(len(tiers))
    shown = [n for n in ("edgekv_strict", "edgekv_approx") if n in res["modes"]]
    for k, n in enumerate(shown):
        by = res["modes"][n]["hit_rate_by_tier"]
        ax.bar([i + 0.38 * k for i in x], [100 * by.get(t, {}).get("share", 0) for t in tiers],
               width=0.36, label=f"{LABELS[n]}: share of requests")
        for i, t in enumerate(tiers):
            if t in by:
                ax.text(i + 0.38 * k, 100 * by[t]["share"] + 1,
                        f"hit {100 * by[t]['hit_rate']:.0f}%", ha="center", fontsize=8)
    ax.set_xticks([i + 0.19 for i in x], tiers)
    ax.set_ylabel("% of requests routed to tier")
    ax.set_title("Semantic tier of each request (and KV reuse hit rate within it)")
    ax.legend()
    fig.tight_layout()
    files.append(f"{stem}-tiers.png")
    fig.savefig(out / files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    reused = [res["modes"][n]["reused_tokens"] for n in names]
    computed = [res["modes"][n]["computed_tokens"] for n in names]
    ax.bar(labels, reused, label="reused (KV restored / answer cached)")
    ax.bar(labels, computed, bottom=reused, label="computed (prefill)")
    ax.set_ylabel("prompt tokens over the run")
    ax.set_title("Reused vs computed prompt tokens")
    ax.tick_params(axis="x", rotation=15)
    ax.legend()
    fig.tight_layout()
    files.append(f"{stem}-tokens.png")
    fig.savefig(out / files[-1], dpi=110)
    plt.close(fig)
    return files


def write_seed_report(res: dict[str, Any], md_path: Path) -> Path:
    out = md_path.parent
    out.mkdir(parents=True, exist_ok=True)
    pngs = _plots(res, out, md_path.stem)
    seed_mode = {"nocache": "~1800 ms, 253 mAh", "string": "~1600 ms, 12% hits, 222 mAh",
                 "edgekv_strict": "~350 ms, 70% hits, 88 mAh"}
    lines = [
        f"# EdgeKV seed benchmark: {res['requests']} requests",
        "",
        f"Model {res['model']}; {res['clusters']} clusters, {res['unique_prompts']} distinct "
        f"prompts; first {res['max_tokens']} greedy tokens compared with the no-cache run "
        f"(fidelity). Reuse granularity: "
        f"{res.get('reuse_granularity', {}).get('edgekv_strict', 'chunk')} "
        f"({res.get('reuse_granularity', {}).get('reason', 'not recorded')}). "
        f"Machine: {res['environment']['cpu_count']} CPUs, "
        f"{res['environment']['machine']}; run took {res['wall_s']} s; "
        f"{res['environment']['timestamp']}.",
        "",
        seed_table(res),
        "",
        f"Energy is **{res['energy_source']}** ({res['energy_method']}). Memory traffic: "
        f"{res['memory_traffic_model']}",
        "",
        "Seed's figures for comparison (from its model, not a device): " + "; ".join(
            f"{LABELS[k]} {v}" for k, v in seed_mode.items()) + ".",
        "",
        "## Tiers (EdgeKV)",
        "",
    ]
    for n in (n for n in ("edgekv_strict", "edgekv_approx") if n in res["modes"]):
        m = res["modes"][n]
        lines.append(f"- {LABELS[n]}: " + ", ".join(
            f"{t}: {100 * v['share']:.1f}% of requests, KV hit {100 * v['hit_rate']:.1f}%"
            for t, v in m["hit_rate_by_tier"].items())
            + f"; approximate injections: {m['approximate_requests']}")
    pf = res["modes"].get("edgekv_strict", {}).get("prefetch")
    if pf:
        lines += ["", f"N-gram prefetch (strict mode, top-3 contexts warmed into RAM in the "
                      f"background): {100 * pf['hit_rate']:.1f}% of {pf['predicted']} predicted "
                      f"requests hit, {pf['warmed_fragments']} fragment reads."]
    lines += ["", *[f"![{p}]({p})" for p in pngs], ""]
    md_path.write_text("\n".join(lines))
    return md_path
