"""Every switch of `edgekv serve`, end to end with the openai SDK (issue 21's evidence).

    .venv/bin/python scripts/pipeline_demo.py [--contexts 3] [--out docs/bench/pipeline]

Real processes on loopback, each with a fresh cache directory and whole-chunk reuse (no
batch-invariance probe at start; reuse then equals EdgeKV's own chunk-aligned cold run):

- one `edgekv kv-server` (SparKV's server, its own engine);
- device A: `serve --kv-server URL --kv-link FAST --semantic --prefetch`;
- devices B (`--kv-link FAST`) and C (`--kv-link SLOW`): `serve --kv-server URL`, the same
  kv-server, caches of their own;
- L: `serve` with local prefill only; R: `serve --no-cache`, the reference;
- D: `serve --passage-reuse` (the `documents` field), and D0, the same, each request under a
  new `cache_salt` (a tenant of its own: nothing reused), the documents' cold reference.

For each of `--contexts` long prompts (a ~1,000-token manual, made distinct at its start):
A answers first (nothing on the server: it computes, then publishes: the kv-server
precomputes the prompt in the background), then B and C (their chunks stream from what A's
request made the server hold, or are computed, as the cost model plans), L and R. Each
answer is compared with R's. A answers every prompt a second time (its own cache) and once
with another question (semantic tiers). D and D0 answer questions over documents taken from
the manual's sections; D twice per question (second time: passages placed from its cache).
Client TTFT is the first streamed content chunk, seen by the openai SDK. Written to OUT.json
and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from serve_demo import launch, stop, wait_healthy  # noqa: E402

from edgekv_bench.markdown import table  # noqa: E402
from edgekv_bench.texts import MANUAL, QUESTIONS, SYSTEM_PROMPT  # noqa: E402

FAST, SLOW = "100,10", "2,80"  # Mbit/s, RTT ms (in-process shaping: `--kv-link`)
ENV = {"EDGEKV_REUSE_GRANULARITY": "chunk"}
MAX_TOKENS = 24


def sections() -> list[str]:
    """The manual's numbered sections: the documents of the RAG questions."""
    return [s.strip() for s in MANUAL.split("\n\n") if s.strip()[:2].rstrip(".").isdigit()]


def context(i: int) -> str:
    return f"Manual copy {i} of the device library.\n\n{SYSTEM_PROMPT}\n\n{MANUAL}"


def ask(url: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    """One streamed chat request through the openai SDK: text, client TTFT, edgekv object."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    ttft, parts, info = None, [], None
    for chunk in client.chat.completions.create(
            model="default", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, extra_body=extra or None):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        info = (chunk.model_extra or {}).get("edgekv", info)
    return {"text": "".join(parts), "ttft_ms": round((ttft or 0.0) * 1000, 1), "edgekv": info}


def metrics(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name.startswith(("edgekv_route_tier", "edgekv_prefetch", "edgekv_kv_",
                                  "edgekv_streamed", "edgekv_computed")):
                label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


def wait_published(url: str, n: int, timeout: float = 300.0) -> float:
    """Seconds until device `url` has published `n` prompts to the kv-server."""
    t0 = time.monotonic()
    while metrics(url).get("edgekv_kv_published_total", 0.0) < n:
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"{url} did not publish {n} prompts within {timeout:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - t0


def run(work: Path, contexts: int) -> dict[str, Any]:
    secret = work / "kv.secret"
    procs: dict[str, Any] = {}
    try:
        procs["kv"] = launch(["kv-server", "--port", "0", "--cache-dir", str(work / "kv"),
                              "--secret-file", str(secret)], ENV, work / "kv.log")
        kv_url = procs["kv"][1]
        kv = ["--kv-server", kv_url, "--kv-secret-file", str(secret)]
        servers = {
            "A": [*kv, "--kv-link", FAST, "--semantic", "--prefetch"],
            "B": [*kv, "--kv-link", FAST],
            "C": [*kv, "--kv-link", SLOW],
            "L": [], "R": ["--no-cache"], "D": ["--passage-reuse"], "D0": ["--passage-reuse"]}
        for name, extra in servers.items():
            procs[name] = launch(["serve", "--port", "0", "--cache-dir", str(work / name),
                                  *extra], ENV, work / f"{name}.log")
        for name in servers:
            wait_healthy(*procs[name])
        url = {name: procs[name][1] for name in servers}
        rows, second = [], []
        for i in range(contexts):
            msgs = [{"role": "system", "content": context(i)},
                    {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            row: dict[str, Any] = {"context": i, "A": ask(url["A"], msgs)}
            row["publish_wait_s"] = round(wait_published(url["A"], i + 1), 2)
            for name in ("B", "C", "L", "R"):
                row[name] = ask(url[name], msgs)
            row["same_as_R"] = {n: row[n]["text"] == row["R"]["text"] for n in "ABCL"}
            rows.append(row)
            again = ask(url["A"], msgs)
            again["same_as_R"] = again["text"] == row["R"]["text"]
            second.append(again)
        other = ask(url["A"], [{"role": "system", "content": context(0)},
                               {"role": "user", "content": QUESTIONS[-1]}])
        docs = sections()
        rag = []
        for q in range(min(4, len(QUESTIONS))):
            chosen = [docs[(q + k) % len(docs)] for k in range(3)]
            msgs = [{"role": "user", "content": QUESTIONS[q]}]
            cold = ask(url["D0"], msgs, documents=chosen, cache_salt=f"cold-{q}")
            first = ask(url["D"], msgs, documents=chosen)
            warm = ask(url["D"], msgs, documents=chosen[::-1][:1] + chosen[:2])
            warm_same = ask(url["D"], msgs, documents=chosen)
            rag.append({"question": q, "cold": cold, "first": first, "reordered": warm,
                        "repeat": warm_same,
                        "first_token_same": {
                            k: r["text"].split()[:1] == cold["text"].split()[:1]
                            for k, r in (("first", first), ("repeat", warm_same))},
                        "same_text": {k: r["text"] == cold["text"]
                                      for k, r in (("first", first), ("repeat", warm_same))}})
        return {"contexts": rows, "second_round_A": second, "other_question_A": other,
                "documents": rag, "metrics": {n: metrics(url[n]) for n in ("A", "B", "C")},
                "links": {"fast": FAST, "slow": SLOW}, "max_tokens": MAX_TOKENS}
    finally:
        for proc, _ in procs.values():
            stop(proc)


def summary(res: dict[str, Any]) -> dict[str, Any]:
    rows = res["contexts"]

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 1) if xs else 0.0

    out: dict[str, Any] = {}
    for n in "ABCL":
        out[n] = {"ttft_ms_mean": mean([r[n]["ttft_ms"] for r in rows]),
                  "streamed_tokens": sum(r[n]["edgekv"]["streamed_tokens"] for r in rows),
                  "computed_tokens": sum(r[n]["edgekv"]["computed_tokens"] for r in rows),
                  "same_as_R": sum(r["same_as_R"][n] for r in rows)}
    out["R"] = {"ttft_ms_mean": mean([r["R"]["ttft_ms"] for r in rows])}
    out["A_second_round"] = {
        "ttft_ms_mean": mean([r["ttft_ms"] for r in res["second_round_A"]]),
        "cached_tokens": sum(r["edgekv"]["cached_tokens"] for r in res["second_round_A"]),
        "tiers": [r["edgekv"]["tier"] for r in res["second_round_A"]],
        "same_as_R": sum(r["same_as_R"] for r in res["second_round_A"])}
    out["A_other_question_tier"] = res["other_question_A"]["edgekv"]["tier"]
    d = res["documents"]
    out["documents"] = {
        "cold_ttft_ms_mean": mean([r["cold"]["ttft_ms"] for r in d]),
        "repeat_ttft_ms_mean": mean([r["repeat"]["ttft_ms"] for r in d]),
        "reordered_ttft_ms_mean": mean([r["reordered"]["ttft_ms"] for r in d]),
        "repeat_reused_tokens": sum((r["repeat"]["edgekv"]["passages"] or {}).get(
            "reused_tokens", 0) for r in d),
        "first_token_same_repeat": sum(r["first_token_same"]["repeat"] for r in d),
        "same_text_repeat": sum(r["same_text"]["repeat"] for r in d),
        "requests": len(d)}
    local = out["L"]["ttft_ms_mean"]
    out["ttft_vs_local_prefill"] = {  # side by side in one run: read these, not the ms
        n: round(out[n]["ttft_ms_mean"] / local, 2) for n in ("A", "B", "C", "R")}
    out["ttft_vs_local_prefill"]["A_second_round"] = round(
        out["A_second_round"]["ttft_ms_mean"] / local, 3)
    out["documents"]["repeat_vs_cold"] = round(
        out["documents"]["repeat_ttft_ms_mean"] / out["documents"]["cold_ttft_ms_mean"], 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, default=3)
    ap.add_argument("--out", default="docs/bench/pipeline")
    ap.add_argument("--summarize", metavar="JSON",
                    help="recompute the summary and tables of a run's JSON (no new run)")
    args = ap.parse_args()
    if args.summarize:
        res = json.loads(Path(args.summarize).read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="edgekv-pipeline-") as tmp:
            res = run(Path(tmp), args.contexts)
        res["machine"] = {"cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M")}
    res["summary"] = s = summary(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    n = len(res["contexts"])
    lines = ["# serve's switches end to end (scripts/pipeline_demo.py)", "",
             table(["device", "switches", "TTFT mean ms", "streamed", "computed",
                    f"= --no-cache (of {n})"],
                   [[k, w, s[k]["ttft_ms_mean"], s[k].get("streamed_tokens", "-"),
                     s[k].get("computed_tokens", "-"), s[k].get("same_as_R", "-")]
                    for k, w in (("A", f"--kv-server (first: server empty) --kv-link {FAST} "
                                       "--semantic --prefetch"),
                                 ("B", f"--kv-server --kv-link {FAST}"),
                                 ("C", f"--kv-server --kv-link {SLOW}"),
                                 ("L", "local prefill"), ("R", "--no-cache"))]),
             "", f"TTFT / local prefill's: {s['ttft_vs_local_prefill']}",
             f"A again: {s['A_second_round']}", f"A other question tier: "
             f"{s['A_other_question_tier']}", f"documents: {s['documents']}"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
