"""`edgekv bench spec`'s arithmetic and its fixed prompt sets (the servers' run is the bench
itself; its last run: `git show 31f77bb:docs/bench/spec.json`)."""

from __future__ import annotations

import pytest

from edgekv.errors import ConfigError
from edgekv_bench.spec import SPEC_SERVERS, Answer, _row, _speedups, loops, spec_table
from edgekv_bench.spec_prompts import (
    MAX_TOKENS,
    PROMPTS_PER_WORKLOAD,
    WORKLOADS,
    single_turn_prompts,
)


def test_a_looping_output_is_one_that_repeats_an_eight_word_run_three_times():
    assert loops("a b c d e f g h " * 3)
    assert not loops("a b c d e f g h " * 2)
    assert not loops(" ".join(str(i) for i in range(100)))


def test_the_prompt_sets_are_fixed():
    for w in WORKLOADS:
        if w != "chat":
            ps = single_turn_prompts(w)
            assert len(ps) == PROMPTS_PER_WORKLOAD and len({p.id for p in ps}) == len(ps)
            assert ps == single_turn_prompts(w)  # the same every time
        assert MAX_TOKENS[w] > 0
    with pytest.raises(ValueError):
        single_turn_prompts("chat")


def test_rows_pool_decode_time_and_compare_with_the_same_servers_plain_run():
    prompt_of = {"a": ("rag", "p"), "b": ("rag", "q")}
    answers = {
        ("edgekv_none", "a", "greedy"): Answer("x y", 0.1, 1.1, 11, 0, 0),
        ("edgekv_none", "b", "greedy"): Answer("z", 0.1, 2.1, 21, 0, 0),
        ("edgekv_ngram", "a", "greedy"): Answer("x y", 0.1, 0.6, 11, 10, 8),
        ("edgekv_ngram", "b", "greedy"): Answer("other", 0.1, 1.1, 21, 10, 2),
    }
    plain = _row("edgekv_none", "rag", "greedy", answers, prompt_of)
    spec = _row("edgekv_ngram", "rag", "greedy", answers, prompt_of)
    assert plain["decode_tok_s"] == pytest.approx(30 / 3.0)  # (10 + 20) tokens / (1 + 2) s
    assert spec["decode_tok_s"] == pytest.approx(30 / 1.5)
    assert spec["acceptance_rate"] == 0.5 and spec["identical_to_plain"] == 0.5
    assert plain["identical_to_plain"] == 1.0
    for key in ("workload", "server", "speculative", "sampling", "decode_tok_s",
                "e2el_ms_mean", "acceptance_rate", "drafted_tokens", "accepted_tokens",
                "identical_to_plain"):  # the JSON contract
        assert key in spec
    [gain] = _speedups([plain, spec])
    assert gain["decode_gain"] == pytest.approx(2.0) and gain["name"] == "edgekv_ngram"
    assert "edgekv_ngram" in spec_table({"rows": [plain, spec], "speedup": [gain]})


def test_unknown_servers_and_workloads_are_refused(tmp_path):
    from edgekv_bench.spec import run_spec_bench

    with pytest.raises(ConfigError, match="unknown workloads"):
        run_spec_bench(workdir=tmp_path, workloads=["poetry"])
    with pytest.raises(ConfigError, match="unknown servers"):
        run_spec_bench(workdir=tmp_path, servers=["vllm"])
    assert set(SPEC_SERVERS) >= {"edgekv_none", "edgekv_ngram", "llama_server_ngram_mod"}
