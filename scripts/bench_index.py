"""docs/bench/README.md: every JSON of docs/bench, the command that made it, the commit it was
committed in, the machine it ran on. Made from the files and git, never by hand:

    python scripts/bench_index.py [--check]

`--check` exits 1 where the README on disk is not what the files make (tests/test_bench_index.py
runs it). The commit is the last one that changed the file's content (`git log --follow`,
renames skipped); a JSON that records its own (`commit`, `environment.commit`) says it too.
The machine is what the JSON recorded (`environment`: CPU model and widest vector extension,
cores), or "not recorded". The command is the one the JSON recorded (`command`,
`environment.argv`), else the one that writes such a file (`COMMANDS`, by file name)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "bench"
BENCHES = ("reuse", "lookup", "seed", "stream", "engines", "codec", "serve", "rag", "kernels",
           "pressure", "spec", "faults", "fuzz")
# files no `edgekv bench NAME` writes: the script or test that does
COMMANDS = {
    "agent": "python scripts/agent_demo.py",
    "evict": "python scripts/evict_bench.py", "evict-before": "python scripts/evict_bench.py",
    "first-answer": "python scripts/first_answer.py",
    "pipeline": "python scripts/pipeline_demo.py",
    "shape": "pytest tests/test_shape.py (scripts/shape.py --json)",
    "slots-step": "python scripts/slots_step_bench.py",
    "spec-verify-cost-avx2": "python scripts/verify_cost.py",
    "ui-browser": "pytest tests/serve/test_browser.py",
    "window-bytes": "python scripts/window_bytes.py",
    "chat": "edgekv bench seed --workload chat",
    "probe": "edgekv probe --json",
    "arm-probe": "scripts/arm_check.sh",
    "kernel-check-x86-avx2": "probe/edgekv_kernels --invariant 1 --threads 1,2 --json "
                             "(probe/build.sh)",
}

# A file beside another run of the same bench (the `bench` its JSON records, else the command
# that wrote it) stands for another engine, model or workload, or is one arm of an experiment
# whose arms ran side by side in one sitting (before/after, two models, the builds of one
# matrix); any earlier run, on this machine kind or another, lives in git history, not here.
# What each file is:
AVX2 = "AMD EPYC with AVX2 only"
_WORKLOADS = ("one experiment (workloads/README.md): four workloads in one sitting, one thread for "
              "every system, llama-server and the state_seq peer beside them; this arm: ")
_PROBES = ("one experiment, the build matrix of 2026-11-30 (docs/batch-invariance.md): one "
           "sitting, an AMD EPYC with AVX512, before the patch series; this arm: ")
CONDITIONS = {
    "serve-concurrency-avx2.json": "bench serve --concurrency (docs at 4, 8 and 16 clients: "
                                   "edgekv, its step budget off, stock llama-server, each with "
                                   f"its cache-off run) on an {AVX2}",
    "serve-concurrency.json": "bench serve --concurrency 1,2,4,8,16 --rate knee (gsp, "
                              "multiround, chat and docs: edgekv and stock llama-server, each "
                              "with its cache-off run, one sitting) on an AMD EPYC Zen 4 with "
                              "AVX512; docs without its rate runs (the JSON's `incomplete`)",
    "spec-verify-cost-avx2.json": f"scripts/verify_cost.py on an {AVX2}, patches to 0012: what "
                                  "a verification batch costs, and the drafter's ceiling on "
                                  "bench spec's prompts (`--ceiling`)",
    "kernels.json": f"{AVX2}: SmolLM2 Q4_1, Q8_0, Q5_K_M, IQ4_XS and Gemma 3 Q4_K_M, 7 "
                    "interleaved rounds, patches to 0012",
    "kernel-check-x86-avx2.json": f"{AVX2}, EdgeKV's kernels (the switch on), patches to 0012",
    "reuse-onnx.json": "another engine: ONNX Runtime",
    "gemma/reuse.json": "another model: Gemma 3 270M; one experiment with "
                        "gemma/reuse-smollm2.json (the two models side by side in one sitting)",
    "gemma/reuse-smollm2.json": "SmolLM2, the other arm of gemma/reuse.json (one sitting, the "
                                "same settings)",
    "gemma/seed.json": "another model: Gemma 3 270M",
    "gemma/probe.json": "another model: Gemma 3 270M (EdgeKV's build before the series)",
    "evict-before.json": "before the candidate heap: one experiment with evict.json (the same "
                         "100,000 chunks, the same survivors)",
    "evict.json": "after the candidate heap: the other arm of evict-before.json",
    "chat.json": "another workload of bench seed: chat (60 requests)",
    "workloads/chat.json": _WORKLOADS + "chat, 20 requests",
    "workloads/rag.json": _WORKLOADS + "rag, 12 requests",
    "workloads/header.json": _WORKLOADS + "header, 12 requests",
    "workloads/seed.json": _WORKLOADS + "seed, 12 requests",
    **{f"probe/{b}-fa{fa}.json": f"{_PROBES}build `{b}`, flash attention {('off', 'on')[fa]}"
       for b in ("avx2", "avx512", "nollamafile", "norepack", "wheel") for fa in (0, 1)},
    "probe/final-fa0.json": _PROBES + "build `final` (the build chosen then), flash attention "
                            "off",
}


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=False).stdout.strip()


def _command(rel: Path, data: dict[str, Any]) -> str:
    if isinstance(data.get("command"), str):
        return data["command"]
    argv = (data.get("environment") or {}).get("argv")
    if argv and len(argv) > 1 and "bench" in argv:
        return "edgekv " + " ".join(argv[argv.index("bench"):])
    if argv and str(argv[0]).endswith(".py"):  # a script of scripts/ (verify_cost.py, ...)
        return "python " + " ".join(argv)
    stem = rel.stem
    if rel.parent.name == "probe":
        return COMMANDS["probe"]
    if rel.parent.name == "workloads":  # bench seed on each workload (workloads/README.md)
        return f"edgekv bench seed --workload {stem}"
    if stem in COMMANDS:
        return COMMANDS[stem]
    name = next((b for b in BENCHES if stem == b or stem.startswith(b + "-")), None)
    return f"edgekv bench {name}" if name else "not recorded"


def _machine(data: dict[str, Any]) -> str:
    env = data.get("environment") if isinstance(data.get("environment"), dict) else {}
    cpu = env.get("cpu") or (data.get("machine") if isinstance(data.get("machine"), str)
                             else None)
    if cpu is None and env.get("machine"):
        cpu = f"{env['machine']}, model not recorded"
    cores = env.get("cpu_count")
    return (cpu or "not recorded") + (f", {cores} cores" if cores else "")


def rows() -> list[tuple[str, str, str, str]]:
    out = []
    for f in sorted(DOCS.rglob("*.json")):
        rel = f.relative_to(DOCS)
        try:
            data = json.loads(f.read_text())
        except ValueError:
            data = {}
        data = data if isinstance(data, dict) else {}
        inside = ROOT in f.parents
        commit = inside and _git("log", "--follow", "--diff-filter=AM", "-1",
                                 "--format=%h %ad", "--date=short", "--",
                                 str(f.relative_to(ROOT))) or "not committed"
        own = data.get("commit") or (data.get("environment") or {}).get("commit")
        if isinstance(own, str) and not commit.startswith(own[:7]):
            commit += f" (ran on {own[:12]})"
        machine = _machine(data)
        cond = CONDITIONS.get(rel.as_posix())
        out.append((rel.as_posix(), _command(rel, data), commit,
                    f"{machine}; {cond}" if cond else machine))
    return out


def render() -> str:
    lines = [
        "# docs/bench: one current JSON per bench (per condition or experiment arm)",
        "",
        "Made by `python scripts/bench_index.py` from the files and git; older runs live in "
        "git history. *Commit* is the last commit that changed the file (the code it ran on "
        "is that commit's, or the one it names); *machine* is what the JSON recorded, and, where "
        "another run of the same bench sits beside it, the condition it stands for.",
        "",
        "| file | command | commit | machine; condition |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{f}` | `{c}` | {g} | {m} |" for f, c, g, m in rows()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    a = p.parse_args(argv)
    text, path = render(), DOCS / "README.md"
    if a.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is stale: run python scripts/bench_index.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path} ({text.count(chr(10)) - 6} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
