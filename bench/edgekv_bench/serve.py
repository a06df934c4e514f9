"""`edgekv bench serve`: EdgeKV's server against the servers users run instead, over HTTP.

Real server processes, the real `openai` client, one multi-turn chat workload (users
interleaved, each conversation growing turn by turn with the model's own earlier answers and
a shared long system prompt), side by side in one run:

- `edgekv serve` (cache on, and `--no-cache` as its own reference);
- `python -m llama_cpp.server` with `--cache true` (LlamaRAMCache) and with `--cache false`
  (the reference), on the stock wheel's libraries (`make stock-lib`, loaded through
  LLAMA_CPP_LIB_PATH; where it is not built, EdgeKV's build with its kernel switch unset, and
  the JSON says which) and, given `stock_python`, on the wheel a plain `pip install
  llama-cpp-python` builds in a venv of its own (`make stock-llama-cpp-python`). No peer
  inherits EdgeKV's kernel switch (`servers.peer_env`);
- llama.cpp's `llama-server`, built stock from the llama-cpp-python sdist's vendored tree as
  its users build it (`make llama-server`: default flags, llamafile on, no patch), run with
  its defaults: default slots, `cache_prompt` on, its RAM prompt cache, flash attention
  `auto`; once more with `--cache-reuse 256`, with `--no-cache-prompt`, and with `-fa off`
  (cache on and off), so that a difference in its outputs can be told apart from one in its
  numerics.

Every server gets the same threads, model file and context size. Prompts are rendered once
with the model's chat template and sent to `/v1/completions`, so every server answers the same
text (their chat-template engines differ). The reference, plain llama-cpp-python with no cache,
answers each request first; its answer goes into the conversation's history, so every server
sees the same prompts. EdgeKV's own settings (slots, flash attention, granularity, chunk size)
come from its /health. Requests go one at a time, the servers in rotating order, so machine
drift hits all alike. Mid-run every cache-on server is restarted: what it costs is reported,
and every figure is also given for the requests before the restart (what a steady user sees)
and after it, apart. Each server's resolved settings (flash attention, slots, prompt-cache
size, threads, CPU features) are read from its own log.

With `--concurrency 1,2,4,8` the `concurrency` benchmark runs instead: several clients at once
against llama-server's slots and `edgekv serve --parallel`. The server processes and command
lines both use are in `servers`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekv.errors import ConfigError

from . import concurrency
from .clients import stream_one
from .options import (
    Subparsers,
    bench_parser,
    csv,
    llama_server_opt,
    llama_server_path,
    stock_lib_path,
    stock_python_path,
)
from .report import table, write_json
from .servers import (
    SERVERS,
    Server,
    free_port,
    get_health,
    peer_env,
    peer_lib,
    resolved_settings,
    server_command,
)
from .workload import ChatHistory, chat_workload, render

__all__ = ["SERVERS", "Server", "add_parser", "free_port", "run_cli", "run_serve_bench",
           "serve_table", "server_command"]

REFERENCE = "llama_cpp_server_nocache"  # plain llama-cpp-python: what a user gets, no cache


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    after_restart: bool


def _ask(client: Any, system: str, prompt: str, max_tokens: int,
         after_restart: bool) -> Answer:
    """One greedy streamed completion (`clients.stream_one`, as the concurrency bench asks)."""
    r = stream_one(client, system, prompt, max_tokens)
    return Answer(r.text, r.ttft_s, r.total_s, r.prompt_tokens, r.cached_tokens, after_restart)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else 0.0


def _phase(rows: list[Answer], own: list[Answer], after: bool) -> dict[str, Any] | None:
    """The figures of the requests before (or after) the mid-run restart alone."""
    pairs = [(a, b) for a, b in zip(rows, own) if a.after_restart == after]
    if not pairs:
        return None
    ttft = [a.ttft_s * 1000 for a, _ in pairs]
    return {"requests": len(pairs), "ttft_ms_mean": round(statistics.fmean(ttft), 1),
            "ttft_ms_p50": round(_pct(ttft, 0.5), 1), "ttft_ms_p95": round(_pct(ttft, 0.95), 1),
            "cached_tokens": sum(a.cached_tokens for a, _ in pairs),
            "agreement_own_cache_off": round(sum(a.text == b.text for a, b in pairs)
                                             / len(pairs), 4)}


def _summary(name: str, rows: list[Answer], own: list[Answer], ref: list[Answer],
             server: Server) -> dict[str, Any]:
    ttft = [a.ttft_s * 1000 for a in rows]
    after = [a.ttft_s * 1000 for a in rows if a.after_restart]
    before = [a.ttft_s * 1000 for a in rows if not a.after_restart]
    system, cache, own_name = SERVERS[name]
    try:
        settings = resolved_settings(server.log.read_text(errors="replace"))
    except OSError:
        settings = {}
    return {
        "system": system, "cache": cache, "requests": len(rows),
        "ttft_ms_mean": round(statistics.fmean(ttft), 1),
        "ttft_ms_p50": round(_pct(ttft, 0.5), 1), "ttft_ms_p95": round(_pct(ttft, 0.95), 1),
        "e2e_ms_mean": round(statistics.fmean(a.total_s * 1000 for a in rows), 1),
        "requests_per_s": round(len(rows) / sum(a.total_s for a in rows), 3),
        "prompt_tokens": sum(a.prompt_tokens for a in rows),
        "cached_tokens": sum(a.cached_tokens for a in rows),
        "agreement_own_cache_off": round(
            sum(a.text == b.text for a, b in zip(rows, own)) / len(rows), 4),
        "own_cache_off_run": own_name,
        "agreement_vs_plain": round(
            sum(a.text == b.text for a, b in zip(rows, ref)) / len(rows), 4),
        "start_s": [round(s, 2) for s in server.starts],
        "ttft_ms_mean_after_restart": round(statistics.fmean(after), 1) if after else None,
        "ttft_ms_mean_before_restart": round(statistics.fmean(before), 1) if before else None,
        "before_restart": _phase(rows, own, after=False),
        "after_restart": _phase(rows, own, after=True),
        "resolved": settings,
        "ttft_ms": [round(x, 1) for x in ttft],
        "cached_per_request": [a.cached_tokens for a in rows],
    }


def run_serve_bench(*, model: str | None = None, requests: int = 40, users: int = 6,
                    max_tokens: int = 48, n_ctx: int = 2048, seed: int = 0,
                    restart_at: int | None = None, servers: tuple[str, ...] | None = None,
                    llama_server: Path | None = None, stock_python: Path | None = None,
                    stock_lib: Path | None = None, workdir: Path, threads: int | None = None,
                    progress: bool = True) -> dict[str, Any]:
    import llama_cpp
    import openai

    from edgekv.chat import render_chat
    from edgekv.engines.models import resolve_model

    from .report import environment

    path = str(resolve_model(model))
    threads = threads or os.cpu_count() or 1  # every server gets the same
    default = [n for n in SERVERS if not n.startswith("edgekv_onnx")]  # onnx: on request
    wanted = default if servers is None else list(servers)
    # each wanted server's own cache-off run and the plain reference always run
    names = [n for n in SERVERS if n in wanted or n == REFERENCE
             or any(SERVERS[w][2] == n for w in wanted if w in SERVERS)]
    unknown = set(servers or ()) - set(SERVERS)
    if unknown:
        raise ConfigError(f"unknown servers {sorted(unknown)}; choose from {list(SERVERS)}")
    if llama_server is not None and not llama_server.is_file():
        raise ConfigError(f"{llama_server} does not exist: run `make llama-server`")
    if stock_python is not None and not stock_python.is_file():
        raise ConfigError(f"{stock_python} does not exist: run `make stock-llama-cpp-python`")
    vocab = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    template = vocab.metadata.get("tokenizer.chat_template")
    workdir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, Server] = {}
    health: dict[str, Any] = {}  # EdgeKV's /health after its first start: its settings
    skipped = []
    reqs = chat_workload(requests, seed=seed, max_tokens=max_tokens, users=users)
    restart_at = requests // 2 if restart_at is None else restart_at
    try:
        for name in names:
            got = server_command(name, model=path, n_ctx=n_ctx, threads=threads, root=workdir,
                                 llama_server=llama_server, stock_python=stock_python)
            if got is None:
                skipped.append(name)
                continue
            port = free_port()
            cmd = [c.replace("{port}", str(port)) for c in got[0]]
            procs[name] = Server(name, cmd, got[1], port, workdir / f"{name}.log",
                                 env=peer_env(name, stock_lib))
            procs[name].start()
            if SERVERS[name][0] == "edgekv":
                health[name] = get_health(procs[name].base_url)
        clients = {n: openai.OpenAI(base_url=s.base_url + "/v1", api_key="bench", timeout=900,
                                    max_retries=0) for n, s in procs.items()}
        others = [n for n in procs if n != REFERENCE]
        answers: dict[str, list[Answer]] = {n: [] for n in procs}
        history = ChatHistory()
        t0 = time.perf_counter()
        for i, req in enumerate(reqs):
            filled = history.fill(req)
            prompt = render(filled, template, render_chat)
            if len(vocab.tokenize(prompt.encode(), special=True)) + max_tokens > n_ctx:
                prompt = render(history.restart(req), template, render_chat)
            restarted = i >= restart_at
            if i == restart_at:  # what a restart costs: every cache-on server, same dirs
                for n, s in procs.items():
                    if SERVERS[n][1]:
                        s.stop()
                        s.start()
            order = [REFERENCE, *others[i % len(others):], *others[: i % len(others)]]
            for n in order:
                answers[n].append(_ask(clients[n], SERVERS[n][0], prompt, req.max_tokens,
                                       restarted))
            history.record(req, answers[REFERENCE][-1].text)
            if progress:
                print(f"\r  {i + 1}/{len(reqs)} requests, {time.perf_counter() - t0:.0f} s",
                      end="" if i + 1 < len(reqs) else "\n", file=sys.stderr, flush=True)
        out = {n: _summary(n, answers[n], answers[SERVERS[n][2]], answers[REFERENCE], s)
               for n, s in procs.items()}
        for n, m in out.items():
            m["native"] = peer_lib(n, stock_lib)
            if n in health:
                m["health"] = health[n]
    finally:
        for s in procs.values():
            s.stop()
        vocab.close()
    for n, m in out.items():
        if n != "edgekv" and "edgekv" in out:
            m["edgekv_ttft_ratio"] = round(m["ttft_ms_mean"] / out["edgekv"]["ttft_ms_mean"], 3)
            mine, theirs = out["edgekv"]["before_restart"], m["before_restart"]
            if mine and theirs:  # the steady user's figure: no restart in between
                m["edgekv_ttft_ratio_before_restart"] = round(
                    theirs["ttft_ms_mean"] / mine["ttft_ms_mean"], 3)
    return {
        "bench": "serve", "model": Path(path).name, "requests": len(reqs), "users": users,
        "max_tokens": max_tokens, "n_ctx": n_ctx, "threads": threads, "restart_at": restart_at,
        "reference": REFERENCE, "skipped": skipped,
        "stock_lib": None if stock_lib is None else str(stock_lib),
        "method": ("one request at a time, servers in rotating order; TTFT = first streamed "
                   "text chunk via the openai client; prompts rendered once with the GGUF chat "
                   "template and sent to /v1/completions; greedy (temperature 0; llama.cpp "
                   "servers also repeat_penalty 1, top_k 1); history = the reference's answers; "
                   "every cache-on server restarted before request restart_at; before_restart "
                   "and after_restart give each phase alone; resolved = what each server's "
                   "own log says it ran with"),
        "servers": out, "environment": environment(),
    }


def serve_table(res: dict[str, Any]) -> str:
    """`edgekv bench serve`: one row per server."""
    def phase(m: dict[str, Any], key: str) -> str:
        p = m.get(key)
        return "-" if not p else (f"{p['ttft_ms_mean']} / {p['ttft_ms_p95']} "
                                  f"({100 * p['agreement_own_cache_off']:.0f}%)")

    rows = [[n, phase(m, "before_restart"), m.get("edgekv_ttft_ratio_before_restart", "-"),
             phase(m, "after_restart"), m["ttft_ms_mean"], m["ttft_ms_p95"], m["e2e_ms_mean"],
             f"{m['cached_tokens']}/{m['prompt_tokens']}",
             f"{100 * m['agreement_own_cache_off']:.1f}%",
             f"{100 * m['agreement_vs_plain']:.1f}%", m.get("edgekv_ttft_ratio", "-")]
            for n, m in res["servers"].items()]
    text = table(["server", "before restart: TTFT mean / p95 ms (= own cache-off)",
                  "vs EdgeKV before restart", "after restart: mean / p95 (= own)",
                  "all: TTFT mean", "p95", "e2e mean ms", "cached/prompt tokens",
                  "= own cache-off", "= plain", "all: vs EdgeKV"], rows)
    settings = [[n, *(m.get("resolved", {}).get(k) or "-" for k in
                      ("flash_attn", "n_slots", "prompt_cache", "threads", "system_info"))]
                for n, m in res["servers"].items()]
    return text + "\n\nResolved settings, from each server's own log:\n\n" + table(
        ["server", "flash attention", "slots", "prompt cache", "threads", "system info"],
        settings)


def write_report(name: str, res: dict[str, Any], text: str, path: str | None) -> str:
    """The JSON and a Markdown page of the tables (the page has no heading of its own)."""
    out = write_json(path or f"bench-out/{name}.json", res)
    md = out.with_suffix(".md")
    md.write_text(text + "\n")
    return f"wrote {out} and {md}"


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """`edgekv bench serve`: its options to `run_serve_bench`, the result and its tables; with
    `--concurrency`, the concurrency benchmark's instead."""
    if args.concurrency:
        return concurrency.run_cli(args)
    servers = csv(args.servers) or None
    with tempfile.TemporaryDirectory(prefix="edgekv-serve-bench-") as tmp:
        res = run_serve_bench(model=args.model, requests=args.requests or 40,
                              max_tokens=args.max_tokens or 48, n_ctx=args.n_ctx or 2048,
                              seed=args.seed, servers=servers, workdir=Path(tmp),
                              llama_server=llama_server_path(args.llama_server),
                              stock_python=stock_python_path(args.stock_python),
                              stock_lib=stock_lib_path(args.stock_lib),
                              threads=args.threads)
    return res, serve_table(res)


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = bench_parser(sub, "serve", "EdgeKV's server against llama-cpp-python's and llama.cpp's "
                     "servers, over HTTP (the openai client, a multi-turn chat)", run_cli,
                     write_report, n_ctx=True,
                     threads="engine threads, the same for every server (default: all cores)")
    p.set_defaults(n_ctx=None)  # 2048, or with --concurrency enough for every sequence
    p.add_argument("--servers", help="comma-separated servers (default: all; the cache-off "
                   "references always run): " + ", ".join(SERVERS)
                   + "; with --concurrency: " + ", ".join(concurrency.SERVERS))
    llama_server_opt(p)
    p.add_argument("--stock-python", help="the Python of a venv with llama-cpp-python as a "
                   "plain `pip install` builds it (default: build/stock-venv/bin/python, which "
                   "`make stock-llama-cpp-python` builds, where present)")
    p.add_argument("--stock-lib", help="the stock wheel's native libraries for the "
                   "llama_cpp_server peers (default: build/stock-lib, which `make stock-lib` "
                   "builds, where present; else EdgeKV's build with its switch unset)")
    p.add_argument("--requests", type=int, help="requests (default 40; with --concurrency, "
                   f"per run: {concurrency.DEFAULT_REQUESTS})")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default 48)")
    p.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    concurrency.add_options(p)
    return p
