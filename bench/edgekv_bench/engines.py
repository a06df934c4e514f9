"""`edgekv bench engines`: a fragment made on engine A injected into engine B, against B cold.

Prompts: `PROMPTS` over the corpus clusters in turn (8 topics, package data), each a system
prompt cut to a length from `CONTEXT_LENGTHS` (not multiples of the chunk size) plus one of the
cluster's questions, so lengths and topics vary. For every ordered pair of the engines available
here (same-engine pairs with `same_engine=True`), each context's whole chunks are prefilled on
A, extracted, converted to B's dtype and injected into B; B then prefills the rest and generates
`gen_tokens` greedily. The same prompt run cold on B (once per engine and prompt) is the
reference. Agreement is measured to the first divergence: the index of the first differing
greedy token (None: identical to the end), the share of prompts identical to the end, the mean
first-divergence position (a prompt that never diverges counts as `gen_tokens`), and the max
|logit difference| at the first step. The cold runs of A and B are compared the same way
(`cold_pairs`: how far two engines agree with no reuse at all).

`reuse_enabled` for a cross-engine pair is True only where every prompt was identical to the
end; `engines/layout.py`'s `CROSS_ENGINE_REUSE` default is that verdict (a test checks that it
matches docs/bench/engines.json). Tokens come from one tokenizer (llama.cpp's) so every engine
sees the same ids. Also: prefill tokens/s and inject time per engine at `speed_tokens`, side by
side in the same run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .corpus import CLUSTERS
from .options import ENGINES, Subparsers, bench_parser, csv, progress
from .report import environment, table

__all__ = ["add_parser", "engines_table", "first_divergence", "reuse_verdict", "run_cli",
           "run_engines_bench"]

CONTEXT_LENGTHS = (150, 290, 410)  # tokens of system prompt, cycled over a cluster's prompts
PROMPTS = 20  # over the 8 clusters in turn: 2-3 per topic, each at another length


def _adapters(model: str | None, names: tuple[str, ...], memo_dir: Any = None,
              n_threads: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        if name == "llamacpp":
            from edgekv.engines.llamacpp import LlamaCppAdapter

            out[name] = LlamaCppAdapter(model, n_ctx=2048, n_threads=n_threads)
        elif name == "torch":
            from edgekv.engines.torch import TorchAdapter

            out[name] = TorchAdapter(model, n_ctx=2048, n_threads=n_threads)
        elif name == "onnx":
            from edgekv.engines.onnx import OnnxAdapter

            out[name] = OnnxAdapter(model, n_ctx=2048, memo_dir=memo_dir, n_threads=n_threads)
        else:
            raise ValueError(f"unknown engine {name!r} (available: llamacpp, torch, onnx)")
    return out


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where the two greedy sequences differ (a shorter one ends
    there), or None if they are identical to the end."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _agreement(divs: list[int | None], gen_tokens: int) -> dict[str, Any]:
    pos = [gen_tokens if d is None else d for d in divs]
    return {"first_divergence": divs,
            "identical_share": round(sum(d is None for d in divs) / len(divs), 4),
            "mean_first_divergence": round(float(np.mean(pos)), 2),
            "min_first_divergence": min(pos)}


def reuse_verdict(pair: dict[str, Any]) -> bool:
    """Reuse is enabled for a pair only if every prompt was identical to the end."""
    return bool(pair["src"] == pair["dst"] or pair["identical_share"] == 1.0)


def _cases(tokenizer: Any, prompts: int) -> list[tuple[str, list[int], list[int]]]:
    out = []
    for k in range(prompts):
        cl = CLUSTERS[k % len(CLUSTERS)]
        j = k // len(CLUSTERS)
        ctx = tokenizer.tokenize(cl.system)[:CONTEXT_LENGTHS[j % len(CONTEXT_LENGTHS)]]
        intent = cl.intents[(3 * j + k) % len(cl.intents)]
        q = tokenizer.tokenize(f"\nUser: {intent[j % len(intent)]}\nAssistant:", add_bos=False)
        out.append((cl.name, ctx, q))
    return out


def run_engines_bench(*, model: str | None = None,
                      engines: tuple[str, ...] = ("llamacpp", "torch", "onnx"),
                      prompts: int = PROMPTS, gen_tokens: int = 32,
                      speed_tokens: int = 512, same_engine: bool = False,
                      n_threads: int | None = None,
                      progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    from edgekv.config import default_cache_dir
    from edgekv.engines.base import FragmentSpec
    from edgekv.engines.layout import can_inject, convert_fragment

    ads = _adapters(model, engines, default_cache_dir(), n_threads)
    tokenizer = ads.get("llamacpp") or next(iter(ads.values()))
    c = 128
    cases = _cases(tokenizer, prompts)
    pairs, cold_pairs = [], []
    n_pairs = len(ads) * len(ads) if same_engine else len(ads) * (len(ads) - 1)
    done, total = 0, len(cases) * (len(ads) + n_pairs)
    try:
        # each engine's cold run of each prompt (chunk-aligned prefill, as reuse is)
        colds: dict[str, list[tuple[np.ndarray, tuple[int, ...]]]] = {}
        for name, a in ads.items():
            colds[name] = []
            for _, ctx, q in cases:
                a.clear_kv_cache()
                logits = a.prefill(ctx + q, align=c)
                colds[name].append((logits, a.generate(logits, gen_tokens).tokens))
                done += 1
                if progress:
                    progress(done, total)
        for src_name, src in ads.items():
            for dst_name, dst in ads.items():
                if src_name == dst_name and not same_engine:
                    continue
                diffs, divs = [], []
                verdict = None
                for k, (_, ctx, q) in enumerate(cases):
                    n = len(ctx) // c * c
                    src.clear_kv_cache()
                    src.prefill(ctx[:n], align=c)
                    frags = src.extract_fragments([FragmentSpec(f"k{i}", i * c, (i + 1) * c)
                                                   for i in range(n // c)])
                    verdict = can_inject(frags[0], src.fingerprint, dst.fingerprint,
                                         allow={(src.fingerprint.engine.split("/")[0],
                                                 dst.fingerprint.engine.split("/")[0]): True})
                    dst.clear_kv_cache()
                    dst.inject_fragments([convert_fragment(f, dst.fingerprint) for f in frags])
                    warm = dst.prefill(ctx[n:] + q, align=c)
                    warm_gen = dst.generate(warm, gen_tokens).tokens
                    cold, cold_gen = colds[dst_name][k]
                    diffs.append(float(np.max(np.abs(warm - cold))))
                    divs.append(first_divergence(cold_gen, warm_gen))
                    done += 1
                    if progress:
                        progress(done, total)
                agreement = _agreement(divs, gen_tokens)
                pair = {"src": src_name, "dst": dst_name,
                        "max_abs_logit_diff": max(diffs),
                        # share of positions equal (kept from the first version of this bench)
                        "greedy_agreement": round(float(np.mean(
                            [(gen_tokens if d is None else d) / gen_tokens for d in divs])), 4),
                        **agreement,
                        "conversion": verdict.kind if verdict else None}
                pair["greedy_agreement_min"] = round(agreement["min_first_divergence"]
                                                     / gen_tokens, 4)
                pair["reuse_enabled"] = reuse_verdict(pair)
                pairs.append(pair)
        names = list(ads)
        for i, a_name in enumerate(names):
            for b_name in names[i + 1:]:
                divs = [first_divergence(x[1], y[1]) for x, y in zip(colds[a_name], colds[b_name])]
                cold_pairs.append({"a": a_name, "b": b_name, **_agreement(divs, gen_tokens)})
        speed = {}
        ids = tokenizer.tokenize(" ".join(cl.system for cl in CLUSTERS))[:speed_tokens]
        for name, a in ads.items():
            a.clear_kv_cache()
            t = time.perf_counter()
            a.prefill(ids, align=c)
            pre = time.perf_counter() - t
            frags = a.extract_fragments([FragmentSpec(f"k{i}", i * c, (i + 1) * c)
                                         for i in range(len(ids) // c)])
            inj = []
            for _ in range(5):
                a.clear_kv_cache()
                t = time.perf_counter()
                a.inject_fragments(frags)
                inj.append(time.perf_counter() - t)
            speed[name] = {"prefill_tokens_per_s": round(len(ids) / pre, 1),
                           "prefill_ms": round(pre * 1000, 1),
                           "inject_ms_median": round(float(np.median(inj)) * 1000, 2),
                           "tokens": len(ids), "kv_dtype": a.fingerprint.kv_dtype}
    finally:
        for a in ads.values():
            a.close()
    return {"bench": "engines", "pairs": pairs, "cold_pairs": cold_pairs, "speed": speed,
            "context_tokens": list(CONTEXT_LENGTHS), "gen_tokens": gen_tokens,
            "prompts": len(cases), "same_engine_pairs": same_engine,
            "threads": {n: a.n_threads for n, a in ads.items()},
            "prompt_set": [{"cluster": name, "context_tokens": len(ctx), "prompt_tokens":
                            len(ctx) + len(q)} for name, ctx, q in cases],
            "method": ("greedy tokens of B after A's whole-chunk KV was injected, against B's "
                       "cold chunk-aligned run of the same prompt; first divergence = index of "
                       "the first differing token (null: identical to the end); reuse enabled "
                       "for a cross-engine pair only if identical on every prompt"),
            "engines_missing": {"mlc-llm": "no package in the reachable registries"},
            "environment": environment()}


def engines_table(res: dict[str, Any]) -> str:
    g = res["gen_tokens"]
    rows = [[p["src"], p["dst"], f"{p['max_abs_logit_diff']:.4g}",
             f"{100 * p.get('identical_share', p['greedy_agreement']):.0f}%",
             p.get("mean_first_divergence", ""), p.get("min_first_divergence", ""),
             f"{100 * p['greedy_agreement']:.1f}%", p["conversion"],
             "yes" if p["reuse_enabled"] else "no"] for p in res["pairs"]]
    t1 = table(["src KV", "dst engine", "max |logit diff|",
                f"identical to end ({g} tok)", "mean 1st divergence", "min 1st divergence",
                "tokens before divergence", "conversion", "reuse enabled"], rows)
    out = [f"{res['prompts']} prompts, {g} greedy tokens each; dst engine's cold run is the "
           "reference.", "", t1]
    if res.get("cold_pairs"):
        rows3 = [[p["a"], p["b"], f"{100 * p['identical_share']:.0f}%",
                  p["mean_first_divergence"], p["min_first_divergence"]]
                 for p in res["cold_pairs"]]
        out += ["", "Cold runs of two engines (no reuse):", "",
                table(["engine A", "engine B", "identical to end", "mean 1st divergence",
                       "min 1st divergence"], rows3)]
    rows2 = [[n, s["tokens"], s["prefill_ms"], s["prefill_tokens_per_s"], s["inject_ms_median"],
              s["kv_dtype"]] for n, s in res["speed"].items()]
    out += ["", table(["engine", "tokens", "prefill ms", "prefill tok/s", "inject ms",
                       "KV dtype"], rows2)]
    return "\n".join(out)


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    res = run_engines_bench(model=args.model, engines=csv(args.engines),
                            n_threads=args.threads, progress=progress)
    return res, engines_table(res)


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = bench_parser(sub, "engines", "a fragment made on one engine injected into another, "
                     "against it cold", run_cli,
                     threads="engine threads (default: all cores)")
    p.add_argument("--engines", default=",".join(ENGINES), help="which adapters to pair")
    return p
