"""`edgekv bench spec`: speculative decoding, EdgeKV's exact n-gram drafts against llama-server's
n-gram modes, over HTTP with the openai client, in one sitting.

Servers, all started at once on the same model file, threads and context size:
- `edgekv serve --speculative none` and `--speculative ngram` (everything else its defaults);
- llama.cpp's `llama-server` built stock (`make llama-server`), its defaults, with
  `--spec-type` none (its default), `ngram-simple` and `ngram-mod`.

Prompts are the fixed sets of `spec_prompts` (the chat workload's history is the model's own
greedy answers, from `edgekv serve --speculative none`), rendered once with the model's chat
template and sent to `/v1/completions`, streamed, one request at a time, the servers in a
rotating order per prompt so that machine drift hits all alike. Each prompt is asked greedy
(temperature 0; llama-server also top_k 1, repeat_penalty 1) and seeded (temperature 0.8,
seed fixed per prompt; every server with its own sampler defaults otherwise).

Per request, measured at the client: TTFT, E2EL, completion tokens, and decode tok/s =
(tokens - 1) / (E2EL - TTFT). A row's `decode_tok_s` pools its requests: the sum of
(tokens - 1) over the sum of (E2EL - TTFT). Drafted and accepted tokens come from each
server's own report (EdgeKV's `edgekv` object, llama-server's `timings.draft_n` and
`draft_n_accepted`). `identical_to_plain` is the share of outputs whose text equals the same
server's with speculation off, prompt by prompt, sampling by sampling. An output `loops`
where one 8-word sequence occurs three times or more in it (a small model repeating itself,
which inflates acceptance); acceptance is also given without them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekv.errors import ConfigError

from .options import Subparsers, bench_parser, csv, llama_server_opt, llama_server_path, progress
from .report import environment, table
from .servers import (
    Server,
    free_port,
    greedy_extra,
    peer_env,
    resolved_settings,
    server_command,
)
from .spec_prompts import (
    CHAT_CONVERSATIONS,
    CHAT_SYSTEM,
    MAX_TOKENS,
    WORKLOADS,
    single_turn_prompts,
)

__all__ = ["SPEC_SERVERS", "add_parser", "loops", "run_cli", "run_spec_bench", "spec_table"]

# name -> (server, speculative mode, the flags it adds to the server's command)
SPEC_SERVERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "edgekv_none": ("edgekv", "none", ("--speculative", "none")),
    "edgekv_ngram": ("edgekv", "ngram", ("--speculative", "ngram")),
    "llama_server_none": ("llama_server", "none", ()),
    "llama_server_ngram_simple": ("llama_server", "ngram-simple", ("--spec-type", "ngram-simple")),
    "llama_server_ngram_mod": ("llama_server", "ngram-mod", ("--spec-type", "ngram-mod")),
}
PLAIN = {"edgekv": "edgekv_none", "llama_server": "llama_server_none"}
SAMPLINGS = ("greedy", "seeded")
SEEDED_TEMPERATURE = 0.8


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    ttft_s: float
    e2el_s: float
    tokens: int
    drafted: int | None  # None: the server did not say
    accepted: int | None


def loops(text: str, n: int = 8, times: int = 3) -> bool:
    """Whether some `n`-word sequence occurs `times` times or more in `text`."""
    words = text.split()
    seen: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - n + 1):
        k = tuple(words[i : i + n])
        seen[k] = seen.get(k, 0) + 1
        if seen[k] >= times:
            return True
    return False


def _extra(obj: Any) -> dict[str, Any]:
    return dict(getattr(obj, "model_extra", None) or {})


def _ask(client: Any, system: str, prompt: str, max_tokens: int, sampling: str,
         seed: int) -> Answer:
    """One streamed completion, timed at the client; the server's own draft counts."""
    import time

    body: dict[str, Any] = {"stream_options": {"include_usage": True}}
    extra = greedy_extra(system) if sampling == "greedy" else {}
    temperature = 0.0 if sampling == "greedy" else SEEDED_TEMPERATURE
    t0 = time.perf_counter()
    first = None
    parts: list[str] = []
    tokens = 0
    drafted = accepted = None
    stream = client.completions.create(
        model="default" if system == "edgekv" else "model", prompt=prompt,
        max_tokens=max_tokens, temperature=temperature, seed=seed, stream=True,
        extra_body=extra, **body)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if first is None:
                first = time.perf_counter()
            parts.append(chunk.choices[0].text)
        if getattr(chunk, "usage", None) is not None:
            tokens = int(chunk.usage.completion_tokens)
        ex = _extra(chunk)
        if isinstance(ex.get("edgekv"), dict):
            drafted = int(ex["edgekv"].get("drafted_tokens", 0))
            accepted = int(ex["edgekv"].get("accepted_tokens", 0))
        t = ex.get("timings")
        if isinstance(t, dict):  # llama-server's: draft_n only where it drafted
            drafted, accepted = int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))
    end = time.perf_counter()
    return Answer("".join(parts), (first or end) - t0, end - t0, tokens, drafted, accepted)


def run_spec_bench(*, model: str | None = None, n_ctx: int = 2048, threads: int | None = None,
                   llama_server: Path | None = None, workdir: Path,
                   workloads: Sequence[str] = WORKLOADS, servers: Sequence[str] | None = None,
                   show_progress: bool = True) -> dict[str, Any]:
    import llama_cpp
    import openai

    from edgekv.chat import render_chat
    from edgekv.engines.models import resolve_model

    bad = set(workloads) - set(WORKLOADS)
    if bad:
        raise ConfigError(f"unknown workloads {sorted(bad)}; choose from {list(WORKLOADS)}")
    names = list(SPEC_SERVERS) if servers is None else list(servers)
    bad = set(names) - set(SPEC_SERVERS)
    if bad:
        raise ConfigError(f"unknown servers {sorted(bad)}; choose from {list(SPEC_SERVERS)}")
    if "edgekv_none" not in names:
        names.insert(0, "edgekv_none")  # the chat history's source, and EdgeKV's plain run
    if any(SPEC_SERVERS[n][0] == "llama_server" for n in names):
        if llama_server is None:
            names = [n for n in names if SPEC_SERVERS[n][0] != "llama_server"]
        elif not llama_server.is_file():
            raise ConfigError(f"{llama_server} does not exist: run `make llama-server`")
        elif "llama_server_none" not in names:
            names.append("llama_server_none")
    path = str(resolve_model(model))
    threads = threads or os.cpu_count() or 1
    vocab = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    template = vocab.metadata.get("tokenizer.chat_template")
    workdir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, Server] = {}
    cards: dict[str, dict[str, Any]] = {}  # EdgeKV's /health engine card
    answers: dict[tuple[str, str, str], Answer] = {}  # (server, prompt id, sampling)
    prompt_of: dict[str, tuple[str, str]] = {}  # prompt id -> (workload, rendered prompt)

    def render(messages: Sequence[tuple[str, str]]) -> str:
        return render_chat(template, [{"role": r, "content": c} for r, c in messages])

    try:
        for name in names:
            system, _, flags = SPEC_SERVERS[name]
            got = server_command("edgekv" if system == "edgekv" else "llama_server", model=path,
                                 n_ctx=n_ctx, threads=threads, root=workdir / name,
                                 llama_server=llama_server)
            assert got is not None
            port = free_port()
            cmd = [c.replace("{port}", str(port)) for c in got[0]] + list(flags)
            # EdgeKV: the whole probe before serving (speculation runs only once it passed)
            env = ({**os.environ, "EDGEKV_FIRST_PROBE": "full"} if system == "edgekv"
                   else peer_env("llama_server"))
            procs[name] = Server(name, cmd, got[1], port, workdir / f"{name}.log", env=env)
            procs[name].start()
            if system == "edgekv":
                with urllib.request.urlopen(procs[name].base_url + "/health", timeout=10) as r:
                    cards[name] = json.loads(r.read())["engine"]
        clients = {n: openai.OpenAI(base_url=s.base_url + "/v1", api_key="bench", timeout=900,
                                    max_retries=0) for n, s in procs.items()}
        todo: list[tuple[str, str, Sequence[tuple[str, str]] | None, int]] = []
        for w in workloads:
            if w == "chat":
                for c, turns in enumerate(CHAT_CONVERSATIONS):
                    for t in range(len(turns)):
                        todo.append(("chat", f"chat-{c}-{t}", None, c))
            else:
                todo += [(w, p.id, p.messages, 0) for p in single_turn_prompts(w)]
        history: dict[int, list[tuple[str, str]]] = {}
        total = len(todo) * len(SAMPLINGS)
        step = 0
        for i, (w, pid, messages, conv) in enumerate(todo):
            if messages is None:  # a chat turn: the history so far, the model's own answers
                turn = int(pid.rsplit("-", 1)[1])
                msgs = history.setdefault(conv, [("system", CHAT_SYSTEM)])
                msgs.append(("user", CHAT_CONVERSATIONS[conv][turn]))
                messages = tuple(msgs)
            prompt = render(messages)
            prompt_of[pid] = (w, prompt)
            seed = 1000 + i
            for s, sampling in enumerate(SAMPLINGS):
                # the plain EdgeKV first (its greedy answer is the history), the rest rotated
                rest = [n for n in procs if n != "edgekv_none"]
                k = (i * len(SAMPLINGS) + s) % max(1, len(rest))
                for name in ["edgekv_none", *rest[k:], *rest[:k]]:
                    answers[(name, pid, sampling)] = _ask(
                        clients[name], SPEC_SERVERS[name][0], prompt, MAX_TOKENS[w], sampling,
                        seed)
                step += 1
                if show_progress:
                    progress(step, total)
            if w == "chat":
                history[conv].append(("assistant", answers[("edgekv_none", pid,
                                                             "greedy")].text))
        settings = {}
        for name, srv in procs.items():
            try:
                settings[name] = resolved_settings(srv.log.read_text(errors="replace"))
            except OSError:
                settings[name] = {}
    finally:
        for srv in procs.values():
            srv.stop()
    rows = [_row(name, w, sampling, answers, prompt_of)
            for w in workloads for name in procs for sampling in SAMPLINGS]
    return {
        "bench": "spec", "model": Path(path).name, "n_ctx": n_ctx, "threads": threads,
        "environment": environment(), "servers": {
            n: {"server": SPEC_SERVERS[n][0], "speculative": SPEC_SERVERS[n][1],
                "command": list(procs[n].cmd), "resolved_settings": settings[n],
                **({"engine": cards[n]} if n in cards else {})}
            for n in procs},
        "method": __doc__.split("\n\n", 1)[1].strip(),
        "workloads": {w: {"prompts": sum(1 for _, (ww, _) in prompt_of.items() if ww == w),
                          "max_tokens": MAX_TOKENS[w]} for w in workloads},
        "rows": rows,
        "speedup": _speedups(rows),
    }


def _row(name: str, workload: str, sampling: str, answers: dict[tuple[str, str, str], Answer],
         prompt_of: dict[str, tuple[str, str]]) -> dict[str, Any]:
    server, spec, _ = SPEC_SERVERS[name]
    plain = PLAIN[server]
    ids = [pid for pid, (w, _) in prompt_of.items() if w == workload]
    got = [answers[(name, pid, sampling)] for pid in ids]
    ref = [answers[(plain, pid, sampling)] for pid in ids]
    decode_s = sum(max(a.e2el_s - a.ttft_s, 0.0) for a in got)
    decoded = sum(max(a.tokens - 1, 0) for a in got)
    drafted = [a.drafted for a in got if a.drafted is not None]
    accepted = [a.accepted for a in got if a.accepted is not None]
    looping = [loops(a.text) for a in got]
    no_loop = [(a.drafted or 0, a.accepted or 0) for a, lp in zip(got, looping) if not lp]
    d_nl = sum(d for d, _ in no_loop)
    return {
        "workload": workload, "server": server, "name": name, "speculative": spec,
        "sampling": sampling, "requests": len(got),
        "decode_tok_s": round(decoded / decode_s, 2) if decode_s > 0 else None,
        "e2el_ms_mean": round(statistics.fmean(a.e2el_s * 1000 for a in got), 1),
        "ttft_ms_mean": round(statistics.fmean(a.ttft_s * 1000 for a in got), 1),
        "completion_tokens": sum(a.tokens for a in got),
        "drafted_tokens": sum(drafted) if drafted else 0,
        "accepted_tokens": sum(accepted) if accepted else 0,
        "acceptance_rate": round(sum(accepted) / sum(drafted), 4) if sum(drafted) else None,
        "acceptance_rate_without_loops": (round(sum(a for _, a in no_loop) / d_nl, 4)
                                          if d_nl else None),
        "looping_outputs": sum(looping),
        "identical_to_plain": round(sum(a.text == b.text for a, b in zip(got, ref))
                                    / len(got), 4),
        "per_prompt": [{"id": pid, "tokens": a.tokens, "drafted": a.drafted,
                        "accepted": a.accepted,
                        "acceptance": (round(a.accepted / a.drafted, 3)
                                       if a.drafted and a.accepted is not None else None),
                        "decode_tok_s": (round((a.tokens - 1) / (a.e2el_s - a.ttft_s), 2)
                                         if a.tokens > 1 and a.e2el_s > a.ttft_s else None),
                        "loops": lp, "identical_to_plain": a.text == b.text}
                       for pid, a, b, lp in zip(ids, got, ref, looping)],
    }


def _speedups(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, sampling and speculative server: decode tok/s and E2EL against the same
    server with speculation off (gain > 1: faster)."""
    plain = {(r["workload"], r["sampling"], r["name"]): r for r in rows
             if r["name"] in PLAIN.values()}
    out = []
    for r in rows:
        if r["name"] in PLAIN.values():
            continue
        p = plain.get((r["workload"], r["sampling"], PLAIN[r["server"]]))
        if p is None or not p["decode_tok_s"] or not r["decode_tok_s"]:
            continue
        out.append({"workload": r["workload"], "sampling": r["sampling"], "name": r["name"],
                    "decode_gain": round(r["decode_tok_s"] / p["decode_tok_s"], 3),
                    "e2el_gain": round(p["e2el_ms_mean"] / r["e2el_ms_mean"], 3),
                    "identical_to_plain": r["identical_to_plain"]})
    return out


def spec_table(res: dict[str, Any]) -> str:
    gains = {(g["workload"], g["sampling"], g["name"]): g for g in res["speedup"]}
    body = []
    for r in res["rows"]:
        g = gains.get((r["workload"], r["sampling"], r["name"]))
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        body.append([r["workload"], r["sampling"], r["name"], f"{r['decode_tok_s']}",
                     "1.00x" if g is None else f"{g['decode_gain']:.2f}x",
                     f"{r['e2el_ms_mean']:.0f}", acc,
                     f"{r['accepted_tokens']}/{r['drafted_tokens']}",
                     str(r["looping_outputs"]), f"{r['identical_to_plain']:.0%}"])
    return table(["workload", "sampling", "server", "decode tok/s", "vs own plain",
                  "E2EL ms", "acceptance", "accepted/drafted", "looping", "identical"], body)


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="spec-"))
    res = run_spec_bench(model=args.model, n_ctx=args.n_ctx, threads=args.threads,
                         llama_server=llama_server_path(args.llama_server), workdir=workdir,
                         workloads=csv(args.workloads) or WORKLOADS,
                         servers=csv(args.servers) or None)
    return res, spec_table(res)


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    p = bench_parser(sub, "spec", "speculative decoding: EdgeKV's exact n-gram drafts against "
                     "llama-server's n-gram modes, decode tok/s and identical outputs", run_cli,
                     n_ctx=True, threads="threads per server (default: all cores)")
    llama_server_opt(p)
    p.add_argument("--workloads", help=f"comma-separated, of {','.join(WORKLOADS)} (default all)")
    p.add_argument("--servers", help=f"comma-separated, of {','.join(SPEC_SERVERS)} (default "
                   "all; each one's plain run is added)")
    p.add_argument("--workdir", help="server logs and cache dirs (default: a new temp dir)")
    return p
