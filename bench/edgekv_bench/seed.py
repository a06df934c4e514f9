"""`edgekv bench seed`: the EdgeSync seed's experiment on the real engine, against real peers.

Same requests, same engine weights, one run, modes interleaved request by request (the order
rotating) so that drift of the machine hits every mode alike: plain llama-cpp-python, no
cache, naive string cache, llama-cpp-python's `LlamaRAMCache`, EdgeKV strict, EdgeKV
approximate. The reference (plain, or no cache where plain is not available) runs first on
every request: chat workloads put its answers into the later turns' history. Fidelity
compares each mode's first greedy tokens with its own system's cache-off run of the same
request, and separately with plain llama-cpp-python's (`fidelity_reference`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from edgekv.chat import ChatTokenizer, render_chat
from edgekv.config import CacheConfig
from edgekv.core.pipeline import EdgeKV
from edgekv.energy import EnergyMeter, joules_to_mah
from edgekv.errors import ConfigError
from edgekv.fragment import common_prefix
from edgekv.store import open_store

from .modes import (
    EdgeKVMode,
    LlamaRAMCacheMode,
    LlamaServerMode,
    NoCacheMode,
    Outcome,
    PlainMode,
    StateSeqMode,
    StringMode,
)
from .options import ENGINES, Subparsers, bench_parser, csv, llama_server_opt, llama_server_path
from .report import environment
from .servers import resolved_settings
from .workload import ChatHistory, WorkloadItem, load_workload, render, unique_prompts

__all__ = ["add_parser", "MODES", "REFERENCE", "run_cli", "run_seed_bench", "write_report"]

MODES = ("plain", "nocache", "string", "llama_ram_cache", "state_seq", "llama_server",
         "llama_server_nocache", "edgekv_strict", "edgekv_chunk", "edgekv_approx")
# each system's own cache-off run: what its cache must reproduce (the `fidelity` column)
REFERENCE = {"plain": "plain", "nocache": "nocache", "string": "nocache",
             "llama_ram_cache": "plain", "state_seq": "plain",
             "llama_server": "llama_server_nocache", "llama_server_nocache": "llama_server_nocache",
             "edgekv_strict": "nocache",
             "edgekv_chunk": "nocache", "edgekv_approx": "nocache"}
FIDELITY_REFERENCE = {
    "fidelity": "text equal to the same system's own cache-off run of the same prompt: EdgeKV "
                "modes and the string cache against nocache (EdgeKV with use_cache=False, "
                "chunk-aligned prefill), llama_ram_cache against plain",
    "fidelity_vs_plain": "text equal to plain llama-cpp-python's with no cache (default "
                         "n_batch, context reset before every request): what a user gets "
                         "without any cache; null where plain did not run (engine not llamacpp)",
}

OUT_OF_PROCESS = ("llama_server", "llama_server_nocache")  # CPU and energy not measured

Rows = list[tuple[Outcome, float, float]]  # (outcome, CPU seconds, joules) per request


def _progress(i: int, n: int, t0: float) -> None:
    done = i / n
    el = time.perf_counter() - t0
    eta = el / done - el if done else 0
    bar = "#" * int(30 * done)
    print(f"\r[{bar:<30}] {i}/{n} requests  {el:5.0f}s elapsed  ~{eta:4.0f}s left",
          end="" if i < n else "\n", file=sys.stderr, flush=True)


def _open_modes(adapter: Any, engine: str, n_ctx: int, threads: int, root: Path,
                embedder: Any, kvs: list[EdgeKV], modes: dict[str, Any],
                llama_server: Path | None = None,
                only: tuple[str, ...] | None = None) -> EdgeKV:
    """Fill `modes` (and `kvs`, to close) as they open, so a failure closes what is open.
    Returns the strict EdgeKV, whose prefetcher is reported."""
    from edgekv import open_router
    from edgekv.core.prefetch import Prefetcher

    min_reuse = CacheConfig().min_reuse_tokens
    model_path, kvpt = str(adapter.model_path), adapter.fingerprint.kv_bytes_per_token

    def edgekv(name: str, granularity: str = "auto") -> EdgeKV:
        cfg = CacheConfig(cache_dir=root / name, reuse_granularity=granularity)
        store = open_store(cfg)
        kv = EdgeKV(adapter, store, cfg, router=open_router(embedder, store, cfg))
        kvs.append(kv)
        return kv

    if engine == "llamacpp":  # llama-cpp-python runs llama.cpp only
        modes["plain"] = PlainMode(model_path, n_ctx, threads, adapter.weight_bytes, kvpt)
    cold_cfg = CacheConfig(cache_dir=root / "cold")
    cold = EdgeKV(adapter, open_store(cold_cfg), cold_cfg)
    kvs.append(cold)
    modes["nocache"] = NoCacheMode(cold, min_reuse)
    modes["string"] = StringMode(cold, min_reuse)
    if engine == "llamacpp":
        modes["llama_ram_cache"] = LlamaRAMCacheMode(
            model_path, n_ctx, min_reuse, adapter.weight_bytes, kvpt, n_threads=threads)
        # the careful user's 50 lines: llama_state_seq_* at token granularity, no chunks
        modes["state_seq"] = StateSeqMode(model_path, n_ctx, min_reuse, adapter.weight_bytes,
                                          kvpt, n_threads=threads)
        if llama_server is not None:  # llama.cpp's own server and its prompt cache
            for name in ("llama_server", "llama_server_nocache"):
                if only is None or _wanted(name, only):
                    modes[name] = LlamaServerMode(name, llama_server, model_path, n_ctx,
                                                  threads, root, min_reuse,
                                                  adapter.weight_bytes, kvpt)
    strict = edgekv("strict")
    strict.prefetcher = Prefetcher(strict.warm_chain)  # n-gram prefetch, hit rate reported
    modes["edgekv_strict"] = EdgeKVMode(strict, min_reuse, approximate=False)
    # strict reuse of whole chunks only: what EdgeKV did before the batch-invariance probe
    # (and still does where the probe fails), side by side with the probe's choice
    modes["edgekv_chunk"] = EdgeKVMode(edgekv("chunk", "chunk"), min_reuse, approximate=False,
                                       name="edgekv_chunk")
    modes["edgekv_approx"] = EdgeKVMode(edgekv("approx"), min_reuse, approximate=True)
    return strict


def _prepare(req: WorkloadItem, history: ChatHistory, adapter: Any, template: str | None,
             n_ctx: int) -> tuple[WorkloadItem, str, list[int]]:
    """The prompt every mode answers. A conversation that no longer fits the context window
    starts afresh at this turn, as a chat front end would."""
    filled = history.fill(req)
    text = render(filled, template, render_chat)
    tokens = _tokens(filled, text, adapter, template)
    if len(tokens) + req.max_tokens > n_ctx and req.conversation is not None and req.turn:
        filled = history.restart(req)
        text = render(filled, template, render_chat)
        tokens = _tokens(filled, text, adapter, template)
    if len(tokens) + req.max_tokens > n_ctx:
        raise ConfigError(f"a request needs {len(tokens) + req.max_tokens} tokens "
                          f"({req.cluster}); raise --n-ctx above {n_ctx}")
    return filled, text, tokens


def _tokens(req: WorkloadItem, text: str, adapter: Any, template: str | None) -> list[int]:
    """A chat request's tokens as every chat path makes them (`chat.ChatTokenizer`: the
    messages' text stays text; for these workloads the same ids as `text`'s), else `text`'s."""
    if req.messages is None:
        return list(adapter.tokenize(text))
    return ChatTokenizer(adapter, template).tokens(
        [{"role": r, "content": c} for r, c in req.messages])


def run_seed_bench(*, requests: list[WorkloadItem] | None = None, n_requests: int = 1000,
                   seed: int = 0, model: str | None = None, n_ctx: int = 2048,
                   max_tokens: int | None = None, progress: bool = True,
                   engine: str = "llamacpp", workload: str = "seed",
                   only: tuple[str, ...] | None = None,
                   llama_server: Path | None = None,
                   n_threads: int | None = None) -> dict[str, Any]:
    """Run `requests`, or the `workload` generated by name (`seed`, `chat`), on every mode.

    `llama_server` (the binary `make llama-server` builds) adds llama.cpp's own server as two
    modes: its prompt cache on, and off as its own reference.

    `workload` is recorded in the results either way; `max_tokens` defaults per workload.
    """
    from edgekv.engines import open_adapter
    from edgekv.semantic import MiniLMEmbedder

    if requests is None:
        workload, reqs = load_workload(workload, requests=n_requests, seed=seed,
                                       max_tokens=max_tokens)
    else:
        reqs = requests
    tmp = tempfile.TemporaryDirectory(prefix="edgekv-seed-")
    root = Path(tmp.name)
    adapter = open_adapter(engine, model, n_ctx=n_ctx,
                           n_threads=n_threads or os.cpu_count() or 1, memo_dir=root)
    # every llama.cpp instance gets the adapter's threads, for decode and prefill alike
    threads = adapter.n_threads
    kvs: list[EdgeKV] = []
    modes: dict[str, Any] = {}
    try:
        strict = _open_modes(adapter, engine, n_ctx, threads, root, MiniLMEmbedder(root),
                             kvs, modes, llama_server, only)
        template = adapter.chat_template()
        ref = "plain" if "plain" in modes else "nocache"
        if only is not None:
            unknown = set(only) - set(MODES)
            if unknown:
                raise ConfigError(f"unknown modes {sorted(unknown)}; choose from {MODES}")
        # the reference and nocache (the EdgeKV modes' own cache-off run) always run
        others = tuple(m for m in MODES if m in modes and m != ref
                       and (only is None or m == "nocache" or _wanted(m, only)))
        history = ChatHistory()
        meter = EnergyMeter()
        results: dict[str, Rows] = defaultdict(list)
        filled_reqs: list[WorkloadItem] = []
        prompt_tokens: list[int] = []
        seen: list[np.ndarray] = []  # earlier prompts, and each with its reference answer
        lcp: list[int] = []
        t0 = time.perf_counter()
        for i, req in enumerate(reqs):
            filled, text, tokens = _prepare(req, history, adapter, template, n_ctx)
            filled_reqs.append(filled)
            prompt_tokens.append(len(tokens))
            lcp.append(_longest_common_prefix(tokens, seen))
            # the reference first (chat history needs its answer), then the rest rotating
            order = (ref, *others[i % len(others):], *others[: i % len(others)])
            for name in order:
                meter.start()
                c0 = time.process_time()
                out = modes[name].run(text, tokens, req.max_tokens)
                cpu = time.process_time() - c0
                energy = meter.stop(cpu, out.traffic_bytes)
                results[name].append((out, cpu, energy.joules))
            history.record(req, results[ref][-1][0].text)
            answer = adapter.tokenize(results[ref][-1][0].text, add_bos=False)
            seen += [np.asarray(tokens), np.asarray(list(tokens) + answer)]
            if progress:
                _progress(i + 1, len(reqs), t0)
        energy_source = meter.source
        energy_method = meter.stop(0.0, 0.0).method if energy_source == "estimated" else (
            "RAPL or battery probe")
        res = _summarise(filled_reqs, results, energy_source, energy_method, adapter,
                         time.perf_counter() - t0)
        res.update(_workload_info(workload, reqs, history, prompt_tokens, threads, ref))
        res["llama_server"] = str(llama_server) if llama_server is not None else None
        res["llama_server_resolved"] = {  # what its own log says it ran with
            n: resolved_settings(m.server.log.read_text(errors="replace"))
            for n, m in modes.items() if isinstance(m, LlamaServerMode)}
        res["ttft_stop"] = ("the first sampled token, detokenized, in every mode (the first "
                            "streamed chunk for llama-cpp-python and llama-server)")
        # how much of what could be reused was: the longest common prefix of each prompt with
        # any earlier prompt or prompt + answer (capped one short: the first token is computed)
        res["lcp_tokens"] = sum(lcp)
        for m in res["modes"].values():
            m["reused_share_of_lcp"] = round(m["reused_tokens"] / max(1, sum(lcp)), 4)
        # what the batch-invariance probe decided for this engine build, model and CPU
        res["reuse_granularity"] = {
            "edgekv_strict": strict.granularity, "edgekv_chunk": "chunk",
            "reason": strict.granularity_reason,
            "probe": strict.probe.to_json() if strict.probe is not None else None}
        prefetcher: Any = strict.prefetcher
        prefetcher.drain()
        if "edgekv_strict" in res["modes"]:
            res["modes"]["edgekv_strict"]["prefetch"] = prefetcher.stats()
        return res
    finally:
        for kv in kvs:
            kv.close()
        for name in ("plain", "llama_ram_cache", "state_seq", "llama_server",
                     "llama_server_nocache"):
            if name in modes:
                modes[name].close()
        adapter.close()
        tmp.cleanup()


def _wanted(mode: str, only: tuple[str, ...]) -> bool:
    """Whether `mode` runs when `only` are asked for: those and their own cache-off runs."""
    return mode in only or any(REFERENCE.get(m) == mode for m in only)


def _longest_common_prefix(tokens: list[int], seen: list[np.ndarray]) -> int:
    ids = np.asarray(tokens)
    best = max((common_prefix(s, ids) for s in seen), default=0)
    return min(best, len(tokens) - 1)


def _workload_info(workload: str, reqs: list[WorkloadItem], history: ChatHistory,
                   prompt_tokens: list[int], threads: int, ref: str) -> dict[str, Any]:
    return {
        "workload": workload,
        "conversations": len({r.conversation for r in reqs if r.conversation is not None}),
        "conversation_restarts": history.restarts,
        "history_from": ref,  # whose answers chat turns carry as the assistant's
        "prompt_tokens_mean": round(statistics.fmean(prompt_tokens), 1),
        "prompt_tokens_max": max(prompt_tokens),
        "threads": threads,
    }


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _agreement(rows: Rows, ref: Rows | None) -> float | None:
    """Share of requests whose text equals the reference run's of the same request."""
    if not ref:
        return None
    same = [o.text == r.text for (o, _, _), (r, _, _) in zip(rows, ref)]
    return round(sum(same) / len(same), 4)


def _summarise(reqs: list[WorkloadItem], results: dict[str, Rows], energy_source: str,
               energy_method: str, adapter: Any, wall: float) -> dict[str, Any]:
    base = results["nocache"]
    base_traffic = sum(o.traffic_bytes for o, _, _ in base) or 1
    out: dict[str, Any] = {}
    for name in [m for m in MODES if results.get(m)]:
        rows = results[name]
        ttft = [o.ttft_s * 1000 for o, _, _ in rows]
        total = [o.total_s * 1000 for o, _, _ in rows]
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
            "total_ms_mean": round(statistics.fmean(total), 3),
            "total_ms_p50": round(_pct(total, 0.5), 3),
            "hit_rate": round(sum(o.hit for o, _, _ in rows) / len(rows), 4),
            "hit_rate_by_tier": {t: {"requests": len(h), "share": round(len(h) / len(rows), 4),
                                     "hit_rate": round(sum(h) / len(h), 4)}
                                 for t, h in sorted(tiers.items())},
            # mean ms per request spent on each step to the first token (and saving after it)
            "ttft_breakdown_ms": {
                k: round(statistics.fmean(o.parts.get(k, 0.0) for o, _, _ in rows) * 1000, 3)
                for k in ("lookup", "load", "eval", "save")} if rows[0][0].parts else None,
            "reused_tokens": sum(o.reused for o, _, _ in rows),
            "computed_tokens": sum(o.computed for o, _, _ in rows),
            "approximate_requests": sum(o.approximate for o, _, _ in rows),
            "fidelity": _agreement(rows, results.get(REFERENCE[name]) or base),
            "fidelity_vs_plain": _agreement(rows, results.get("plain")),
            "memory_traffic_bytes": traffic,
            "memory_traffic_ratio": round(traffic / base_traffic, 4),
            # llama-server computes in its own process: this process's CPU is not its cost
            "cpu_s": None if name in OUT_OF_PROCESS else round(sum(c for _, c, _ in rows), 3),
            "energy_j": None if name in OUT_OF_PROCESS else round(joules, 3),
            "energy_mah": None if name in OUT_OF_PROCESS else round(joules_to_mah(joules), 4),
            "energy_source": energy_source,
            "ttft_ms": [round(x, 3) for x in ttft],
            "total_ms": [round(x, 3) for x in total],
            "reused_per_request": [o.reused for o, _, _ in rows],
        }
    for name in out:
        for ref in ("nocache", "plain"):
            if ref in out:
                out[name][f"ttft_speedup_vs_{ref}"] = round(
                    out[ref]["ttft_ms_mean"] / out[name]["ttft_ms_mean"], 3)
    return {
        "bench": "seed",
        "requests": len(reqs),
        "unique_prompts": unique_prompts(reqs),
        "clusters": len({r.cluster for r in reqs}),
        "requests_per_cluster": dict(Counter(r.cluster for r in reqs).most_common()),
        "max_tokens": reqs[0].max_tokens,
        "fidelity_tokens": "first max_tokens greedy tokens (text) equal to the reference run's",
        "fidelity_reference": {**FIDELITY_REFERENCE, "by_mode": {
            m: REFERENCE[m] if REFERENCE[m] in results else "nocache" for m in out}},
        "energy_source": energy_source,
        "energy_method": energy_method,
        "memory_traffic_model": ("prefill up to the first token, per forward batch: weights "
                                 "once + KV written for its tokens + KV read for every attended "
                                 "cell; plus KV bytes the cache reads and writes (fragments or "
                                 "llama states). Counted, not sampled."),
        "model": adapter.model_path.name,
        "engine": adapter.fingerprint.engine,
        "wall_s": round(wall, 1),
        "modes": out,
        "environment": environment(),
    }


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from .plots import seed_table

    name, reqs = load_workload(args.workload, requests=args.requests, seed=args.seed,
                               max_tokens=args.max_tokens)
    res = run_seed_bench(requests=reqs, workload=name, model=args.model, n_ctx=args.n_ctx,
                         engine=args.engine, only=csv(args.modes) or None,
                         llama_server=llama_server_path(args.llama_server),
                         n_threads=args.threads)
    return res, seed_table(res)


def write_report(name: str, res: dict[str, Any], text: str, path: str | None) -> str:
    """The JSON, and a Markdown page with PNG plots beside it (`plots.write_seed_report`)."""
    from .plots import write_seed_report
    from .report import write_json

    out = write_json(path or f"bench-out/{name}.json", res)
    md = write_seed_report(res, out.with_suffix(".md"))
    return f"wrote {out}\nreport: {md} (with PNG plots beside it)"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = bench_parser(sub, "seed", "the seed workload (or a chat one, or a JSONL file) through "
                     "every cache mode: TTFT, hits, fidelity, energy", run_cli, write_report,
                     n_ctx=True, threads="engine threads, the same for every mode "
                     "(default: all cores)")
    p.add_argument("--workload", help="`seed` (default), `chat` (multi-turn, interleaved "
                   "users) or a JSONL file, one {prompt, cluster?, max_tokens?} a line")
    p.add_argument("--requests", type=int,
                   help="number of requests (default 1000; of a file: the first N)")
    p.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    p.add_argument("--modes", help="comma-separated modes to run (default: all; the plain "
                   "reference and nocache always run): " + ", ".join(MODES))
    p.add_argument("--max-tokens", type=int,
                   help="tokens to generate (default: the workload's; chat: 48)")
    p.add_argument("--engine", choices=ENGINES, default="llamacpp",
                   help="the engine under test (LlamaRAMCache only with llamacpp)")
    llama_server_opt(p)
    return p
