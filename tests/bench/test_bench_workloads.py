"""Benchmark workloads without an engine: the chat generator, history filling, `--workload`."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from edgekv.cli import main
from edgekv.errors import ConfigError
from edgekv_bench.workload import (
    CHAT_MAX_TOKENS,
    ChatHistory,
    WorkloadItem,
    chat_workload,
    load_workload,
    parse_workload,
    render,
    with_history,
)


def _by_conversation(reqs: list[WorkloadItem]) -> dict[str, list[WorkloadItem]]:
    out: dict[str, list[WorkloadItem]] = defaultdict(list)
    for r in reqs:
        assert r.conversation is not None
        out[r.conversation].append(r)
    return out


def _fake_render(template: str | None, msgs: list[dict[str, str]]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in msgs)


def test_chat_workload_is_deterministic_for_a_seed() -> None:
    assert chat_workload(60, seed=3) == chat_workload(60, seed=3)
    assert chat_workload(60, seed=3) != chat_workload(60, seed=4)


def test_chat_conversations_grow_turn_by_turn() -> None:
    reqs = chat_workload(120, seed=0)
    assert len(reqs) == 120 and all(r.max_tokens == CHAT_MAX_TOKENS for r in reqs)
    for conv, turns in _by_conversation(reqs).items():
        assert [r.turn for r in turns] == list(range(len(turns))), conv
        first = turns[0].messages
        assert first is not None and [role for role, _ in first] == ["system", "user"]
        for prev, cur in zip(turns, turns[1:]):
            assert prev.messages is not None and cur.messages is not None
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert len(cur.messages) == len(prev.messages) + 1
            assert cur.cluster == prev.cluster


def test_chat_users_interleave_and_share_deployments() -> None:
    reqs = chat_workload(120, seed=0)
    users = [r.conversation.split("/")[0] for r in reqs if r.conversation]
    assert len(set(users)) == 6
    # some conversation has another user's request between two of its turns
    switches = sum(a != b for a, b in zip(users, users[1:]))
    assert switches > len(reqs) // 2
    by_cluster: dict[str, set[str]] = defaultdict(set)
    for r, u in zip(reqs, users):
        by_cluster[r.cluster].add(u)
    assert any(len(us) > 1 for us in by_cluster.values())
    # a user whose conversation ended starts a new one
    assert any(r.conversation and r.conversation.endswith("/conv1") for r in reqs)


def test_with_history_puts_answers_in_order() -> None:
    reqs = chat_workload(200, seed=1)
    conv = max(_by_conversation(reqs).values(), key=len)
    last = conv[-1]
    answers = [f"answer {i}" for i in range(last.turn)]
    filled = with_history(last, answers)
    assert filled.messages is not None and last.messages is not None
    questions = [c for r, c in last.messages if r == "user"]
    expected = [last.messages[0]]
    for q, a in zip(questions, answers):
        expected += [("user", q), ("assistant", a)]
    expected.append(("user", questions[-1]))
    assert list(filled.messages) == expected
    assert (filled.conversation, filled.turn) == (last.conversation, last.turn)
    # a restart at turn k keeps only the turns from k on
    k = last.turn - 1
    restarted = with_history(last, answers, start=k)
    assert restarted.messages == (last.messages[0], ("user", questions[k]),
                                  ("assistant", answers[k]), ("user", questions[-1]))
    with pytest.raises(ValueError):
        with_history(last, answers[:-1])


def test_chat_history_fills_from_recorded_answers() -> None:
    reqs = chat_workload(40, seed=2)
    history = ChatHistory()
    said: dict[tuple[str | None, int], str] = {}
    for i, req in enumerate(reqs):
        filled = history.fill(req)
        assert filled.messages is not None
        assistant = [c for r, c in filled.messages if r == "assistant"]
        assert assistant == [said[(req.conversation, t)] for t in range(req.turn)]
        assert render(filled, None, _fake_render).count("assistant: ") == req.turn
        said[(req.conversation, req.turn)] = f"reply {i}"
        history.record(req, f" reply {i} \n")  # stored stripped, as a chat front end does


def test_chat_history_restart_and_order_checks() -> None:
    reqs = chat_workload(200, seed=1)
    conv = max(_by_conversation(reqs).values(), key=len)
    history = ChatHistory()
    with pytest.raises(ValueError, match="in order"):
        history.fill(conv[1])
    for req in conv[:-1]:
        history.record(req, f"a{req.turn}")
    restarted = history.restart(conv[-1])
    assert history.restarts == 1
    assert restarted.messages is not None and len(restarted.messages) == 2


def test_unfilled_chat_turn_cannot_be_rendered() -> None:
    reqs = chat_workload(200, seed=1)
    later = next(r for r in reqs if r.turn >= 1)
    with pytest.raises(ValueError, match="fill the chat history"):
        render(later, None, _fake_render)


def test_parse_workload_names_and_paths(tmp_path: Path) -> None:
    assert parse_workload(None) == "seed"
    assert parse_workload("seed") == "seed"
    assert parse_workload("chat") == "chat"
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt": "hello"}\n{"prompt": "again", "max_tokens": 4}\n')
    assert parse_workload(str(wl)) == wl
    with pytest.raises(ConfigError, match="neither a workload name"):
        parse_workload("chatty")
    with pytest.raises(ConfigError, match="seed, chat"):
        parse_workload(str(tmp_path / "missing.jsonl"))


def test_load_workload_defaults(tmp_path: Path) -> None:
    name, reqs = load_workload("chat", requests=7, seed=0)
    assert name == "chat" and len(reqs) == 7 and reqs[0].max_tokens == CHAT_MAX_TOKENS
    name, reqs = load_workload(None, requests=5, max_tokens=8)
    assert name == "seed" and len(reqs) == 5 and reqs[0].max_tokens == 8
    assert all(r.conversation is None for r in reqs)
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    name, reqs = load_workload(str(wl), requests=2)
    assert name == str(wl) and [r.prompt for r in reqs] == ["a", "b"]


def test_unknown_workload_name_is_a_clear_cli_error(tmp_path: Path, capsys) -> None:
    code = main(["bench", "seed", "--workload", "nonesuch", "--json", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert code == 2 and "nonesuch" in err and "seed, chat" in err


class _WordTokenizer:
    """Stands in for the adapter where only prompt length matters: one token per word."""

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        return list(range(len(text.split())))

    def control_tokens(self) -> dict[str, int]:
        return {}


_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def test_a_conversation_that_outgrows_the_context_restarts() -> None:
    from edgekv_bench.seed import _prepare

    conv = max(_by_conversation(chat_workload(200, seed=1)).values(), key=len)
    history = ChatHistory()
    first, _, tokens = _prepare(conv[0], history, _WordTokenizer(), _TEMPLATE, 100_000)
    # room for the first turn only: the next turn starts the conversation afresh
    n_ctx = len(tokens) + conv[0].max_tokens + 5
    history.record(conv[0], "zzword " * 40)
    second, text, tokens = _prepare(conv[1], history, _WordTokenizer(), _TEMPLATE, n_ctx)
    assert history.restarts == 1 and second.messages is not None
    assert [r for r, _ in second.messages] == ["system", "user"] and "zzword" not in text
    history.record(conv[1], "short")
    third, _, _ = _prepare(conv[2], history, _WordTokenizer(), _TEMPLATE, n_ctx * 2)
    assert third.messages is not None
    assert [c for r, c in third.messages if r == "assistant"] == ["short"]
    with pytest.raises(ConfigError, match="--n-ctx"):
        _prepare(conv[0], ChatHistory(), _WordTokenizer(), _TEMPLATE, 10)


def test_fidelity_is_against_each_systems_own_reference() -> None:
    from types import SimpleNamespace

    from edgekv_bench.modes import Outcome
    from edgekv_bench.plots import seed_table
    from edgekv_bench.seed import _summarise

    def rows(*texts: str) -> list[tuple[Outcome, float, float]]:
        return [(Outcome(0.01, 0, 10, t, False, 100, total_s=0.05), 0.01, 0.1) for t in texts]

    results = {"plain": rows("a", "b"), "nocache": rows("a", "x"), "string": rows("a", "x"),
               "llama_ram_cache": rows("a", "y"), "edgekv_strict": rows("a", "x"),
               "edgekv_approx": rows("z", "x")}
    adapter = SimpleNamespace(model_path=Path("m.gguf"),
                              fingerprint=SimpleNamespace(engine="test"))
    res = _summarise(chat_workload(2), results, "estimated", "model", adapter, 1.0)
    modes = res["modes"]
    assert list(modes) == list(results)
    assert modes["edgekv_strict"]["fidelity"] == 1.0  # same as EdgeKV's own cache-off run
    assert modes["edgekv_strict"]["fidelity_vs_plain"] == 0.5
    assert modes["llama_ram_cache"]["fidelity"] == 0.5  # against plain, its own system
    assert modes["edgekv_approx"]["fidelity"] == 0.5
    assert modes["plain"]["total_ms_mean"] == 50.0
    assert modes["string"]["ttft_speedup_vs_nocache"] == 1.0
    assert res["fidelity_reference"]["by_mode"]["llama_ram_cache"] == "plain"
    assert {"fidelity", "fidelity_vs_plain"} <= set(res["fidelity_reference"])
    table = seed_table(res)
    assert "llama-cpp plain" in table and "vs plain" in table and "total ms" in table


def test_rag_workload_passages_vary_in_order_and_come_from_the_pool() -> None:
    from edgekv_bench.workload import RAG_INSTRUCTION, passages, rag_workload

    pool = {t for _, t in passages()}
    reqs = rag_workload(200, seed=5)
    assert reqs == rag_workload(200, seed=5) and reqs != rag_workload(200, seed=6)
    orders = defaultdict(set)
    for r in reqs:
        assert r.messages is not None
        (role, system), (urole, user) = r.messages
        assert (role, system, urole) == ("system", RAG_INSTRUCTION, "user")
        body, question = user.removeprefix("Passages:\n").split("\n\nQuestion: ")
        chosen = [p.split("] ", 1)[1] for p in body.split("\n\n[")]
        assert 3 <= len(chosen) <= 6 and set(chosen) <= pool
        assert len(set(chosen)) == len(chosen)
        own = {t for name, t in passages() if name == r.cluster}
        assert len(own & set(chosen)) >= 2  # the question's own document is retrieved
        orders[r.intent].add(chosen[0])
    # the same question comes with another first passage: what defeats a prefix cache
    assert sum(len(o) > 1 for o in orders.values()) >= len(orders) // 2


def test_header_workload_puts_a_dynamic_header_before_the_shared_prompt() -> None:
    from edgekv_bench.workload import HEADER_USERS, header_workload, seed_workload

    base, reqs = seed_workload(90, seed=2), header_workload(90, seed=2, days=3)
    headers = set()
    for b, r in zip(base, reqs):
        assert b.messages is not None and r.messages is not None
        header, shared = r.messages[0][1].split("\n\n", 1)
        assert shared == b.messages[0][1] and r.messages[1:] == b.messages[1:]
        assert any(u in header for u in HEADER_USERS) and "2026-11-0" in header
        headers.add(header)
    assert len({h.split(".")[0] for h in headers}) == 3  # three days
    assert 3 < len(headers) <= 3 * len(HEADER_USERS)
    assert load_workload("rag", requests=4)[0] == "rag"
    assert load_workload("header", requests=4)[0] == "header"
