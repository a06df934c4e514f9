"""`edgekv bench serve`'s load without a model: the SLO, Poisson arrivals, the closed and open
loops (sessions included) against a stand-in client, vLLM's figures, and the gsp and
multiround workloads' prompts."""

from __future__ import annotations

import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from edgekv.errors import ConfigError
from edgekv_bench.clients import Reply
from edgekv_bench.concurrency import Load, parse_rates
from edgekv_bench.concurrent_workload import Shape, build_prompts, gsp_messages
from edgekv_bench.load import DEFAULT_SLO, Slo, arrival_times, figures, run_closed, run_open


def reply(ttft: float, total: float, tokens: int, cached: int = 0, error: str | None = None,
          itl: tuple[float, ...] = ()) -> Reply:
    return Reply("t", ttft, itl, tokens, 100, cached, total, error)


def test_the_slo_parses_its_two_targets_and_says_what_is_wrong():
    assert Slo.parse("ttft_ms=2000,tpot_ms=100") == DEFAULT_SLO == Slo()
    assert Slo.parse("ttft_ms=500") == Slo(500.0, 100.0)
    assert str(Slo.parse(" tpot_ms = 50 ")) == "ttft_ms=2000,tpot_ms=50"
    for bad, why in (("e2el_ms=3", "not ttft_ms"), ("ttft_ms=fast", "not a number"),
                     ("tpot_ms=0", "> 0")):
        with pytest.raises(ConfigError, match=why):
            Slo.parse(bad)


def test_a_request_meets_the_slo_on_ttft_and_tpot_and_a_failure_never_does():
    slo = Slo(1000, 100)
    assert slo.met(reply(0.5, 0.5 + 9 * 0.09, 10))  # TPOT 90 ms
    assert not slo.met(reply(1.5, 2.0, 10))  # TTFT over
    assert not slo.met(reply(0.5, 0.5 + 9 * 0.11, 10))  # TPOT over
    assert slo.met(reply(0.5, 0.5, 1))  # one token: no TPOT to miss
    assert not slo.met(reply(0.1, 0.1, 0, error="APIError"))


def test_poisson_arrivals_are_seeded_start_at_zero_and_average_one_over_the_rate():
    a = arrival_times(4000, 2.0, seed=3)
    assert a == arrival_times(4000, 2.0, seed=3) != arrival_times(4000, 2.0, seed=4)
    assert a[0] == 0.0 and a == sorted(a)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.5, rel=0.1)  # exponential: sd = mean
    with pytest.raises(ConfigError, match="> 0"):
        arrival_times(3, 0.0)


def test_figures_are_vllms_over_the_answered_requests():
    rows = [reply(0.2, 0.2 + 4 * 0.05, 5, cached=60, itl=(0.04, 0.05, 0.06, 0.05)),
            reply(3.0, 3.0 + 4 * 0.05, 5, cached=0, itl=(0.05,) * 4),  # misses TTFT
            reply(0.0, 1.0, 0, error="APIConnectionError: gone")]
    f = figures(rows, wall_s=4.0)
    assert f["requests"] == 3 and f["failed"] == 1
    assert f["ttft_ms_mean"] == 1600.0 and f["ttft_ms_p99"] == 3000.0
    assert f["tpot_ms_mean"] == 50.0 and f["tpot_ms_p50"] == 50.0
    assert f["itl_ms_max"] == 60.0 and f["itl_ms_p99"] == 60.0
    assert f["e2el_ms_mean"] == pytest.approx((400 + 3200) / 2)
    assert f["output_tok_s"] == 2.5 and f["requests_per_s"] == 0.5
    assert f["goodput_rps"] == 0.25 and f["slo_met"] == pytest.approx(1 / 3, abs=1e-4)
    assert f["slo"] == "ttft_ms=2000,tpot_ms=100"
    assert f["reused_prompt_share"] == 0.3  # 60 of 200 answered prompt tokens
    assert f["errors"] == ["APIConnectionError: gone"]
    none = figures([reply(0, 1, 0, error="x")], 1.0)
    assert none["ttft_ms_p99"] is None and none["goodput_rps"] == 0.0  # nothing made up


class Client:
    """The openai client's `completions.create(stream=True)`, answering after `delay_s` a
    token; every call's start and end kept by prompt."""

    def __init__(self, log: dict[str, tuple[float, float]], delay_s: float = 0.02) -> None:
        self.log, self.delay_s = log, delay_s
        self.completions = self

    def create(self, *, prompt: str, max_tokens: int, **_: Any) -> Any:
        def chunks() -> Any:
            start = time.perf_counter()
            for i in range(max_tokens):
                time.sleep(self.delay_s)
                yield SimpleNamespace(choices=[SimpleNamespace(text=f" w{i}")], usage=None)
            usage = SimpleNamespace(completion_tokens=max_tokens, prompt_tokens=3,
                                    prompt_tokens_details=None)
            yield SimpleNamespace(choices=[], usage=usage)
            self.log[prompt] = (start, time.perf_counter())

        return chunks()


def test_the_closed_loop_holds_c_in_flight_and_a_session_waits_for_its_last_round():
    log: dict[str, tuple[float, float]] = {}
    lock = threading.Lock()
    prompts = [f"p{i}" for i in range(6)]
    after = [None, None, None, 0, 1, 3]  # p3 after p0, p4 after p1, p5 after p3
    replies, wall = run_closed(lambda: Client(log), "edgekv", prompts, 3, 3, after)
    assert [r.text for r in replies] == [" w0 w1 w2"] * 6 and wall > 0
    with lock:
        for i, j in enumerate(after):
            if j is not None:
                assert log[f"p{i}"][0] >= log[f"p{j}"][1]  # sent after its last answered
    # three clients: never more than three answering at once
    events = sorted([(s, 1) for s, _ in log.values()] + [(e, -1) for _, e in log.values()])
    running, most = 0, 0
    for _, d in events:
        running += d
        most = max(most, running)
    assert most <= 3


def test_the_open_loop_sends_at_the_arrival_times_and_keeps_sessions():
    log: dict[str, tuple[float, float]] = {}
    prompts = [f"p{i}" for i in range(8)]
    after = [None] * 7 + [0]
    t0 = time.perf_counter()
    replies, wall = run_open(lambda: Client(log, 0.05), "edgekv", prompts, 20.0, 4, after,
                             seed=1)
    times = arrival_times(8, 20.0, seed=1)
    assert len(replies) == 8 and all(r.error is None for r in replies)
    for i, at in enumerate(times):
        assert log[f"p{i}"][0] - t0 >= at - 0.005  # not before its arrival
    assert log["p7"][0] >= log["p0"][1]
    # open loop: arrivals do not wait for answers, so several run at once
    assert sum(s < log["p0"][1] for s, _ in log.values()) >= 2
    assert wall >= times[-1]


def test_a_failed_request_is_a_reply_with_its_error():
    class Broken:
        completions = SimpleNamespace(create=lambda **_: (_ for _ in ()).throw(
            RuntimeError("connection refused")))

    replies, _ = run_closed(lambda: Broken(), "edgekv", ["a", "b"], 2, 2)
    assert all(r.error == "RuntimeError: connection refused" for r in replies)
    replies, _ = run_open(lambda: Broken(), "edgekv", ["a"], 5.0, 2)
    assert replies[0].error is not None


def test_loads_and_rates_parse_and_say_what_to_give():
    assert Load("concurrency", 4).label == "c4" and Load("rate", 0.25).label == "r0.25"
    assert Load("rate", 0.5).row() == {"concurrency": None, "rate": 0.5}
    assert Load("concurrency", 8).row() == {"concurrency": 8, "rate": None}
    with pytest.raises(ConfigError):
        Load("burst", 1)
    assert parse_rates("0.5,0.25,0.5") == (0.25, 0.5) and parse_rates("knee") == "knee"
    for bad in ("0", "-1,2", "fast", ""):
        with pytest.raises(ConfigError, match="knee"):
            parse_rates(bad)


# -- workloads -------------------------------------------------------------------------------


def render(msgs: tuple[tuple[str, str], ...]) -> str:
    return "".join(f"<{r}>{c}</{r}>" for r, c in msgs)


def count(text: str) -> int:
    return len(text.split())


def test_gsp_groups_share_a_system_prompt_of_the_asked_length_and_nothing_else():
    shape = Shape(gsp_groups=3, gsp_prompts_per_group=5, gsp_system_tokens=120,
                  gsp_question_tokens=40)
    got = gsp_messages(shape, seed=0, count=count)
    assert len(got) == 15 and sorted(g for g, _ in got) == sorted([0, 1, 2] * 5)
    assert [g for g, _ in got] != sorted(g for g, _ in got)  # shuffled, as SGLang's
    systems: dict[int, set[str]] = {}
    for g, msgs in got:
        systems.setdefault(g, set()).add(msgs[0][1])
        assert 30 <= count(msgs[1][1]) <= 40  # the question's length, about
    assert all(len(s) == 1 for s in systems.values())  # one system prompt per group
    texts = [next(iter(s)) for s in systems.values()]
    assert len(set(t[:30] for t in texts)) == 3  # the groups differ from their start
    assert all(110 <= count(t) <= 120 for t in texts)
    assert gsp_messages(shape, seed=0, count=count) == got  # seeded
    prompts = build_prompts("gsp", 999, users=1, seed=0, budget=10_000, render=render,
                            count=count, shape=shape)
    assert len(prompts) == 15 and all(p.after is None for p in prompts)


def test_multiround_users_grow_their_history_round_by_round_after_their_last():
    shape = Shape(rounds=3)
    got = build_prompts("multiround", 999, users=4, seed=0, budget=10_000, render=render,
                        count=count, shape=shape)
    assert len(got) == 12 and [p.user for p in got] == [0, 1, 2, 3] * 3  # round-major
    systems = {p.text.split("</system>")[0] for p in got}
    assert len(systems) == 1 and count(systems.pop()) > 200  # one shared system prompt
    for i, p in enumerate(got):
        assert p.after == (None if i < 4 else i - 4)  # the user's last round
        if p.after is not None:
            prev = got[p.after].text
            assert p.text.startswith(prev[: prev.rindex("<user>")])  # the history grows
            assert p.text.count("<assistant>") == prev.count("<assistant>") + 1
    with pytest.raises(ConfigError, match="--rounds 0"):
        Shape(rounds=0)
