"""What verifying drafts costs on EdgeKV's engine, and what n-gram drafts could buy at that cost.

1. The cost: the time of one batch of n tokens after a 256-token prompt
   (`LlamaCppAdapter.verify`, logits at every position) against one decode step: the median
   of `--runs` rounds, each round timing every size once (interleaved, so a burst of load on
   the shared machine moves one round, not one size's figure), the fastest round beside it.
   Speculative decoding gains only where the tokens a batch emits (1 + the accepted drafts)
   outnumber its cost in decode steps; `engines/spec.DraftPolicy` chooses the draft length
   from these same measurements, made while serving.
2. The ceiling (`--ceiling`): the greedy answers of `edgekv bench spec`'s fixed prompt sets
   (plain decoding, the library's own), replayed through EdgeKV's drafter
   (`spec.NGramDrafter`, the server's settings). At each step the drafter proposes what it would
   have proposed there, and the answer says how many of those drafts the model would have
   accepted. Greedy speculation is exact, so that replay is what a speculative run would do.
   It is priced with the costs of part 1 for every fixed draft length k, and for an oracle that
   knows each step's acceptance in advance (it drafts exactly the tokens that will be accepted,
   and nothing where none will be). The oracle bounds every draft-length policy over this
   drafter on this engine: decode steps saved can come only from the drafts it proposes.

    .venv/bin/python scripts/verify_cost.py --ceiling --json docs/bench/spec-verify-cost-avx2.json

One current file in docs/bench (docs/bench/README.md): `spec-verify-cost-avx2.json`, the
AVX2-only kind's; the earlier Zen 4 run is in git history
(`git show 31f77bb:docs/bench/spec-verify-cost.json`).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

from edgekv.engines.llamacpp import LlamaCppAdapter
from edgekv.engines.models import default_model_path, resolve_model
from edgekv.engines.probe import probe_tokens
from edgekv.engines.spec import NGramDrafter, SpecConfig
from edgekv_bench.report import environment, write_json

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16)


def costs(a: LlamaCppAdapter, runs: int) -> list[dict[str, float]]:
    """The median and the fastest of `runs` interleaved rounds, per batch size in `SIZES`,
    in ms and in decode steps (the median's)."""
    toks = probe_tokens(a, 300)
    times: dict[int, list[float]] = {n: [] for n in SIZES}
    for _ in range(runs):
        for n in SIZES:
            a.clear_kv_cache()
            a.prefill(toks[:256], align=a.n_ctx)
            t = time.perf_counter()
            if n == 1:
                a.prefill(toks[256:257], align=1)
            else:
                a.verify(toks[256 : 256 + n])
            times[n].append(time.perf_counter() - t)
    rows = [{"tokens": n, "ms": round(statistics.median(ts) * 1000, 3),
             "ms_min": round(min(ts) * 1000, 3)} for n, ts in times.items()]
    step = rows[0]["ms"]
    for r in rows:
        r["decode_steps"] = round(r["ms"] / step, 3)
    return rows


def replay(prompt: Sequence[int], answer: Sequence[int], k: int | None,
           cost: dict[int, float], config: SpecConfig) -> dict[str, float]:
    """Speculative greedy decoding of `answer` after `prompt`, replayed: drafts of up to `k`
    tokens (None: the oracle's, cut to the ones accepted), in decode steps of `cost`."""
    drafter = NGramDrafter(prompt, config)
    pos = steps = drafted = accepted = 0
    spent = 0.0
    while pos < len(answer):
        draft = drafter.propose(config.k_max if k is None else k)
        hit = 0
        while hit < len(draft) and pos + hit < len(answer) and draft[hit] == answer[pos + hit]:
            hit += 1
        if k is None:
            draft = draft[:hit]
        emit = min(hit + 1, len(answer) - pos)  # the accepted drafts and the model's own token
        spent += cost[len(draft) + 1]
        steps += 1
        drafted += len(draft)
        accepted += hit
        drafter.extend(answer[pos : pos + emit])
        pos += emit
    return {"tokens": len(answer), "steps": steps, "decode_steps": spent,
            "drafted": drafted, "accepted": accepted}


def ceiling(a: LlamaCppAdapter, cost_rows: Sequence[dict[str, float]]) -> dict[str, Any]:
    """The bench spec prompts' greedy answers replayed at every draft length (module doc)."""
    from edgekv.chat import render_chat
    from edgekv_bench.spec import loops
    from edgekv_bench.spec_prompts import (
        CHAT_CONVERSATIONS,
        CHAT_SYSTEM,
        MAX_TOKENS,
        WORKLOADS,
        single_turn_prompts,
    )

    config = SpecConfig()
    cost = {int(r["tokens"]): float(r["decode_steps"]) for r in cost_rows}
    ks: list[int | None] = [k for k in range(1, config.k_max + 1) if k + 1 in cost]
    ks.append(None)
    template = a.chat_template()

    def answer(messages: Sequence[tuple[str, str]], max_tokens: int) -> tuple[list[int], list[int]]:
        text = render_chat(template, [{"role": r, "content": c} for r, c in messages])
        prompt = a.tokenize(text)
        a.clear_kv_cache()
        gen = a.generate(a.prefill(prompt, align=a.n_ctx), max_tokens)
        return prompt, list(gen.tokens)

    out: dict[str, Any] = {}
    for w in WORKLOADS:
        pairs: list[tuple[list[int], list[int]]] = []
        if w == "chat":
            for turns in CHAT_CONVERSATIONS:
                msgs: list[tuple[str, str]] = [("system", CHAT_SYSTEM)]
                for turn in turns:
                    msgs.append(("user", turn))
                    pairs.append(answer(msgs, MAX_TOKENS[w]))
                    msgs.append(("assistant", a.detokenize(pairs[-1][1])))
        else:
            pairs = [answer(p.messages, MAX_TOKENS[w]) for p in single_turn_prompts(w)]
        per_k: list[dict[str, Any]] = []
        for k in ks:
            runs = [replay(p, ans, k, cost, config) for p, ans in pairs]
            tot = {f: sum(r[f] for r in runs) for f in runs[0]}
            per_k.append({"k": "oracle" if k is None else k,
                          "speedup": round(tot["tokens"] / tot["decode_steps"], 3),
                          "acceptance_rate": (round(tot["accepted"] / tot["drafted"], 4)
                                              if tot["drafted"] else None),
                          "drafted_tokens": tot["drafted"], "accepted_tokens": tot["accepted"],
                          "tokens": tot["tokens"], "steps": tot["steps"]})
        fixed = [r for r in per_k if r["k"] != "oracle"]
        best = max(fixed, key=lambda r: r["speedup"])
        out[w] = {"prompts": len(pairs), "max_tokens": MAX_TOKENS[w],
                  "looping_outputs": sum(loops(a.detokenize(ans)) for _, ans in pairs),
                  "best_fixed_k": best["k"], "best_fixed_speedup": best["speedup"],
                  "oracle_speedup": per_k[-1]["speedup"], "per_k": per_k}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--ceiling", action="store_true",
                    help="also replay bench spec's greedy answers through the drafter")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    path = resolve_model(args.model) if args.model else default_model_path()
    a = LlamaCppAdapter(path, n_ctx=2048)
    try:
        rows = costs(a, args.runs)
        ceil = ceiling(a, rows) if args.ceiling else None
    finally:
        flash, invariant, build = a.flash_attn, a.batch_invariant, a.build_info()
        a.close()
    write_json(args.json, {"bench": "spec-verify-cost", "model": path.name,
                           "cpu": platform.processor() or platform.machine(),
                           "flash_attn": flash, "batch_invariant_kernels": invariant,
                           "build": build, "environment": environment(), "rows": rows,
                           **({"ceiling": ceil} if ceil is not None else {})})
    for r in rows:
        print(f"{r['tokens']:3d} tokens: {r['ms']:8.2f} ms = {r['decode_steps']:.2f} decode steps")
    for w, c in (ceil or {}).items():
        print(f"{w:10} best fixed k {c['best_fixed_k']}: {c['best_fixed_speedup']:.3f}x, "
              f"oracle {c['oracle_speedup']:.3f}x, looping {c['looping_outputs']}/{c['prompts']}")


if __name__ == "__main__":
    main()
