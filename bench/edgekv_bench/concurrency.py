"""`edgekv bench serve --concurrency 1,2,4,8`: several clients at once, against servers that
batch them and against EdgeKV one sequence at a time.

Servers, each a real process on loopback with the same model file, threads and context size:

- llama.cpp's `llama-server` built stock (`make llama-server`), run with its defaults (no
  `-np`: its automatic slots, `cache_prompt` on), and again with `--no-cache-prompt` as its own
  cache-off reference;
- `edgekv serve --parallel 1` and `--parallel N` (N: `--parallel`, by default the largest
  concurrency), each with its `--no-cache` reference at the same N.

Two workloads (`concurrent_workload`: a shared system prompt, a document per user), every
prompt rendered with the model's chat template before any server starts, so that every server
answers the same text; the clients and their figures are `clients`.

Each run (server x workload x concurrency c) starts its server afresh on an empty cache
directory: what one level cached cannot speed up the next, and every server is treated alike.
The runs of one level go in rotating server order, so drift of the machine hits all alike. One
server runs at a time; c client threads take requests from one shared queue in order.

EdgeKV's servers run with `EDGEKV_REUSE_GRANULARITY` unset, so they decide by the
batch-invariance probe; its verdict is kept in one shared probe directory and copied into each
run's cache directory, so only the first start measures it (a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekv.errors import ConfigError

from .clients import Reply, agreement, run_level, summarize
from .concurrent_workload import WORKLOADS, Messages, Prompt, build_prompts
from .options import csv, llama_server_path
from .report import table
from .servers import Server, free_port, resolved_settings
from .servers import server_command as sequential_command

__all__ = ["SERVERS", "Setup", "add_options", "parse_concurrency", "ratios", "run_cli",
           "run_concurrency_bench", "tables"]

# name -> (system, cache on?, its cache-off run at the same concurrency, --parallel or None)
# (None: llama-server's own slots; "N": the bench's --parallel)
SERVERS: dict[str, tuple[str, bool, str, str | None]] = {
    "llama_server": ("llama_server", True, "llama_server_nocache", None),
    "llama_server_nocache": ("llama_server", False, "llama_server_nocache", None),
    "edgekv_p1": ("edgekv", True, "edgekv_nocache_p1", "1"),
    "edgekv_nocache_p1": ("edgekv", False, "edgekv_nocache_p1", "1"),
    "edgekv_parallel": ("edgekv", True, "edgekv_nocache_parallel", "N"),
    "edgekv_nocache_parallel": ("edgekv", False, "edgekv_nocache_parallel", "N"),
}
COMPARED = ("edgekv_parallel", "edgekv_p1")  # each set against llama_server, level by level
DEFAULT_REQUESTS = 16
DEFAULT_USERS = 8
SEQ_TOKENS = 1024  # default context per sequence: --n-ctx = this x the most in flight
START_TIMEOUT_S = {"edgekv": 900.0, "llama_server": 600.0}  # EdgeKV's first start probes
EDGEKV_QUEUE = 16  # `edgekv serve --max-queue`'s default; raised only for more clients
METHOD = (
    "each run (server x workload x concurrency) on a freshly started server with an empty "
    "cache directory (EdgeKV: only the probe verdict copied in), nothing warmed, one server "
    "running at a time, the servers of each level in rotating order; c client threads (one "
    "openai client each) take the same requests in order from one queue; prompts built before "
    "any server starts (chat: one deployment's system prompt shared by all users, canned "
    "earlier answers; docs: one deployment document per user), rendered once with the GGUF "
    "chat template, sent to /v1/completions streamed with include_usage, greedy (temperature "
    "0; llama-server also repeat_penalty 1, top_k 1); TTFT = first text chunk; ITL = time "
    "between successive text chunks, pooled over a run's requests (itl_ms_max: the longest); "
    "throughput = completion tokens (usage) / the run's wall time (all clients ready to last "
    "reply); percentiles "
    "nearest-rank; agreement_own_cache_off = share of requests whose text equals the same "
    "server's cache-off run at the same concurrency (null for a cache-off run itself); "
    "agreement_own_cache_off_c1 = that cache-off run against itself at concurrency 1; "
    "resolved = each server's own log; health = GET /health after its first start")

# -- options -------------------------------------------------------------------------------


def parse_concurrency(value: str) -> tuple[int, ...]:
    """`1,2,4,8` as ascending distinct levels, each >= 1."""
    try:
        levels = sorted({int(x) for x in csv(value)})
    except ValueError:
        raise ConfigError(f"--concurrency {value!r}: give whole numbers, e.g. 1,2,4,8") from None
    if not levels or levels[0] < 1:
        raise ConfigError(f"--concurrency {value!r}: every level must be >= 1, e.g. 1,2,4,8")
    return tuple(levels)


def add_options(p: argparse.ArgumentParser) -> None:
    """`bench serve`'s options for the concurrency mode (the others are shared with it)."""
    p.add_argument("--concurrency", help="run the concurrency benchmark instead: clients in "
                   "flight at once, comma-separated (e.g. 1,2,4,8); servers: "
                   + ", ".join(SERVERS) + f"; default --requests {DEFAULT_REQUESTS}, --n-ctx "
                   f"{SEQ_TOKENS} x the largest of the levels and --parallel")
    p.add_argument("--parallel", type=int, help="with --concurrency: edgekv_parallel's "
                   "sequences (`edgekv serve --parallel N`; default: the largest level)")
    p.add_argument("--workloads", default="chat,docs", help="with --concurrency: chat (one "
                   "shared system prompt), docs (a document per user); default chat,docs")
    p.add_argument("--users", type=int, default=DEFAULT_USERS, help="with --concurrency: "
                   f"users the requests come from, in turn (default {DEFAULT_USERS}; docs: "
                   "at most one per deployment document, 8)")
    p.add_argument("--probe-dir", help="with --concurrency: where EdgeKV's probe verdict is "
                   "kept and shared between its servers (default: <cache dir>/probes)")


# -- servers -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    """What every server of a run shares: one model file, threads, context; EdgeKV's slots."""

    model: str
    n_ctx: int
    threads: int
    parallel: int  # edgekv_parallel's --parallel
    llama_server: Path | None
    max_queue: int | None = None  # EdgeKV's --max-queue where the levels pass its default

    def command(self, name: str, cache_dir: Path) -> tuple[list[str], str]:
        """Server `name`'s command line (with `{port}`) and its health path."""
        system, cache, _, slots = SERVERS[name]
        if system == "llama_server":  # the sequential bench's: stock defaults, or cache off
            got = sequential_command(name, model=self.model, n_ctx=self.n_ctx,
                                     threads=self.threads, root=cache_dir,
                                     llama_server=self.llama_server)
            if got is None:
                raise ConfigError(f"{name} needs llama.cpp's llama-server: run `make "
                                  "llama-server` or pass --llama-server (or leave it out of "
                                  "--servers)")
            return got
        # EdgeKV's --n-ctx is each sequence's; with N slots each gets an N-th of the context,
        # as llama-server's slots share its -c
        n = self.parallel if slots == "N" else 1
        cmd = [sys.executable, "-m", "edgekv", "serve", "--model", self.model, "--n-ctx",
               str(self.n_ctx // n), "--port", "{port}", "--cache-dir", str(cache_dir),
               "--threads", str(self.threads), "--parallel", str(n)]
        if self.max_queue is not None:
            cmd += ["--max-queue", str(self.max_queue)]
        return (cmd if cache else cmd + ["--no-cache"]), "/health"


def _edgekv_env() -> dict[str, str]:
    """This process's environment without a forced reuse granularity: the servers probe."""
    return {k: v for k, v in os.environ.items() if k != "EDGEKV_REUSE_GRANULARITY"}


def _share_probes(src: Path, dst: Path) -> None:
    """Copy the probe verdicts in `src` that `dst` lacks (either way round, before a start
    and after a stop)."""
    if not src.is_dir():
        return
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*.json"):
        if not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)


def _health(base_url: str) -> Any:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError) as e:
        return {"error": str(e)}


# -- figures -------------------------------------------------------------------------------


def _over(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """At each (workload, concurrency): EdgeKV's TTFT p95 and throughput over llama-server's
    (the goals at concurrency 4: TTFT ratio <= 1, throughput ratio >= 0.9)."""
    at = {(r["server"], r["workload"], r["concurrency"]): r for r in rows}
    out = []
    for (server, workload, c), r in at.items():
        peer = at.get(("llama_server", workload, c))
        if server in COMPARED and peer is not None:
            out.append({"server": server, "vs": "llama_server", "workload": workload,
                        "concurrency": c,
                        "ttft_p95_ratio": _over(r["ttft_ms_p95"], peer["ttft_ms_p95"]),
                        "throughput_ratio": _over(r["throughput_tok_s"],
                                                  peer["throughput_tok_s"])})
    return out


# -- the run -------------------------------------------------------------------------------


def _wanted(servers: Sequence[str] | None) -> list[str]:
    """The servers asked for with their cache-off references, in table order."""
    wanted = list(SERVERS) if servers is None else list(servers)
    unknown = set(wanted) - set(SERVERS)
    if unknown:
        raise ConfigError(f"unknown servers {sorted(unknown)} with --concurrency; choose from "
                          f"{', '.join(SERVERS)}")
    return [n for n in SERVERS if n in wanted or any(SERVERS[w][2] == n for w in wanted)]


def _measure(setup: Setup, name: str, prompts: Sequence[str], concurrency: int,
             max_tokens: int, run_dir: Path, log: Path, probe_dir: Path
             ) -> tuple[list[Reply], float, float, Any]:
    """One run on a freshly started server: its replies, wall time, start time and /health."""
    import openai

    system = SERVERS[name][0]
    edgekv = system == "edgekv"
    cmd, health_path = setup.command(name, run_dir)
    if edgekv:
        _share_probes(probe_dir, run_dir / "probes")
    port = free_port()
    server = Server(name, [x.replace("{port}", str(port)) for x in cmd], health_path, port, log,
                    env=_edgekv_env() if edgekv else None)

    def client() -> Any:
        return openai.OpenAI(base_url=server.base_url + "/v1", api_key="bench", timeout=900,
                             max_retries=0)

    try:
        start_s = server.start(START_TIMEOUT_S[system])
        health = _health(server.base_url)
        replies, wall = run_level(client, system, prompts, concurrency, max_tokens)
    finally:
        server.stop()
        if edgekv:
            _share_probes(run_dir / "probes", probe_dir)
    return replies, wall, start_s, health


def _prompts(model: str, workloads: Sequence[str], requests: int, users: int, seed: int,
             budget: int) -> dict[str, list[Prompt]]:
    """Each workload's prompts, rendered with the GGUF's own chat template."""
    import llama_cpp

    from edgekv.chat import render_chat

    vocab = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    try:
        template = vocab.metadata.get("tokenizer.chat_template")

        def render(msgs: Messages) -> str:
            return str(render_chat(template, [{"role": r, "content": c} for r, c in msgs]))

        def count(text: str) -> int:
            return len(vocab.tokenize(text.encode(), special=True))

        return {w: build_prompts(w, requests, users=users, seed=seed, budget=budget,
                                 render=render, count=count) for w in workloads}
    finally:
        vocab.close()


def _rows(names: Sequence[str], workloads: Sequence[str], levels: Sequence[int],
          replies: dict[tuple[str, str, int], list[Reply]],
          walls: dict[tuple[str, str, int], float]) -> list[dict[str, Any]]:
    rows = []
    for w in workloads:
        for c in levels:
            for name in names:
                own_name = SERVERS[name][2]
                mine, own = replies[name, w, c], replies[own_name, w, c]
                rows.append({
                    "server": name, "workload": w, "concurrency": c,
                    **summarize(mine, walls[name, w, c]),
                    "agreement_own_cache_off": (None if own_name == name
                                                else agreement(mine, own)),
                    # the cache-off run at c against itself at 1: does batching change it?
                    "agreement_own_cache_off_c1": (agreement(own, replies[own_name, w, 1])
                                                   if 1 in levels else None)})
    return rows


def run_concurrency_bench(*, concurrency: Sequence[int], workdir: Path,
                          model: str | None = None, parallel: int | None = None,
                          requests: int = DEFAULT_REQUESTS, users: int = DEFAULT_USERS,
                          max_tokens: int = 48, n_ctx: int | None = None, seed: int = 0,
                          servers: Sequence[str] | None = None,
                          workloads: Sequence[str] = WORKLOADS,
                          llama_server: Path | None = None, threads: int | None = None,
                          probe_dir: Path | None = None, progress: bool = True
                          ) -> dict[str, Any]:
    """Every server x workload x concurrency level, one run each (see the module doc)."""
    from edgekv.config import default_cache_dir
    from edgekv.engines.models import resolve_model

    from .report import environment

    levels = tuple(sorted(set(concurrency)))
    if not levels or levels[0] < 1:
        raise ConfigError(f"concurrency {list(concurrency)}: every level must be >= 1")
    for label, v in (("--requests", requests), ("--users", users),
                     ("--max-tokens", max_tokens), ("--parallel", parallel)):
        if v is not None and v < 1:
            raise ConfigError(f"{label} {v} must be >= 1")
    if not workloads or set(workloads) - set(WORKLOADS):
        raise ConfigError(f"--workloads {','.join(workloads)}: choose from "
                          f"{', '.join(WORKLOADS)}")
    names = _wanted(servers)
    if llama_server is not None and not llama_server.is_file():
        raise ConfigError(f"{llama_server} does not exist: run `make llama-server`")
    parallel = parallel or levels[-1]
    in_flight = max(levels[-1], parallel)
    n_ctx = n_ctx or SEQ_TOKENS * in_flight
    setup = Setup(str(resolve_model(model)), n_ctx, threads or os.cpu_count() or 1, parallel,
                  llama_server, levels[-1] if levels[-1] > EDGEKV_QUEUE else None)
    commands = {n: setup.command(n, Path("<run dir>"))[0] for n in names}  # checked up front
    probe_dir = probe_dir or default_cache_dir() / "probes"
    prompts = _prompts(setup.model, workloads, requests, users, seed,
                       n_ctx // in_flight - max_tokens)
    workdir.mkdir(parents=True, exist_ok=True)
    replies: dict[tuple[str, str, int], list[Reply]] = {}
    walls: dict[tuple[str, str, int], float] = {}
    health: dict[str, Any] = {}
    starts: dict[str, list[float]] = {n: [] for n in names}
    done, total, t0 = 0, len(names) * len(workloads) * len(levels), time.perf_counter()
    for w in workloads:
        texts = [p.text for p in prompts[w]]
        for i, c in enumerate(levels):
            turn = i % len(names)  # each level's servers in rotating order
            for name in names[turn:] + names[:turn]:
                got = _measure(setup, name, texts, c, max_tokens,
                               workdir / "runs" / name / f"{w}-c{c}", workdir / f"{name}.log",
                               probe_dir)
                replies[name, w, c], walls[name, w, c], start_s, body = got
                starts[name].append(round(start_s, 2))
                health.setdefault(name, body)
                done += 1
                if progress:
                    print(f"\r  {done}/{total} runs ({name} {w} c={c}), "
                          f"{time.perf_counter() - t0:.0f} s", end="" if done < total else "\n",
                          file=sys.stderr, flush=True)
    rows = _rows(names, workloads, levels, replies, walls)
    resolved = {}
    for name in names:
        try:
            resolved[name] = resolved_settings((workdir / f"{name}.log").read_text(
                errors="replace"))
        except OSError:
            resolved[name] = {}
    return {
        "bench": "serve-concurrency", "model": Path(setup.model).name,
        "concurrency": list(levels), "parallel": parallel, "requests": requests,
        "users": users, "max_tokens": max_tokens, "n_ctx": n_ctx, "threads": setup.threads,
        "workloads": list(workloads), "servers": names, "commands": commands,
        "prompt_tokens": {w: [p.tokens for p in prompts[w]] for w in workloads},
        "rows": rows, "ratios": ratios(rows), "resolved": resolved, "health": health,
        "start_s": starts,
        "failed_rows": [f"{r['server']}/{r['workload']}/c{r['concurrency']}"
                        for r in rows if r["failed"]],
        "method": METHOD, "environment": environment(),
    }


def tables(res: dict[str, Any]) -> str:
    """One table per workload, the ratios to llama-server, and the resolved settings."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    def num(x: object) -> str:
        return "-" if x is None else str(x)

    parts = []
    for w in res["workloads"]:
        rows = [[r["server"], r["concurrency"],
                 " / ".join(num(r[k]) for k in ("ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p95")),
                 f"{num(r['itl_ms_mean'])} / {num(r['itl_ms_p95'])} / {num(r['itl_ms_max'])}",
                 num(r["throughput_tok_s"]), pct(r["agreement_own_cache_off"]),
                 pct(r["agreement_own_cache_off_c1"]), r["failed"]]
                for r in res["rows"] if r["workload"] == w]
        parts.append(f"Workload `{w}`, {res['requests']} requests per run:\n\n" + table(
            ["server", "concurrency", "TTFT mean / p50 / p95 ms", "ITL mean / p95 / max ms",
             "tokens/s", "= own cache-off", "own cache-off = its c=1", "failed"], rows))
    if res["ratios"]:
        parts.append("EdgeKV over llama-server (goal at concurrency 4: TTFT p95 <= 1, "
                     "throughput >= 0.9):\n\n" + table(
                         ["server", "workload", "concurrency", "TTFT p95 ratio",
                          "throughput ratio"],
                         [[r["server"], r["workload"], r["concurrency"],
                           num(r["ttft_p95_ratio"]), num(r["throughput_ratio"])]
                          for r in res["ratios"]]))
    settings = [[n, *(res["resolved"].get(n, {}).get(k) or "-" for k in
                      ("flash_attn", "n_slots", "prompt_cache", "threads")),
                 _parallel(res["health"].get(n))]
                for n in res["servers"]]
    parts.append("Resolved settings, from each server's own log and /health:\n\n" + table(
        ["server", "flash attention", "slots", "prompt cache", "threads", "/health parallel"],
        settings))
    return "\n\n".join(parts)


def _parallel(health: Any) -> str:
    """The `parallel` object of a server's /health, where it has one."""
    got = health.get("parallel") if isinstance(health, dict) else None
    return "-" if got is None else json.dumps(got)


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """`edgekv bench serve --concurrency ...`: its options to `run_concurrency_bench`."""
    with tempfile.TemporaryDirectory(prefix="edgekv-serve-concurrency-") as tmp:
        res = run_concurrency_bench(
            concurrency=parse_concurrency(args.concurrency), workdir=Path(tmp),
            model=args.model, parallel=args.parallel,
            requests=args.requests or DEFAULT_REQUESTS, users=args.users,
            max_tokens=args.max_tokens or 48, n_ctx=args.n_ctx, seed=args.seed,
            servers=csv(args.servers) or None, workloads=csv(args.workloads),
            llama_server=llama_server_path(args.llama_server), threads=args.threads,
            probe_dir=Path(args.probe_dir) if args.probe_dir else (
                Path(args.cache_dir) / "probes" if args.cache_dir else None))
    return res, tables(res)
