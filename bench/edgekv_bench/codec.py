"""`edgekv bench codec`: what each wire level costs in bytes and in output quality.

For a few contexts, llama.cpp's KV chunks are encoded at each level (f16, int8, int4; all
zstd-compressed), decoded, injected, and the question is answered; the answer is compared
with the cold run: KV error, first-step max |logit difference|, greedy agreement.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from .corpus import CLUSTERS
from .options import Subparsers, bench_parser
from .report import environment, table

__all__ = ["add_parser", "codec_table", "run_cli", "run_codec_bench"]


def run_codec_bench(*, model: str | None = None, prompts: int = 4, context_tokens: int = 512,
                    gen_tokens: int = 16) -> dict[str, Any]:
    from edgekv.engines.base import FragmentSpec
    from edgekv.engines.llamacpp import LlamaCppAdapter
    from edgekv.stream.codec import LEVELS, decode_chunk, encode_chunk

    a = LlamaCppAdapter(model, n_ctx=2048)
    c = 128
    rows: dict[str, dict[str, list[float]]] = {lv: {"wire": [], "raw": [], "kv_max": [],
                                                    "kv_mean": [], "logit": [], "agree": [],
                                                    "enc_ms": [], "dec_ms": []} for lv in LEVELS}
    try:
        for cl in CLUSTERS[:prompts]:
            ids = a.tokenize(cl.system + "\n" + cl.system)[:context_tokens]
            q = a.tokenize(f"\nUser: {cl.intents[1][0]}\nAssistant:", add_bos=False)
            n = len(ids) // c * c
            a.clear_kv_cache()
            cold = a.prefill(ids[:n] + q, align=c)
            cold_gen = a.generate(cold, gen_tokens).tokens
            a.clear_kv_cache()
            a.prefill(ids[:n], align=c)
            frags = a.extract_fragments([FragmentSpec(f"k{i}", i * c, (i + 1) * c)
                                         for i in range(n // c)])
            for lv in LEVELS:
                t = time.perf_counter()
                wire = [encode_chunk(f, lv) for f in frags]
                t1 = time.perf_counter()
                back = [decode_chunk(w) for w in wire]
                t2 = time.perf_counter()
                r = rows[lv]
                r["enc_ms"].append((t1 - t) * 1000 / len(frags))
                r["dec_ms"].append((t2 - t1) * 1000 / len(frags))
                r["wire"].append(sum(len(w) for w in wire))
                r["raw"].append(sum(f.keys.nbytes + f.values.nbytes for f in frags))
                d = np.concatenate([
                    np.abs(b.keys.astype(np.float32) - f.keys.astype(np.float32)).ravel()
                    for b, f in zip(back, frags)])
                r["kv_max"].append(float(d.max()))
                r["kv_mean"].append(float(d.mean()))
                a.clear_kv_cache()
                a.inject_fragments(back)
                warm = a.prefill(q, align=c)
                gen = a.generate(warm, gen_tokens).tokens
                r["logit"].append(float(np.max(np.abs(warm - cold))))
                m = max(len(gen), len(cold_gen))
                r["agree"].append(sum(x == y for x, y in zip(gen, cold_gen)) / m if m else 1.0)
    finally:
        a.close()
    tokens = prompts * (context_tokens // c) * c
    levels = {lv: {"wire_bytes_per_token": round(sum(r["wire"]) / tokens, 1),
                   "wire_ratio": round(sum(r["wire"]) / sum(r["raw"]), 4),
                   "kv_max_abs_err": round(max(r["kv_max"]), 5),
                   "kv_mean_abs_err": round(float(np.mean(r["kv_mean"])), 6),
                   "max_abs_logit_diff": round(max(r["logit"]), 5),
                   "greedy_agreement": round(float(np.mean(r["agree"])), 4),
                   "encode_ms_per_chunk": round(float(np.median(r["enc_ms"])), 2),
                   "decode_ms_per_chunk": round(float(np.median(r["dec_ms"])), 2)}
              for lv, r in rows.items()}
    return {"bench": "codec", "prompts": prompts, "context_tokens": context_tokens,
            "gen_tokens": gen_tokens, "levels": levels, "environment": environment()}


def codec_table(res: dict[str, Any]) -> str:
    rows = [[lv, v["wire_bytes_per_token"], f"{v['wire_ratio']:.3f}", v["kv_max_abs_err"],
             v["max_abs_logit_diff"], f"{100 * v['greedy_agreement']:.1f}%",
             v["encode_ms_per_chunk"], v["decode_ms_per_chunk"]] for lv, v in res["levels"].items()]
    return table(["level", "wire B/token", "wire/raw", "KV max err", "max |logit diff|",
                  f"greedy agreement ({res['gen_tokens']} tok)", "encode ms/chunk",
                  "decode ms/chunk"], rows)


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    res = run_codec_bench(model=args.model)
    return res, codec_table(res)


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    return bench_parser(sub, "codec", "what each wire level costs in bytes and output quality",
                        run_cli)
