"""How long a new user waits for a first answer: `edgekv generate "..."` on a fresh cache dir,
timed from the command to the process's exit (the answer is its last output), round by round,
alternating the code under test with another checkout of it (`--before SRC`, e.g. a git
worktree of an earlier commit, run with this venv). Between rounds it waits for a staged
start's background probe (`edgekv probe --finish`) to end, so no round shares the cores.

    .venv/bin/python scripts/first_answer.py --before /tmp/before/src --rounds 3 \\
        --json docs/bench/first-answer.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Why is the sky blue?"


def one_run(src: Path | None, cache: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("EDGEKV_FIRST_PROBE", None)  # each code's own default
    if src is not None:
        env["PYTHONPATH"] = str(src)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "edgekv", "generate", "--json",
                          "--cache-dir", str(cache), PROMPT],
                         capture_output=True, text=True, env=env, check=True, timeout=900)
    wall = time.perf_counter() - t0
    d = json.loads(out.stdout)
    return {"answer_s": round(wall, 2), "generated_tokens": len(d["tokens"]),
            "ttft_ms": d["ttft_ms"], "load_s": d.get("load_s"), "warmup_s": d.get("warmup_s"),
            "prompt_mode": d.get("prompt_mode", "raw"), "granularity": d.get("granularity"),
            "text": d["text"][:80]}


def wait_background(cache: Path, limit_s: float = 600) -> float:
    """Seconds until no `edgekv probe --finish` runs for `cache`."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        ps = subprocess.run(["pgrep", "-f", f"probe --finish.*{cache}"], capture_output=True)
        if ps.returncode != 0:
            break
        time.sleep(0.5)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", type=Path, help="src/ of the earlier code")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    before = (subprocess.run(["git", "-C", str(args.before), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
              if args.before else None)
    rows = []
    codes = [("before", args.before)] if args.before else []
    codes.append(("after", None))
    for r in range(args.rounds):
        for name, src in codes:
            cache = Path(tempfile.mkdtemp(prefix=f"first-{name}-"))
            try:
                row = {"round": r, "code": name, **one_run(src, cache)}
                row["background_probe_s"] = round(wait_background(cache), 1)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            print(json.dumps(row), flush=True)
            rows.append(row)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), platform.processor())
    summary = {}
    for name, _ in codes:
        times = sorted(x["answer_s"] for x in rows if x["code"] == name)
        summary[name] = {"answer_s_median": times[len(times) // 2], "answer_s": times}
    res = {"bench": "first-answer", "prompt": PROMPT, "commit": head, "before_commit": before,
           "machine": {"cpu": cpu, "cores": os.cpu_count()}, "rounds": args.rounds,
           "rows": rows, "summary": summary,
           "command": "scripts/first_answer.py" + (f" --before {args.before}" if args.before
                                                   else "") + f" --rounds {args.rounds}"}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1) + "\n")
    lines = [f"# First answer: `edgekv generate \"{PROMPT}\"` on a fresh cache dir", "",
             f"{cpu}, {os.cpu_count()} cores; commit {head}" +
             (f" against {before}" if before else "") + f"; `{res['command']}`", "",
             "| round | code | answer (s) | load (s) | warm-up (ms) | TTFT (ms) | tokens | "
             "prompt | granularity | background probe after (s) |", "|---" * 10 + "|"]
    for x in rows:
        warm = "" if x["warmup_s"] is None else f"{x['warmup_s'] * 1000:.0f}"
        lines.append(f"| {x['round']} | {x['code']} | {x['answer_s']} | {x['load_s'] or ''} | "
                     f"{warm} | {x['ttft_ms']} | {x['generated_tokens']} | {x['prompt_mode']} "
                     f"| {x['granularity'] or ''} | {x['background_probe_s']} |")
    args.json.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
