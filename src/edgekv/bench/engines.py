"""`edgekv bench engines`: a fragment made on engine A injected into engine B, against B cold.

For every ordered pair of the engines available here (same-engine pairs included), a context
of whole chunks is prefilled on A, extracted, converted to B's dtype and injected into B;
B then prefills the question and generates greedily. The same prompt is run cold on B.
Reported: max |logit difference| at the first step, greedy agreement over `gen_tokens`
(share of positions equal), and whether reuse is enabled for the pair. Tokens come from one
tokenizer (llama.cpp's) so both engines see the same ids. Also: prefill tokens/s and inject
time per engine at `speed_tokens`, side by side in the same run.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .corpus import CLUSTERS
from .report import environment, table

__all__ = ["engines_table", "run_engines_bench"]


def _adapters(model: str | None, names: tuple[str, ...], memo_dir: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        if name == "llamacpp":
            from ..engines.llamacpp import LlamaCppAdapter

            out[name] = LlamaCppAdapter(model, n_ctx=2048)
        elif name == "torch":
            from ..engines.torch import TorchAdapter

            out[name] = TorchAdapter(model, n_ctx=2048)
        elif name == "onnx":
            from ..engines.onnx import OnnxAdapter

            out[name] = OnnxAdapter(model, n_ctx=2048, memo_dir=memo_dir)
        else:
            raise ValueError(f"unknown engine {name!r} (available: llamacpp, torch, onnx)")
    return out


def run_engines_bench(*, model: str | None = None,
                      engines: tuple[str, ...] = ("llamacpp", "torch", "onnx"),
                      prompts: int = 3, context_tokens: int = 256, gen_tokens: int = 32,
                      speed_tokens: int = 512) -> dict[str, Any]:
    from ..config import default_cache_dir
    from ..engines.base import FragmentSpec
    from ..engines.layout import can_inject, convert_fragment

    ads = _adapters(model, engines, default_cache_dir())
    tokenizer = ads.get("llamacpp") or next(iter(ads.values()))
    c = 128
    cases = []
    for cl in CLUSTERS[:prompts]:
        ctx = tokenizer.tokenize(cl.system)[:context_tokens]
        q = tokenizer.tokenize(f"\nUser: {cl.intents[0][0]}\nAssistant:", add_bos=False)
        cases.append((ctx, q))
    pairs = []
    try:
        for src_name, src in ads.items():
            for dst_name, dst in ads.items():
                diffs, agree = [], []
                verdict = None
                for ctx, q in cases:
                    n = len(ctx) // c * c
                    src.clear_kv_cache()
                    src.prefill(ctx[:n], align=c)
                    frags = src.extract_fragments([FragmentSpec(f"k{i}", i * c, (i + 1) * c)
                                                   for i in range(n // c)])
                    verdict = can_inject(frags[0], src.fingerprint, dst.fingerprint,
                                         allow={(src.fingerprint.engine.split("/")[0],
                                                 dst.fingerprint.engine.split("/")[0]): True})
                    dst.clear_kv_cache()
                    cold = dst.prefill(ctx[:n] + ctx[n:] + q, align=c)
                    cold_gen = dst.generate(cold, gen_tokens).tokens
                    dst.clear_kv_cache()
                    dst.inject_fragments([convert_fragment(f, dst.fingerprint) for f in frags])
                    warm = dst.prefill(ctx[n:] + q, align=c)
                    warm_gen = dst.generate(warm, gen_tokens).tokens
                    diffs.append(float(np.max(np.abs(warm - cold))))
                    m = max(len(cold_gen), len(warm_gen))
                    same = sum(1 for a, b in zip(cold_gen, warm_gen) if a == b)
                    agree.append(same / m if m else 1.0)
                pairs.append({
                    "src": src_name, "dst": dst_name,
                    "max_abs_logit_diff": max(diffs),
                    "greedy_agreement": round(float(np.mean(agree)), 4),
                    "greedy_agreement_min": round(min(agree), 4),
                    "conversion": verdict.kind if verdict else None,
                    "reuse_enabled": src_name == dst_name or min(agree) == 1.0,
                })
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
    return {"bench": "engines", "pairs": pairs, "speed": speed, "context_tokens": context_tokens,
            "gen_tokens": gen_tokens, "prompts": prompts,
            "engines_missing": {"mlc-llm": "no package in the reachable registries"},
            "environment": environment()}


def engines_table(res: dict[str, Any]) -> str:
    rows = [[p["src"], p["dst"], f"{p['max_abs_logit_diff']:.4g}",
             f"{100 * p['greedy_agreement']:.1f}%", p["conversion"],
             "yes" if p["reuse_enabled"] else "no"] for p in res["pairs"]]
    t1 = table(["src", "dst", "max |logit diff|", f"greedy agreement ({res['gen_tokens']} tok)",
                "conversion", "reuse enabled"], rows)
    rows2 = [[n, s["tokens"], s["prefill_ms"], s["prefill_tokens_per_s"], s["inject_ms_median"],
              s["kv_dtype"]] for n, s in res["speed"].items()]
    t2 = table(["engine", "tokens", "prefill ms", "prefill tok/s", "inject ms", "KV dtype"], rows2)
    return t1 + "\n\n" + t2
