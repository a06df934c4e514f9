"""`edgekv bench serve --concurrency` without a model: the figures' maths, the options, each
server's command line, the workloads' prompts, and the clients against a fake streaming server
on loopback (the openai SDK parsing real SSE)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edgekv.errors import ConfigError
from edgekv_bench import concurrency, serve
from edgekv_bench.clients import Reply, agreement, percentile, summarize
from edgekv_bench.concurrency import (
    SERVERS,
    Setup,
    _edgekv_env,
    _share_probes,
    _wanted,
    parse_concurrency,
    ratios,
    tables,
)
from edgekv_bench.concurrent_workload import DOCS_INSTRUCTION, build_prompts, docs_messages
from edgekv_bench.load import run_closed


def reply(text: str, ttft: float = 0.1, itl: tuple[float, ...] = (), tokens: int = 4,
          error: str | None = None) -> Reply:
    return Reply(text, ttft, itl, tokens, 100, 0, ttft + sum(itl), error)


# -- figures ---------------------------------------------------------------------------------


def test_percentiles_are_nearest_rank_as_the_sequential_bench():
    xs = [float(x) for x in range(1, 21)]  # 1..20
    assert percentile(xs, 0.5) == 11.0  # round(9.5) = 10 (banker's): the 11th value
    assert percentile(xs, 0.95) == 19.0  # round(18.05) = 18
    assert percentile([3.0], 0.95) == 3.0 and percentile([], 0.5) == 0.0
    assert percentile([5.0, 1.0, 3.0], 0.5) == 3.0  # sorted first


def test_a_run_summary_pools_inter_token_gaps_and_counts_tokens_over_wall_time():
    rows = [reply("a", 0.1, (0.01, 0.03), tokens=3), reply("b", 0.3, (0.02,), tokens=2),
            reply("", error="APIConnectionError: gone")]
    m = summarize(rows, wall_s=0.5)
    assert m["requests"] == 3 and m["failed"] == 1
    assert m["ttft_ms_mean"] == 200.0 and m["ttft_ms_p95"] == 300.0  # of the two that answered
    assert m["itl_ms_mean"] == 20.0 and m["itl_ms_p95"] == 30.0  # 10, 20, 30 ms pooled
    assert m["itl_ms_max"] == 30.0
    assert m["throughput_tok_s"] == 10.0  # 5 tokens / 0.5 s; the failed one adds none
    assert m["errors"] == ["APIConnectionError: gone"]
    assert summarize([reply("", error="x")], 1.0)["ttft_ms_p95"] is None  # nothing made up


def test_agreement_is_request_by_request_and_a_failure_agrees_with_nothing():
    own = [reply("x"), reply("y"), reply("z"), reply("w")]
    assert agreement(own, own) == 1.0
    assert agreement([reply("x"), reply("n"), reply("z"), reply("w")], own) == 0.75
    assert agreement([reply("y"), reply("x"), reply("z"), reply("w")], own) == 0.5  # order
    assert agreement([reply("x", error="e"), *own[1:]], own) == 0.75
    assert agreement([], []) is None and agreement(own[:2], own) is None


def test_ratios_put_edgekv_over_llama_server_level_by_level():
    def row(server: str, c: int, p95: float, tps: float) -> dict[str, Any]:
        return {"server": server, "workload": "chat", "concurrency": c, "ttft_ms_p95": p95,
                "throughput_tok_s": tps}

    got = ratios([row("llama_server", 4, 200.0, 100.0), row("edgekv", 4, 100.0, 95.0),
                  row("edgekv_p1", 4, 800.0, 30.0), row("edgekv_nocache", 4, 1, 1),
                  row("edgekv", 8, 100.0, 95.0)])  # no peer at 8: no ratio
    assert got == [
        {"server": "edgekv", "vs": "llama_server", "workload": "chat",
         "concurrency": 4, "ttft_p95_ratio": 0.5, "throughput_ratio": 0.95},
        {"server": "edgekv_p1", "vs": "llama_server", "workload": "chat", "concurrency": 4,
         "ttft_p95_ratio": 4.0, "throughput_ratio": 0.3}]


# -- options ---------------------------------------------------------------------------------


def test_concurrency_levels_parse_and_bad_ones_say_what_to_give():
    assert parse_concurrency("1,2,4,8") == (1, 2, 4, 8)
    assert parse_concurrency("4,1,4") == (1, 4)
    for bad in ("0,2", "-1", "", "two", "1.5"):
        with pytest.raises(ConfigError, match="1,2,4,8"):
            parse_concurrency(bad)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgekv bench")
    serve.add_parser(p.add_subparsers(dest="bench"))  # type: ignore[arg-type]
    return p


def test_bench_serve_takes_the_concurrency_options_and_hands_over(monkeypatch, capsys):
    args = parser().parse_args(["serve", "--concurrency", "1,2", "--parallel", "4",
                                "--servers", "edgekv_p1", "--workloads", "docs",
                                "--requests", "4", "--users", "3", "--threads", "2"])
    assert (args.concurrency, args.parallel, args.servers, args.workloads, args.requests,
            args.users, args.threads, args.n_ctx) == ("1,2", 4, "edgekv_p1", "docs", 4, 3, 2,
                                                      None)
    seen = []
    monkeypatch.setattr(concurrency, "run_cli", lambda a: seen.append(a) or ({}, "t"))
    assert args.bench_run(args) == ({}, "t") and seen == [args]
    plain = parser().parse_args(["serve"])  # the sequential bench keeps its defaults
    assert plain.concurrency is None and plain.requests is None and plain.n_ctx is None
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for opt in ("--concurrency", "--parallel", "--requests", "--max-tokens", "--threads",
                "--servers", "--workloads"):
        assert opt in help_text


def test_servers_asked_bring_their_cache_off_runs():
    assert _wanted(["edgekv"]) == ["edgekv", "edgekv_nocache"]
    assert _wanted(["edgekv_parallel"]) == ["edgekv", "edgekv_nocache"]  # the older name
    assert _wanted(["llama_server", "edgekv_p1"]) == [
        "llama_server", "llama_server_nocache", "edgekv_p1", "edgekv_nocache_p1"]
    assert _wanted(["edgekv_budget_off"]) == ["edgekv_nocache", "edgekv_budget_off"]
    assert _wanted(None) == ["llama_server", "llama_server_nocache", "edgekv",
                             "edgekv_nocache"]
    with pytest.raises(ConfigError, match="edgekv_p1"):
        _wanted(["edgekv_onnx"])  # a sequential bench's name


# -- command lines ---------------------------------------------------------------------------


SETUP = Setup("m.gguf", 8192, 2, 8, Path("/bin/llama-server"))


def command(name: str, setup: Setup = SETUP) -> list[str]:
    return setup.command(name, Path("/w") / name)[0]


def test_llama_server_runs_with_its_defaults_and_once_cache_off():
    plain = command("llama_server")
    assert plain[0] == "/bin/llama-server" and "-np" not in plain and "--parallel" not in plain
    assert "--no-cache-prompt" not in plain and "-fa" not in plain
    assert plain[plain.index("-c") + 1] == "8192" and plain[plain.index("-t") + 1] == "2"
    assert command("llama_server_nocache") == [*plain, "--no-cache-prompt"]
    with pytest.raises(ConfigError, match="make llama-server"):
        command("llama_server", Setup("m.gguf", 8192, 2, 8, None))


def test_edgekv_runs_at_one_and_n_sequences_each_with_its_own_cache_off():
    def opt(cmd: list[str], flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    for name, slots in (("edgekv_p1", "1"), ("edgekv", "8"),
                        ("edgekv_nocache_p1", "1"), ("edgekv_nocache", "8")):
        cmd = command(name)
        assert cmd[1:4] == ["-m", "edgekv", "serve"]
        assert opt(cmd, "--parallel") == slots and opt(cmd, "--cache-dir") == f"/w/{name}"
        # each sequence's share of the context, as llama-server's slots share its -c
        assert opt(cmd, "--model") == "m.gguf"
        assert opt(cmd, "--n-ctx") == str(8192 // int(slots))
        assert opt(cmd, "--threads") == "2" and opt(cmd, "--port") == "{port}"
        assert ("--no-cache" in cmd) == ("nocache" in name)
        assert "--max-queue" not in cmd and "--step-budget-ms" not in cmd
    assert SERVERS["edgekv_p1"][2] == "edgekv_nocache_p1"  # compared at the same N
    assert SERVERS["edgekv"][2] == "edgekv_nocache"
    off = SETUP.command("edgekv_budget_off", Path("/w/x"))[0]  # before stall-free prefill
    assert off == [*SETUP.command("edgekv", Path("/w/x"))[0], "--step-budget-ms", "0"]
    through = SETUP.command("edgekv_write_through", Path("/w/x"))[0]  # before the writer
    assert through == [*SETUP.command("edgekv", Path("/w/x"))[0], "--no-write-behind"]
    many = command("edgekv_p1", Setup("m.gguf", 8192, 2, 32, None, max_queue=32))
    assert many[many.index("--max-queue") + 1] == "32"


def test_edgekv_servers_probe_and_share_one_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKV_REUSE_GRANULARITY", "chunk")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("GGML_CPU_BATCH_INVARIANT", "1")
    env = _edgekv_env()
    assert "EDGEKV_REUSE_GRANULARITY" not in env and env["HF_HUB_OFFLINE"] == "1"
    assert env["EDGEKV_FIRST_PROBE"] == "full"  # a measured run never serves a staged start
    # a peer runs as its users run it: without EdgeKV's kernel switch
    from edgekv_bench.servers import peer_env

    peer = peer_env("llama_server")
    assert peer is not None and "GGML_CPU_BATCH_INVARIANT" not in peer and peer["HF_HUB_OFFLINE"]
    assert peer_env("edgekv") is None  # EdgeKV's own: this environment
    shared, run = tmp_path / "probes", tmp_path / "run" / "probes"
    _share_probes(shared, run)  # nothing recorded yet: the first start probes
    assert not run.exists()
    run.mkdir(parents=True)
    (run / "abc.json").write_text('{"invariant": true}')
    _share_probes(run, shared)  # after that start: kept for the next
    _share_probes(shared, tmp_path / "next" / "probes")
    assert (tmp_path / "next" / "probes" / "abc.json").read_text() == '{"invariant": true}'
    (shared / "abc.json").write_text("newer")
    _share_probes(run, shared)  # only what the shared directory lacks is copied
    assert (shared / "abc.json").read_text() == "newer"


# -- workloads -------------------------------------------------------------------------------


def render(msgs: tuple[tuple[str, str], ...]) -> str:
    return "".join(f"<{r}>{c}</{r}>" for r, c in msgs)


def count(text: str) -> int:
    return len(text.split())


def test_every_build_of_a_workload_gives_the_same_prompts():
    for w in ("chat", "docs"):
        a = build_prompts(w, 16, users=8, seed=0, budget=10_000, render=render, count=count)
        b = build_prompts(w, 16, users=8, seed=0, budget=10_000, render=render, count=count)
        assert a == b and len(a) == 16
        assert [p.user for p in a] == [i % 8 for i in range(16)]
        assert len({p.text for p in a}) == 16  # no request repeats another
        other = build_prompts(w, 16, users=8, seed=1, budget=10_000, render=render, count=count)
        assert other != a


def test_chat_users_share_one_system_prompt_and_each_grows_its_own_history():
    got = build_prompts("chat", 16, users=4, seed=0, budget=10_000, render=render, count=count)
    systems = {p.text.split("</system>")[0] for p in got}
    assert len(systems) == 1 and count(systems.pop()) > 200  # one long shared prompt
    for u in range(4):
        mine = [p.text for p in got if p.user == u]
        assert [t.count("<assistant>") for t in mine] == [0, 1, 2, 3]
        # each turn extends the user's previous prompt (less its closing question)
        for prev, nxt in zip(mine, mine[1:]):
            assert nxt.startswith(prev[: prev.rindex("<user>")])


def test_a_chat_turn_over_the_budget_restarts_its_conversation():
    full = build_prompts("chat", 16, users=4, seed=0, budget=10_000, render=render, count=count)
    first = max(p.tokens for p in full[:4])
    cut = build_prompts("chat", 16, users=4, seed=0, budget=first + 70, render=render,
                        count=count)
    assert all(p.tokens <= first + 70 for p in cut)
    assert any("<assistant>" not in p.text for p in cut[4:])  # some turn started afresh
    with pytest.raises(ConfigError, match="raise --n-ctx"):
        build_prompts("docs", 4, users=4, seed=0, budget=50, render=render, count=count)


def test_docs_users_each_have_a_distinct_document_before_their_question():
    msgs = docs_messages(32, users=16, seed=0)
    docs: dict[int, set[str]] = {}
    for u, m in msgs:
        assert m[0] == ("system", DOCS_INSTRUCTION)
        doc, question = m[1][1].split("\n\nQuestion: ")
        assert doc.startswith("Document:\n") and question
        docs.setdefault(u, set()).add(doc)
    assert all(len(d) == 1 for d in docs.values())  # a user's questions share their document
    texts = [next(iter(d)) for d in docs.values()]
    assert len(set(texts)) == 16  # one each for 16 users
    # distinct from the first words on: no user's document is a prefix-sharer of another's
    assert len({t[len("Document:\n"):][:40] for t in texts}) == 16
    assert all(100 < count(t) < 1000 for t in texts)  # a few hundred words each
    with pytest.raises(ConfigError, match="at most 16"):
        docs_messages(4, users=17)


# -- clients against a streaming server on loopback -----------------------------------------


class FakeCompletions(BaseHTTPRequestHandler):
    """/v1/completions streamed as OpenAI does: a text chunk per token, then usage. The
    answer is the prompt's words reversed; a prompt "fail" gets a 500."""

    bodies: list[dict[str, Any]] = []
    delay_s = 0.02

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if body["prompt"] == "fail":
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "boom"}}')
            return
        words = body["prompt"].split()[::-1][: body["max_tokens"]]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        head = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
        for i, w in enumerate(words):
            time.sleep(self.delay_s)
            chunk = {**head, "choices": [{"index": 0, "text": (" " if i else "") + w,
                                          "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": 7, "completion_tokens": len(words),
                 "total_tokens": 7 + len(words)}
        self.wfile.write(f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
                         "data: [DONE]\n\n".encode())


@pytest.fixture
def fake_server() -> Iterator[str]:
    FakeCompletions.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_clients_stream_time_and_keep_prompt_order(fake_server):
    import openai

    def client() -> Any:
        return openai.OpenAI(base_url=fake_server, api_key="x", max_retries=0, timeout=30)

    prompts = [f"p{i} a b c" for i in range(6)] + ["fail"]
    rows, wall = run_closed(client, "llama_server", prompts, 3, 3)
    assert [r.text for r in rows[:6]] == ["c b a"] * 6
    assert rows[6].error is not None and "500" in rows[6].error
    for r in rows[:6]:
        assert r.completion_tokens == 3 and r.prompt_tokens == 7
        assert len(r.itl_s) == 2 and all(x > 0.01 for x in r.itl_s)
        assert 0.015 < r.ttft_s < r.total_s
    # three in flight: about two rounds of ~60 ms, not six
    assert wall < sum(r.total_s for r in rows) * 0.75
    body = FakeCompletions.bodies[0]
    assert body["temperature"] == 0.0 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["top_k"] == 1 and body["repeat_penalty"] == 1.0  # llama-server: greedy
    FakeCompletions.bodies = []
    run_closed(client, "edgekv", ["x y"], 1, 4)
    assert "top_k" not in FakeCompletions.bodies[0]  # EdgeKV takes the OpenAI fields only
    assert FakeCompletions.bodies[0]["model"] == "default"


def test_tables_show_each_workload_every_load_the_ratios_knees_and_settings():
    from edgekv_bench.load import figures

    def row(**load: Any) -> dict[str, Any]:
        return {"server": "edgekv", "workload": "chat", **load,
                **figures([reply("a", 0.1, (0.02,))], 1.0), "equal_own_cache_off": 1.0,
                "equal_own_c1": None}

    res = {"workloads": ["chat"], "requests": 1, "rows": [],
           "load_rows": [row(concurrency=4, rate=None), row(concurrency=None, rate=0.25)],
           "requests_per_workload": {"chat": 1},
           "knee": {"chat": {"knee_rps": 0.5, "trace": [
               {"rate": 0.3, "goodput_rps": 0.3, "holds": True},
               {"rate": 0.5, "goodput_rps": 0.2, "holds": False}]}},
           "ratios": [{"server": "edgekv", "workload": "chat", "concurrency": 4,
                       "ttft_p95_ratio": 0.8, "throughput_ratio": 1.1}],
           "servers": ["edgekv"], "resolved": {"edgekv": {"n_slots": None}},
           "health": {"edgekv": {"status": "ok", "parallel": {"slots": 4},
                                 "engine": {"reuse_granularity": "token"}}}}
    text = tables(res)
    assert "Workload `chat`" in text and "100.0 / 100.0 / 100.0" in text and "100%" in text
    assert "c=4" in text and "0.25/s" in text and "ttft_ms=2000,tpot_ms=100" in text
    assert "knee on `chat`: 0.5 requests/s" in text and "0.5/s goodput 0.2 (under 90%)" in text
    assert "0.8" in text and '"slots": 4' in text and '"reuse_granularity": "token"' in text
    res["health"] = {"edgekv": {"status": "ok"}}  # nothing to say: "-", as is
    assert '"-"' not in tables(res)


FAKE_LLAMA_SERVER = '''\
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
print("srv    load_model: initializing, n_slots = 4, n_ctx_slot = 8192", flush=True)


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        words = body["prompt"].split()[::-1][: body["max_tokens"]]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        head = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
        for i, w in enumerate(words):
            time.sleep(0.005)
            c = {**head, "choices": [{"index": 0, "text": (" " if i else "") + w,
                                      "finish_reason": None}]}
            self.wfile.write(("data: " + json.dumps(c) + "\\n\\n").encode())
            self.wfile.flush()
        u = {"prompt_tokens": 5, "completion_tokens": len(words), "total_tokens": 9}
        self.wfile.write(("data: " + json.dumps({**head, "choices": [], "usage": u})
                          + "\\n\\ndata: [DONE]\\n\\n").encode())


ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_a_whole_run_on_a_stand_in_server_process(tmp_path, monkeypatch):
    """The run's loop end to end (start each server afresh per level, measure, stop, read its
    log and /health, the rows and their agreement) on a stand-in for llama-server."""
    import sys

    from edgekv.engines import models
    from edgekv_bench import concurrency as mod
    from edgekv_bench.concurrent_workload import Prompt

    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n" + FAKE_LLAMA_SERVER)
    binary.chmod(0o755)
    monkeypatch.setattr(models, "resolve_model", lambda m: Path("m.gguf"))
    monkeypatch.setattr(mod, "_prompts", lambda model, workloads, requests, *a: {
        w: [Prompt(i % 2, f"{w} q{i} a b c d", 6) for i in range(requests)] for w in workloads})
    res = mod.run_concurrency_bench(concurrency=(1, 2), workdir=tmp_path / "w", requests=4,
                                    max_tokens=3, servers=["llama_server"], workloads=["docs"],
                                    llama_server=binary, threads=2, probe_dir=tmp_path / "p",
                                    progress=False)
    assert res["bench"] == "serve-concurrency" and res["concurrency"] == [1, 2]
    assert res["servers"] == ["llama_server", "llama_server_nocache"]
    keys = {"server", "workload", "concurrency", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p95",
            "itl_ms_mean", "itl_ms_p95", "throughput_tok_s", "agreement_own_cache_off",
            "requests"}
    assert len(res["rows"]) == 4 and all(keys <= set(r) for r in res["rows"])
    on = [r for r in res["rows"] if r["server"] == "llama_server"]
    assert [r["agreement_own_cache_off"] for r in on] == [1.0, 1.0]
    assert all(r["failed"] == 0 and r["completion_tokens"] == 12 for r in res["rows"])
    assert all(r["agreement_own_cache_off_c1"] == 1.0 for r in res["rows"])
    assert len(res["start_s"]["llama_server"]) == 2  # started afresh for each level
    assert res["resolved"]["llama_server"]["n_slots"] == "4"
    assert res["health"]["llama_server"] == {"status": "ok"}
    # 1024 per sequence, for llama-server's 4 slots (EdgeKV's default, more than the levels)
    assert res["n_ctx"] == 4096 and res["parallel"] == 4
    assert "--no-cache-prompt" in res["commands"]["llama_server_nocache"]
    assert res["failed_rows"] == [] and "freshly started" in res["method"]
    json.dumps(res)  # the JSON written as is


def test_the_knee_is_the_lowest_rate_where_goodput_falls_under_90_percent(monkeypatch):
    """From llama-server's concurrency-1 rate up by 1.5x while its goodput holds 90% of the
    rate it achieved; down where the first rate already misses."""
    from edgekv_bench.concurrency import find_knee
    from edgekv_bench.load import Slo

    def runner(capacity: float) -> Any:
        tried: list[float] = []

        def measure(name: str, workload: str, prompts: Any, load: Any, log_name: str = ""):
            assert name == "llama_server" and load.kind == "rate" and log_name
            tried.append(load.value)
            ok = load.value <= capacity  # over its capacity every answer misses the SLO
            return [reply("a", 0.1 if ok else 5.0, (0.01,)) for _ in range(4)], 4 / load.value

        return SimpleNamespace(measure=measure, tried=tried)

    r = runner(capacity=2.0)
    knee, trace = find_knee(r, "chat", [], Slo(), 1.0)
    assert r.tried == [1.0, 1.5, 2.25] and knee == 2.25
    assert [t["holds"] for t in trace] == [True, True, False]
    r = runner(capacity=0.5)
    knee, trace = find_knee(r, "chat", [], Slo(), 1.0)
    assert r.tried == pytest.approx([1.0, 1 / 1.5, 1 / 2.25]) and knee == pytest.approx(1 / 1.5)
    # missing the SLO on over a tenth of the requests one at a time: no knee, no run (the
    # search would go down to ever slower rates, hours of runs that cannot hold)
    r = runner(capacity=2.0)
    knee, trace = find_knee(r, "docs", [], Slo(), 1.0, alone_slo_met=0.875)
    assert knee is None and trace == [] and r.tried == []
    knee, trace = find_knee(r, "docs", [], Slo(), 1.0, alone_slo_met=0.9)
    assert knee == 2.25 and r.tried == [1.0, 1.5, 2.25]
