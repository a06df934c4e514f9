"""`edgekv bench serve --concurrency 1,2,4,8,16 --rate ...`: several clients at once, or
requests arriving at a rate, against servers that batch them.

Servers, each a real process on loopback with the same model file, threads and context size:

- llama.cpp's `llama-server` built stock (`make llama-server`), run with its defaults (no
  `-np`: its automatic slots, `cache_prompt` on), and again with `--no-cache-prompt` as its own
  cache-off reference; its environment has no `GGML_CPU_BATCH_INVARIANT` (EdgeKV's engine
  sets it in its own process, and a child would inherit it);
- `edgekv`: `edgekv serve --parallel N` (N: `--parallel`, default 4, llama-server's slots),
  with `edgekv_nocache` (`--no-cache`) at the same N; `edgekv_p1` / `edgekv_nocache_p1`:
  one request at a time; `edgekv_budget_off`: `--step-budget-ms 0`, prefill in pieces of 512
  tokens beside running generations, the planner before stall-free prefill (on request);
  `edgekv_write_through`: `--no-write-behind`, each answer's disk writes on its slot's thread
  (before the writer thread, on request).

The workloads are `concurrent_workload`'s (chat, docs, gsp, multiround), every prompt rendered
with the model's chat template before any server starts, so that every server answers the
same text. The load is `load`'s: closed loop at each concurrency, open loop (Poisson) at each
rate. `--rate knee` finds llama-server's knee per workload first (`find_knee`) and runs 0.5x,
1x and 1.5x of it; a workload where it misses the SLO on over a tenth of the requests one
at a time has no knee and no rate runs. Each run's figures are vLLM's (`load.figures`: TTFT,
TPOT, ITL, E2EL, throughput, goodput against `--slo`), in `load_rows`; the concurrency levels'
older figures stay in `rows`.

Each run (server x workload x load) starts its server afresh on an empty cache directory:
what one run cached cannot speed up the next, and every server is treated alike. The runs of
one load go in rotating server order, so drift of the machine hits all alike. One server runs
at a time.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekv.errors import ConfigError

from .clients import Reply, agreement, summarize
from .concurrent_workload import DEFAULT_USERS, WORKLOADS, Messages, Prompt, Shape, build_prompts
from .load import DEFAULT_SLO, Slo, run_closed, run_open
from .load import figures as load_figures
from .options import csv, llama_server_path
from .report import table
from .servers import Server, free_port, get_health, peer_env, resolved_settings
from .servers import server_command as sequential_command

__all__ = ["DEFAULT_SERVERS", "SERVERS", "Load", "Setup", "add_options", "find_knee",
           "load_rows", "parse_concurrency", "parse_rates", "ratios", "run_cli",
           "run_concurrency_bench", "tables"]

# name -> (system, cache on?, its cache-off run at the same load, --parallel or None)
# (None: llama-server's own slots; "N": the bench's --parallel)
SERVERS: dict[str, tuple[str, bool, str, str | None]] = {
    "llama_server": ("llama_server", True, "llama_server_nocache", None),
    "llama_server_nocache": ("llama_server", False, "llama_server_nocache", None),
    "edgekv": ("edgekv", True, "edgekv_nocache", "N"),
    "edgekv_nocache": ("edgekv", False, "edgekv_nocache", "N"),
    "edgekv_p1": ("edgekv", True, "edgekv_nocache_p1", "1"),
    "edgekv_nocache_p1": ("edgekv", False, "edgekv_nocache_p1", "1"),
    "edgekv_budget_off": ("edgekv", True, "edgekv_nocache", "N"),
    "edgekv_write_through": ("edgekv", True, "edgekv_nocache", "N"),
}
ALIASES = {"edgekv_parallel": "edgekv", "edgekv_nocache_parallel": "edgekv_nocache"}  # older
DEFAULT_SERVERS = ("llama_server", "edgekv")  # with their cache-off runs
COMPARED = ("edgekv", "edgekv_p1", "edgekv_budget_off",  # each against llama_server
            "edgekv_write_through")
DEFAULT_REQUESTS = 16
DEFAULT_PARALLEL = 4  # llama-server's default slots, and `edgekv serve`'s
KNEE_GOODPUT = 0.9  # the knee: goodput under this share of the rate the run achieved
KNEE_STEP = 1.5  # the knee search's rate factor
KNEE_RUNS = 8  # the most rates the search tries
SEQ_TOKENS = 1024  # default context per sequence: --n-ctx = this x the most in flight
START_TIMEOUT_S = {"edgekv": 900.0, "llama_server": 600.0}  # EdgeKV's first start probes
EDGEKV_QUEUE = 16  # `edgekv serve --max-queue`'s default; raised only for more clients
METHOD = (
    "each run (server x workload x load) on a freshly started server with an empty "
    "cache directory (EdgeKV: only the probe verdict copied in), nothing warmed, one server "
    "running at a time, the servers of each load in rotating order; concurrency c: c client "
    "threads (one openai client each) take the same requests in order from one queue (closed "
    "loop); rate R: requests sent at seeded Poisson arrival times, a thread each (open loop); "
    "a multiround request is sent only after its user's last round answered; prompts built "
    "before any server starts (chat: one deployment's system prompt shared by all users, "
    "canned earlier answers; docs: one document per user; gsp: SGLang's generated shared "
    "prefix; multiround: LMCache's multi-round QA, canned answers), rendered once with the "
    "GGUF chat template, sent to /v1/completions streamed with include_usage, greedy "
    "(temperature 0; llama-server also repeat_penalty 1, top_k 1); TTFT = first text chunk; "
    "TPOT = (E2EL - TTFT) / (completion tokens - 1) per request; ITL = time between "
    "successive text chunks, pooled over a run's requests (itl_ms_max: the longest); E2EL = "
    "send to last chunk; output_tok_s = completion tokens (usage) / the run's wall time (all "
    "clients ready, or the first arrival, to the last reply); goodput_rps = requests meeting "
    "the SLO (TTFT and TPOT at most its figures; a failed request misses) / wall time; "
    "percentiles nearest-rank; reused_prompt_share = cached prompt tokens (usage "
    "prompt_tokens_details.cached_tokens) / prompt tokens; equal_own_cache_off = share of "
    "requests whose text equals the same server's cache-off run at the same load (null for a "
    "cache-off run itself); equal_own_c1 = share equal to the same server's own run at "
    "concurrency 1; the knee (--rate knee) = the lowest rate tried, from llama-server's "
    "concurrency-1 service rate up by 1.5x (or down where that one misses), at which its "
    "goodput falls under 90% of the request rate the run achieved; resolved = each server's "
    "own log; health = GET /health after its first start (EdgeKV: slots, granularity, flash "
    "attention, chunk size, step budget)")


@dataclass(frozen=True, slots=True)
class Load:
    """How one run offers its requests: `concurrency` clients (closed loop) or `rate`
    requests/s (open loop, Poisson)."""

    kind: str  # "concurrency" or "rate"
    value: float

    def __post_init__(self) -> None:
        if self.kind not in ("concurrency", "rate") or self.value <= 0:
            raise ConfigError(f"a load is concurrency or rate > 0, not {self.kind} "
                              f"{self.value}")

    @property
    def label(self) -> str:
        return f"c{int(self.value)}" if self.kind == "concurrency" else f"r{self.value:g}"

    def row(self) -> dict[str, Any]:
        """The row keys that say which load: `concurrency` or `rate`, the other null."""
        return {"concurrency": int(self.value) if self.kind == "concurrency" else None,
                "rate": round(self.value, 4) if self.kind == "rate" else None}

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


def parse_rates(value: str) -> tuple[float, ...] | str:
    """`0.2,0.5` as ascending distinct rates > 0, or "knee" (`find_knee`)."""
    if value.strip() == "knee":
        return "knee"
    try:
        rates = sorted({float(x) for x in csv(value)})
    except ValueError:
        raise ConfigError(f"--rate {value!r}: give requests per second, e.g. 0.25,0.5, or "
                          "knee") from None
    if not rates or rates[0] <= 0:
        raise ConfigError(f"--rate {value!r}: every rate must be > 0, e.g. 0.25,0.5, or knee")
    return tuple(rates)


_SHAPE = Shape()  # the workloads' default sizes, for the options' help


def add_options(p: argparse.ArgumentParser) -> None:
    """`bench serve`'s options for the load mode (the others are shared with it)."""
    p.add_argument("--concurrency", help="run the load benchmark instead: clients in "
                   "flight at once, comma-separated (e.g. 1,2,4,8,16); servers: "
                   + ", ".join(SERVERS) + f"; default --requests {DEFAULT_REQUESTS}, --n-ctx "
                   f"{SEQ_TOKENS} x the most in flight")
    p.add_argument("--rate", help="the load benchmark at Poisson arrival rates too (or "
                   "alone): requests/s, comma-separated, or `knee`: llama-server's knee per "
                   "workload (goodput under 90%% of the rate), then 0.5x, 1x and 1.5x of it; "
                   "none where it misses the SLO on over 10%% one at a time")
    p.add_argument("--duration", type=float, help="with --rate: requests = rate x this "
                   "many seconds (default: --requests)")
    p.add_argument("--slo", default=str(DEFAULT_SLO), help="the latency target goodput "
                   f"counts (default {DEFAULT_SLO})")
    p.add_argument("--parallel", type=int, help="edgekv's slots (`edgekv serve --parallel N`;"
                   f" default {DEFAULT_PARALLEL}, as llama-server's)")
    p.add_argument("--workloads", default="chat,docs", help="with --concurrency/--rate: chat "
                   "(one shared system prompt), docs (a document per user), gsp (SGLang's "
                   "generated shared prefix), multiround (LMCache's multi-round QA); default "
                   "chat,docs")
    p.add_argument("--users", type=int, help="users the requests come from, in turn "
                   "(default: chat 8, docs 16, at most one per document, multiround 8)")
    p.add_argument("--rounds", type=int, default=_SHAPE.rounds, help="multiround: questions "
                   f"per user (default {_SHAPE.rounds})")
    p.add_argument("--gsp-groups", type=int, default=_SHAPE.gsp_groups,
                   help=f"gsp: shared system prompts (default {_SHAPE.gsp_groups})")
    p.add_argument("--gsp-prompts-per-group", type=int, default=_SHAPE.gsp_prompts_per_group,
                   help=f"gsp: questions per group (default {_SHAPE.gsp_prompts_per_group})")
    p.add_argument("--gsp-system-prompt-len", type=int, default=_SHAPE.gsp_system_tokens,
                   help=f"gsp: system prompt tokens (default {_SHAPE.gsp_system_tokens})")
    p.add_argument("--gsp-question-len", type=int, default=_SHAPE.gsp_question_tokens,
                   help=f"gsp: question tokens (default {_SHAPE.gsp_question_tokens}); the "
                   "output length is --max-tokens")
    p.add_argument("--probe-dir", help="where EdgeKV's probe verdict is kept and shared "
                   "between its servers (default: <cache dir>/probes)")


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
        name = ALIASES.get(name, name)
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
        if name == "edgekv_budget_off":
            cmd += ["--step-budget-ms", "0"]
        if name == "edgekv_write_through":
            cmd += ["--no-write-behind"]
        return (cmd if cache else cmd + ["--no-cache"]), "/health"


def _edgekv_env() -> dict[str, str]:
    """This process's environment without a forced reuse granularity: the servers probe,
    whole before the first answer where no verdict is recorded yet (a staged first start
    would serve its first run one request at a time, whole chunks, while the rest runs)."""
    env = {k: v for k, v in os.environ.items() if k != "EDGEKV_REUSE_GRANULARITY"}
    return env | {"EDGEKV_FIRST_PROBE": "full"}



def _share_probes(src: Path, dst: Path) -> None:
    """Copy the probe verdicts in `src` that `dst` lacks (either way round, before a start
    and after a stop)."""
    if not src.is_dir():
        return
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*.json"):
        if not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)


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


def load_rows(names: Sequence[str], workloads: Sequence[str], loads: dict[str, list[Load]],
              replies: dict[tuple[str, str, str], list[Reply]],
              walls: dict[tuple[str, str, str], float], slo: Slo,
              rss: dict[tuple[str, str, str], float | None] | None = None
              ) -> list[dict[str, Any]]:
    """One row per (workload, load, server): `load.figures`, and the share of its outputs
    equal to the same server's cache-off run at the same load and to its own run at
    concurrency 1 (null where that run is the row itself or did not run); the server's
    memory high-water mark."""
    c1 = Load("concurrency", 1).label
    out = []
    for w in workloads:
        for load in loads[w]:
            for name in names:
                mine = replies.get((name, w, load.label))
                if mine is None:
                    continue
                own_name = SERVERS[name][2]
                own = replies.get((own_name, w, load.label))
                alone = replies.get((name, w, c1))
                out.append({
                    "workload": w, **load.row(), "server": name,
                    **load_figures(mine, walls[name, w, load.label], slo),
                    "equal_own_cache_off": (None if own_name == name or own is None
                                            else agreement(mine, own)),
                    "equal_own_c1": (None if alone is None or load.label == c1
                                     else agreement(mine, alone)),
                    "server_rss_peak_mib": (rss or {}).get((name, w, load.label))})
    return out


# -- the run -------------------------------------------------------------------------------


def _wanted(servers: Sequence[str] | None) -> list[str]:
    """The servers asked for (older names taken) with their cache-off references, in table
    order."""
    wanted = list(DEFAULT_SERVERS) if servers is None else [ALIASES.get(s, s) for s in servers]
    unknown = set(wanted) - set(SERVERS)
    if unknown:
        raise ConfigError(f"unknown servers {sorted(unknown)} with --concurrency/--rate; "
                          f"choose from {', '.join(SERVERS)}")
    return [n for n in SERVERS if n in wanted or any(SERVERS[w][2] == n for w in wanted)]


@dataclass
class _Runner:
    """What every run of one bench shares, and what the runs measured."""

    setup: Setup
    workdir: Path
    probe_dir: Path
    max_tokens: int
    seed: int
    replies: dict[tuple[str, str, str], list[Reply]] = field(default_factory=dict)
    walls: dict[tuple[str, str, str], float] = field(default_factory=dict)
    health: dict[str, Any] = field(default_factory=dict)
    starts: dict[str, list[float]] = field(default_factory=dict)
    rss: dict[tuple[str, str, str], float | None] = field(default_factory=dict)

    def measure(self, name: str, workload: str, prompts: Sequence[Prompt], load: Load,
                log_name: str | None = None) -> tuple[list[Reply], float]:
        """One run on a freshly started server: its replies and wall time (kept, and its start
        time and first /health)."""
        import openai

        system = SERVERS[name][0]
        edgekv = system == "edgekv"
        run_dir = self.workdir / "runs" / name / f"{workload}-{load.label}"
        cmd, health_path = self.setup.command(name, run_dir)
        if edgekv:
            _share_probes(self.probe_dir, run_dir / "probes")
        port = free_port()
        server = Server(name, [x.replace("{port}", str(port)) for x in cmd], health_path,
                        port, self.workdir / f"{log_name or name}.log",
                        env=_edgekv_env() if edgekv else peer_env(name))

        def client() -> Any:
            return openai.OpenAI(base_url=server.base_url + "/v1", api_key="bench",
                                 timeout=900, max_retries=0)

        texts = [p.text for p in prompts]
        after = [p.after for p in prompts]
        try:
            start_s = server.start(START_TIMEOUT_S[system])
            self.health.setdefault(name, get_health(server.base_url))
            if load.kind == "concurrency":
                got = run_closed(client, system, texts, int(load.value), self.max_tokens, after)
            else:
                got = run_open(client, system, texts, load.value, self.max_tokens, after,
                               seed=self.seed)
            if log_name is None:
                self.rss[name, workload, load.label] = _peak_rss_mib(server)
        finally:
            server.stop()
            if edgekv:
                _share_probes(run_dir / "probes", self.probe_dir)
        self.starts.setdefault(name, []).append(round(start_s, 2))
        if log_name is None:
            self.replies[name, workload, load.label], self.walls[name, workload, load.label] = got
        return got


def _peak_rss_mib(server: Server) -> float | None:
    """The server process's resident-memory high-water mark (VmHWM), MiB; None where
    /proc does not say."""
    try:
        pid = server.proc.pid if server.proc is not None else None
        status = Path(f"/proc/{pid}/status").read_text() if pid else ""
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def find_knee(runner: _Runner, workload: str, prompts: Sequence[Prompt], slo: Slo,
              service_rps: float, alone_slo_met: float | None = None,
              ) -> tuple[float | None, list[dict[str, Any]]]:
    """llama-server's knee on `workload`: from `service_rps` (its concurrency-1 request rate)
    up by `KNEE_STEP` while its goodput holds `KNEE_GOODPUT` of the rate it achieved, or down
    while it does not; the lowest rate tried where it does not, and every try. None, with no
    try, where it met the SLO on under `KNEE_GOODPUT` of the requests one at a time
    (`alone_slo_met`): no rate does better than no queueing, so every rate is past a knee and
    the search would only go down to ever longer runs."""
    trace: list[dict[str, Any]] = []
    if alone_slo_met is not None and alone_slo_met < KNEE_GOODPUT:
        return None, trace

    def holds(rate: float) -> bool:
        replies, wall = runner.measure("llama_server", workload, prompts, Load("rate", rate),
                                       log_name="llama_server-knee")
        f = load_figures(replies, wall, slo)
        ok = bool(f["goodput_rps"] is not None and f["requests_per_s"]
                  and f["goodput_rps"] >= KNEE_GOODPUT * f["requests_per_s"])
        trace.append({"rate": round(rate, 4), "goodput_rps": f["goodput_rps"],
                      "requests_per_s": f["requests_per_s"], "slo_met": f["slo_met"],
                      "holds": ok})
        return ok

    rate = service_rps
    if holds(rate):
        for _ in range(KNEE_RUNS - 1):
            rate *= KNEE_STEP
            if not holds(rate):
                return rate, trace
        return rate, trace  # it held everywhere tried: the highest
    for _ in range(KNEE_RUNS - 1):
        lower = rate / KNEE_STEP
        if holds(lower):
            return rate, trace
        rate = lower
    return rate, trace


def _prompts(model: str, workloads: Sequence[str], requests: int, users: int | None,
             seed: int, budget: int, shape: Shape) -> dict[str, list[Prompt]]:
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

        return {w: build_prompts(w, requests, users=users or DEFAULT_USERS.get(w, 8),
                                 seed=seed, budget=budget, render=render, count=count,
                                 shape=shape) for w in workloads}
    finally:
        vocab.close()


def _rows(names: Sequence[str], workloads: Sequence[str], levels: Sequence[int],
          replies: dict[tuple[str, str, str], list[Reply]],
          walls: dict[tuple[str, str, str], float]) -> list[dict[str, Any]]:
    """The concurrency levels' rows in the older shape (`clients.summarize`)."""
    rows = []
    for w in workloads:
        for c in levels:
            label, c1 = Load("concurrency", c).label, Load("concurrency", 1).label
            for name in names:
                own_name = SERVERS[name][2]
                mine, own = replies[name, w, label], replies[own_name, w, label]
                rows.append({
                    "server": name, "workload": w, "concurrency": c,
                    **summarize(mine, walls[name, w, label]),
                    "agreement_own_cache_off": (None if own_name == name
                                                else agreement(mine, own)),
                    # the cache-off run at c against itself at 1: does batching change it?
                    "agreement_own_cache_off_c1": (agreement(own, replies[own_name, w, c1])
                                                   if 1 in levels else None)})
    return rows


def _service_rate(runner: _Runner, workload: str, prompts: Sequence[Prompt],
                  slo: Slo) -> tuple[float, float | None]:
    """llama-server's requests/s one at a time on `workload` (its concurrency-1 run, made here
    if the levels left it out), and the share of those requests that met `slo`."""
    key = ("llama_server", workload, Load("concurrency", 1).label)
    got = runner.replies.get(key)
    if got is None:
        got, wall = runner.measure("llama_server", workload, prompts, Load("concurrency", 1),
                                   log_name="llama_server-knee")
    else:
        wall = runner.walls[key]
    ok = sum(r.error is None for r in got)
    if not ok:
        raise ConfigError(f"llama-server answered none of the {workload} requests one at a "
                          "time: no knee to find")
    return ok / wall, load_figures(got, wall, slo)["slo_met"]


def run_concurrency_bench(*, concurrency: Sequence[int], workdir: Path,
                          model: str | None = None, parallel: int | None = None,
                          requests: int = DEFAULT_REQUESTS, users: int | None = None,
                          max_tokens: int = 48, n_ctx: int | None = None, seed: int = 0,
                          servers: Sequence[str] | None = None,
                          workloads: Sequence[str] = ("chat", "docs"),
                          llama_server: Path | None = None, threads: int | None = None,
                          probe_dir: Path | None = None, progress: bool = True,
                          rates: Sequence[float] | str = (), duration: float | None = None,
                          slo: Slo = DEFAULT_SLO, shape: Shape | None = None
                          ) -> dict[str, Any]:
    """Every server x workload x load, one run each (see the module doc)."""
    from edgekv.config import default_cache_dir
    from edgekv.engines.models import resolve_model

    from .report import environment

    levels = tuple(sorted(set(concurrency)))
    if levels and levels[0] < 1:
        raise ConfigError(f"concurrency {list(concurrency)}: every level must be >= 1")
    if not levels and not rates:
        raise ConfigError("give --concurrency levels, --rate rates, or both")
    for label, v in (("--requests", requests), ("--users", users),
                     ("--max-tokens", max_tokens), ("--parallel", parallel),
                     ("--duration", duration)):
        if v is not None and v <= 0:
            raise ConfigError(f"{label} {v} must be >= 1")
    if not workloads or set(workloads) - set(WORKLOADS):
        raise ConfigError(f"--workloads {','.join(workloads)}: choose from "
                          f"{', '.join(WORKLOADS)}")
    names = _wanted(servers)
    knee = rates == "knee"
    if knee and "llama_server" not in names:
        raise ConfigError("--rate knee is llama-server's knee: keep llama_server in --servers")
    if llama_server is not None and not llama_server.is_file():
        raise ConfigError(f"{llama_server} does not exist: run `make llama-server`")
    shape = shape or Shape()
    parallel = parallel or DEFAULT_PARALLEL
    in_flight = max(levels[-1] if levels else 1, parallel)
    n_ctx = n_ctx or SEQ_TOKENS * in_flight
    if isinstance(rates, str) and not knee:
        raise ConfigError(f"rates {rates!r}: give rates per second or 'knee'")
    fixed: tuple[float, ...] = () if isinstance(rates, str) else tuple(sorted(set(rates)))
    most = max([requests, *(int(r * duration) + 1 for r in fixed if duration)])
    queue = max(levels[-1] if levels else 0, most if rates else 0)
    setup = Setup(str(resolve_model(model)), n_ctx, threads or os.cpu_count() or 1, parallel,
                  llama_server, queue if queue > EDGEKV_QUEUE else None)
    commands = {n: setup.command(n, Path("<run dir>"))[0] for n in names}  # checked up front
    prompts = _prompts(setup.model, workloads, requests, users, seed,
                       n_ctx // in_flight - max_tokens, shape)
    workdir.mkdir(parents=True, exist_ok=True)
    runner = _Runner(setup, workdir, probe_dir or default_cache_dir() / "probes", max_tokens,
                     seed)
    loads: dict[str, list[Load]] = {}
    knees: dict[str, Any] = {}
    t0 = time.perf_counter()
    done = 0
    for w in workloads:
        loads[w] = [Load("concurrency", c) for c in levels]
        todo = list(loads[w])
        if fixed:
            todo += [Load("rate", r) for r in fixed]
        for i, load in enumerate(todo):
            if load.kind == "rate" and duration:
                n = max(1, int(load.value * duration))
                ps = [prompts[w][j % len(prompts[w])] for j in range(n)]
            else:
                ps = prompts[w]
            _run_all(runner, names, w, ps, load, i)
            done += 1
            if progress:
                print(f"\r  {w} {load.label}: {done} loads, {time.perf_counter() - t0:.0f} s",
                      end="", file=sys.stderr, flush=True)
        if knee:
            rps, met = _service_rate(runner, w, prompts[w], slo)
            k, trace = find_knee(runner, w, prompts[w], slo, rps, met)
            knees[w] = {"knee_rps": None if k is None else round(k, 4), "trace": trace}
            if k is None:
                knees[w]["none"] = (f"llama-server met the SLO on {met} of the requests one at "
                                    f"a time: under {KNEE_GOODPUT:.0%} at any rate, so no rate "
                                    "runs")
            todo = [] if k is None else [Load("rate", k * f) for f in (0.5, 1.0, 1.5)]
            for i, load in enumerate(todo):
                _run_all(runner, names, w, prompts[w], load, i)
        loads[w] += [x for x in todo if x.kind == "rate"]
    if progress:
        print(file=sys.stderr)
    resolved = {}
    for name in names:
        try:
            resolved[name] = resolved_settings((workdir / f"{name}.log").read_text(
                errors="replace"))
        except OSError:
            resolved[name] = {}
    rows = _rows(names, workloads, levels, runner.replies, runner.walls) if levels else []
    return {
        "bench": "serve-concurrency", "model": Path(setup.model).name,
        "concurrency": list(levels), "rates": {w: [x.value for x in loads[w]
                                                   if x.kind == "rate"] for w in workloads},
        "knee": knees, "slo": slo.as_dict(), "parallel": parallel, "requests": requests,
        "requests_per_workload": {w: len(prompts[w]) for w in workloads},
        "users": users, "shape": {k: getattr(shape, k) for k in shape.__dataclass_fields__},
        "max_tokens": max_tokens, "n_ctx": n_ctx, "threads": setup.threads,
        "workloads": list(workloads), "servers": names, "commands": commands,
        "prompt_tokens": {w: [p.tokens for p in prompts[w]] for w in workloads},
        "rows": rows, "ratios": ratios(rows),
        "load_rows": load_rows(names, workloads, loads, runner.replies, runner.walls, slo,
                               runner.rss),
        "resolved": resolved, "health": runner.health, "start_s": runner.starts,
        "failed_rows": [f"{r['server']}/{r['workload']}/c{r['concurrency']}"
                        for r in rows if r["failed"]],
        "method": METHOD, "environment": environment(),
    }


def _run_all(runner: _Runner, names: Sequence[str], workload: str,
             prompts: Sequence[Prompt], load: Load, turn: int) -> None:
    """Every server at one load, in an order rotated by `turn`."""
    k = turn % len(names)
    for name in [*names[k:], *names[:k]]:
        runner.measure(name, workload, prompts, load)


def tables(res: dict[str, Any]) -> str:
    """One table per workload (every load), the ratios to llama-server, the knees and the
    resolved settings."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    def num(x: object) -> str:
        return "-" if x is None else str(x)

    parts = []
    load_rows_ = res.get("load_rows") or []
    for w in res["workloads"]:
        rows = [[r["server"], f"c={r['concurrency']}" if r["concurrency"] is not None
                 else f"{r['rate']}/s", r["requests"],
                 " / ".join(num(r[k]) for k in ("ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99")),
                 f"{num(r['tpot_ms_mean'])} / {num(r['tpot_ms_p99'])}",
                 f"{num(r['itl_ms_p50'])} / {num(r['itl_ms_p99'])} / {num(r['itl_ms_max'])}",
                 num(r["e2el_ms_mean"]), num(r["output_tok_s"]), num(r["goodput_rps"]),
                 pct(r["reused_prompt_share"]), pct(r["equal_own_cache_off"]),
                 pct(r["equal_own_c1"]), r["failed"]]
                for r in load_rows_ if r["workload"] == w]
        if rows:
            parts.append(f"Workload `{w}` ({res.get('requests_per_workload', {}).get(w, '?')} "
                         f"requests a run, SLO {load_rows_[0]['slo']}):\n\n" + table(
                             ["server", "load", "requests", "TTFT mean / p50 / p99 ms",
                              "TPOT mean / p99 ms", "ITL p50 / p99 / max ms", "E2EL mean ms",
                              "output tok/s", "goodput req/s", "reused prompt",
                              "= own cache-off", "= own c=1", "failed"], rows))
    for w, k in (res.get("knee") or {}).items():
        if k["knee_rps"] is None:
            parts.append(f"llama-server's knee on `{w}`: none ({k.get('none', '')})")
            continue
        parts.append(f"llama-server's knee on `{w}`: {k['knee_rps']} requests/s (tried: "
                     + ", ".join(f"{t['rate']}/s goodput {t['goodput_rps']}"
                                 f"{'' if t['holds'] else ' (under 90%)'}" for t in k["trace"])
                     + ")")
    if res["ratios"]:
        parts.append("EdgeKV over llama-server by concurrency (TTFT p95, throughput):\n\n"
                     + table(["server", "workload", "concurrency", "TTFT p95 ratio",
                              "throughput ratio"],
                             [[r["server"], r["workload"], r["concurrency"],
                               num(r["ttft_p95_ratio"]), num(r["throughput_ratio"])]
                              for r in res["ratios"]]))
    settings = [[n, *(res["resolved"].get(n, {}).get(k) or "-" for k in
                      ("flash_attn", "n_slots", "prompt_cache", "threads")),
                 _parallel(res["health"].get(n))]
                for n in res["servers"]]
    parts.append("Resolved settings, from each server's own log and /health:\n\n" + table(
        ["server", "flash attention", "slots", "prompt cache", "threads", "/health"],
        settings))
    return "\n\n".join(parts)


def _parallel(health: Any) -> str:
    """What a server's /health says it runs with: EdgeKV's slots and engine settings."""
    if not isinstance(health, dict):
        return "-"
    got = {k: health[k] for k in ("parallel",) if health.get(k) is not None}
    engine = health.get("engine")
    if isinstance(engine, dict):
        got |= {k: engine[k] for k in ("reuse_granularity", "flash_attn", "chunk_tokens")
                if k in engine}
    return json.dumps(got) if got else "-"


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """`edgekv bench serve --concurrency/--rate ...`: its options to
    `run_concurrency_bench`."""
    shape = Shape(gsp_groups=args.gsp_groups, gsp_prompts_per_group=args.gsp_prompts_per_group,
                  gsp_system_tokens=args.gsp_system_prompt_len,
                  gsp_question_tokens=args.gsp_question_len, rounds=args.rounds)
    with tempfile.TemporaryDirectory(prefix="edgekv-serve-concurrency-") as tmp:
        res = run_concurrency_bench(
            concurrency=parse_concurrency(args.concurrency) if args.concurrency else (),
            workdir=Path(tmp), model=args.model, parallel=args.parallel,
            requests=args.requests or DEFAULT_REQUESTS, users=args.users,
            max_tokens=args.max_tokens or 48, n_ctx=args.n_ctx, seed=args.seed,
            servers=csv(args.servers) or None, workloads=csv(args.workloads),
            llama_server=llama_server_path(args.llama_server), threads=args.threads,
            probe_dir=Path(args.probe_dir) if args.probe_dir else (
                Path(args.cache_dir) / "probes" if args.cache_dir else None),
            rates=parse_rates(args.rate) if args.rate else (), duration=args.duration,
            slo=Slo.parse(args.slo), shape=shape)
    return res, tables(res)
