"""What verifying drafts costs on EdgeKV's engine: the time of one batch of n tokens after a
256-token prompt (`LlamaCppAdapter.verify`, logits at every position) against one decode step,
best of `--runs`. Speculative decoding gains only where the tokens a batch emits (1 + the
accepted drafts) outnumber its cost in decode steps; `engines/spec.DraftPolicy` chooses the
draft length from these same measurements, made while serving.

    .venv/bin/python scripts/verify_cost.py --json docs/bench/spec-verify-cost.json
"""

from __future__ import annotations

import argparse
import platform
import time

from edgekv.engines.llamacpp import LlamaCppAdapter
from edgekv.engines.models import default_model_path, resolve_model
from edgekv.engines.probe import probe_tokens
from edgekv_bench.report import environment, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    path = resolve_model(args.model) if args.model else default_model_path()
    a = LlamaCppAdapter(path, n_ctx=2048)
    toks = probe_tokens(a, 300)
    rows = []
    try:
        for n in (1, 2, 3, 4, 6, 8, 12, 16):
            best = float("inf")
            for _ in range(args.runs):
                a.clear_kv_cache()
                a.prefill(toks[:256], align=a.n_ctx)
                t = time.perf_counter()
                if n == 1:
                    a.prefill(toks[256:257], align=1)
                else:
                    a.verify(toks[256 : 256 + n])
                best = min(best, time.perf_counter() - t)
            rows.append({"tokens": n, "ms": round(best * 1000, 3)})
    finally:
        flash, invariant, build = a.flash_attn, a.batch_invariant, a.build_info()
        a.close()
    step = rows[0]["ms"]
    for r in rows:
        r["decode_steps"] = round(r["ms"] / step, 3)
    write_json(args.json, {"bench": "spec-verify-cost", "model": path.name,
                           "cpu": platform.processor() or platform.machine(),
                           "flash_attn": flash, "batch_invariant_kernels": invariant,
                           "build": build, "environment": environment(), "rows": rows})
    for r in rows:
        print(f"{r['tokens']:3d} tokens: {r['ms']:8.2f} ms = {r['decode_steps']:.2f} decode steps")


if __name__ == "__main__":
    main()
