"""`edgekv bench seed`: the EdgeSync seed's experiment on the real engine, against real peers.

Same requests, same engine weights, one run, modes interleaved request by request (the order
rotating) so that drift of the machine hits every mode alike: no cache, naive string cache,
llama-cpp-python's `LlamaRAMCache`, EdgeKV strict, EdgeKV approximate. Fidelity compares each
mode's first greedy tokens with the no-cache run of the same request.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from ..cache import EdgeKV
from ..chat import render_chat
from ..config import CacheConfig
from ..energy import EnergyMeter, joules_to_mah
from ..store import open_store
from .modes import EdgeKVMode, LlamaRAMCacheMode, NoCacheMode, Outcome, StringMode
from .report import environment
from .workload import Request, render, seed_workload, unique_prompts

__all__ = ["MODES", "run_seed_bench"]

MODES = ("nocache", "string", "llama_ram_cache", "edgekv_strict", "edgekv_approx")


def _progress(i: int, n: int, t0: float) -> None:
    done = i / n
    el = time.perf_counter() - t0
    eta = el / done - el if done else 0
    bar = "#" * int(30 * done)
    print(f"\r[{bar:<30}] {i}/{n} requests  {el:5.0f}s elapsed  ~{eta:4.0f}s left",
          end="" if i < n else "\n", file=sys.stderr, flush=True)


def run_seed_bench(*, requests: list[Request] | None = None, n_requests: int = 1000,
                   seed: int = 0, model: str | None = None, n_ctx: int = 2048,
                   max_tokens: int = 16, progress: bool = True,
                   engine: str = "llamacpp") -> dict[str, Any]:
    from .. import open_router
    from ..engines import open_adapter
    from ..semantic import MiniLMEmbedder

    reqs = requests if requests is not None else seed_workload(n_requests, seed=seed,
                                                                max_tokens=max_tokens)
    tmp = tempfile.TemporaryDirectory(prefix="edgekv-seed-")
    root = Path(tmp.name)
    adapter = open_adapter(engine, model, n_ctx=n_ctx, memo_dir=root)
    embedder = MiniLMEmbedder(root)
    min_reuse = CacheConfig().min_reuse_tokens
    kvs = []
    modes: dict[str, Any] = {}
    try:
        def edgekv(name: str, approximate: bool) -> EdgeKV:
            cfg = CacheConfig(cache_dir=root / name)
            store = open_store(cfg)
            kv = EdgeKV(adapter, store, cfg, router=open_router(embedder, store, cfg))
            kvs.append(kv)
            return kv

        plain_cfg = CacheConfig(cache_dir=root / "plain")
        plain = EdgeKV(adapter, open_store(plain_cfg), plain_cfg)
        kvs.append(plain)
        modes["nocache"] = NoCacheMode(plain, min_reuse)
        modes["string"] = StringMode(plain, min_reuse)
        if engine == "llamacpp":  # llama-cpp-python's own cache exists for llama.cpp only
            modes["llama_ram_cache"] = LlamaRAMCacheMode(
                str(adapter.model_path), n_ctx, min_reuse, adapter.weight_bytes,
                adapter.fingerprint.kv_bytes_per_token)
        strict = edgekv("strict", False)
        from ..prefetch import Prefetcher

        strict.prefetcher = Prefetcher(strict.warm_chain)  # n-gram prefetch, hit rate reported
        modes["edgekv_strict"] = EdgeKVMode(strict, min_reuse, approximate=False)
        modes["edgekv_approx"] = EdgeKVMode(edgekv("approx", True), min_reuse, approximate=True)
        template = adapter.chat_template()  # type: ignore[attr-defined]
        meter = EnergyMeter()
        results: dict[str, list[tuple[Outcome, float, float]]] = defaultdict(list)
        t0 = time.perf_counter()
        for i, req in enumerate(reqs):
            text = render(req, template, render_chat)
            tokens = adapter.tokenize(text)
            if len(tokens) + req.max_tokens > n_ctx:
                raise ValueError(f"request {i} needs {len(tokens) + req.max_tokens} tokens; "
                                 f"raise --n-ctx above {n_ctx}")
            names = tuple(m for m in MODES if m in modes)
            order = names[i % len(names):] + names[: i % len(names)]
            for name in order:
                meter.start()
                c0 = time.process_time()
                out = modes[name].run(text, tokens, req.max_tokens)
                cpu = time.process_time() - c0
                energy = meter.stop(cpu, out.traffic_bytes)
                results[name].append((out, cpu, energy.joules))
            if progress:
                _progress(i + 1, len(reqs), t0)
        energy_source = meter.source
        energy_method = meter.stop(0.0, 0.0).method if energy_source == "estimated" else (
            "RAPL or battery probe")
        res = _summarise(reqs, results, energy_source, energy_method, adapter,
                         time.perf_counter() - t0)
        strict.prefetcher.drain()  # type: ignore[attr-defined]
        res["modes"]["edgekv_strict"]["prefetch"] = strict.prefetcher.stats()  # type: ignore[attr-defined]
        return res
    finally:
        for kv in kvs:
            kv.close()
        if "llama_ram_cache" in modes:
            modes["llama_ram_cache"].close()
        adapter.close()
        tmp.cleanup()


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _summarise(reqs: list[Request], results: dict[str, list[tuple[Outcome, float, float]]],
               energy_source: str, energy_method: str, adapter: Any, wall: float) -> dict[str, Any]:
    base = results["nocache"]
    base_traffic = sum(o.traffic_bytes for o, _, _ in base) or 1
    out: dict[str, Any] = {}
    for name in [m for m in MODES if results.get(m)]:
        rows = results[name]
        ttft = [o.ttft_s * 1000 for o, _, _ in rows]
        same = [o.text == b.text for (o, _, _), (b, _, _) in zip(rows, base)]
        tiers: dict[str, list[bool]] = defaultdict(list)
        for o, _, _ in rows:
            tiers[o.tier].append(o.hit)
        joules = sum(j for _, _, j in rows)
        traffic = sum(o.traffic_bytes for o, _, _ in rows)
        out[name] = {
            "requests": len(rows),
            "ttft_ms_mean": round(statistics.fmean(ttft), 3),
            "ttft_ms_p50": round(_pct(ttft, 0.5), 3),
            "ttft_ms_p95": round(_pct(ttft, 0.95), 3),
            "hit_rate": round(sum(o.hit for o, _, _ in rows) / len(rows), 4),
            "hit_rate_by_tier": {t: {"requests": len(h), "share": round(len(h) / len(rows), 4),
                                     "hit_rate": round(sum(h) / len(h), 4)}
                                 for t, h in sorted(tiers.items())},
            "reused_tokens": sum(o.reused for o, _, _ in rows),
            "computed_tokens": sum(o.computed for o, _, _ in rows),
            "approximate_requests": sum(o.approximate for o, _, _ in rows),
            "fidelity": round(sum(same) / len(same), 4),
            "memory_traffic_bytes": traffic,
            "memory_traffic_ratio": round(traffic / base_traffic, 4),
            "cpu_s": round(sum(c for _, c, _ in rows), 3),
            "energy_j": round(joules, 3),
            "energy_mah": round(joules_to_mah(joules), 4),
            "energy_source": energy_source,
            "ttft_ms": [round(x, 3) for x in ttft],
            "reused_per_request": [o.reused for o, _, _ in rows],
        }
    nc = out["nocache"]["ttft_ms_mean"]
    for name in out:
        out[name]["ttft_speedup_vs_nocache"] = round(nc / out[name]["ttft_ms_mean"], 3)
    return {
        "bench": "seed",
        "requests": len(reqs),
        "unique_prompts": unique_prompts(reqs),
        "clusters": len({r.cluster for r in reqs}),
        "requests_per_cluster": dict(Counter(r.cluster for r in reqs).most_common()),
        "max_tokens": reqs[0].max_tokens,
        "fidelity_tokens": "first max_tokens greedy tokens (text) equal to the no-cache run's",
        "energy_source": energy_source,
        "energy_method": energy_method,
        "memory_traffic_model": ("prefill up to the first token, per forward batch: weights once + KV written for its tokens + "
                                 "KV read for every attended cell; plus KV bytes the cache reads "
                                 "and writes (fragments or llama states). Counted, not sampled."),
        "model": adapter.model_path.name,
        "engine": adapter.fingerprint.engine,
        "wall_s": round(wall, 1),
        "modes": out,
        "environment": environment(),
    }

