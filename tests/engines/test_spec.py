"""Speculative decoding on the fake engine: the n-gram drafter, the draft-length policy, and
`speculative_loop` giving plain decoding's tokens, logits, grammar steps and engine state."""

from __future__ import annotations

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, open_store
from edgekv.engines import probe as probe_mod
from edgekv.engines.base import DraftVerifier
from edgekv.engines.fake import FakeAdapter
from edgekv.engines.probe import speculation_check
from edgekv.engines.probe_spec import SPEC_SCHEDULE, draft_verify_diff
from edgekv.engines.shared import speculative_loop
from edgekv.engines.spec import (
    DraftPolicy,
    NGramDrafter,
    SpecConfig,
    Speculation,
    StepCosts,
)
from edgekv.errors import ConfigError


class CopyingFake(FakeAdapter):
    """The fake engine with a taste for repeating itself: a bonus on the token `period` back
    (the prompt's repeat unit; the fake's logits still depend on every K and V held), so
    answers copy their context and n-gram drafts get accepted, as on a RAG answer."""

    def __init__(self, period: int = 29, bonus: float = 12.0, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.period, self.bonus = period, bonus

    def _logits(self) -> np.ndarray:
        out = super()._logits()
        if len(self._ids) >= self.period:
            out[self._ids[-self.period]] += self.bonus
        return out


class CheapBatches(StepCosts):
    """Step costs of an engine where a batch costs little more than a step (what a
    memory-bound engine measures): the fake computes every position alone, so its own
    timings would keep drafts short, and these tests want long runs of drafts."""

    def observe(self, n: int, seconds: float) -> None:
        pass

    def ratio(self, n: int) -> float:
        return 1.0 + 0.05 * (n - 1)


def cheap() -> Speculation:
    return Speculation(costs=CheapBatches(11))


def _prompt(a: FakeAdapter) -> list[int]:
    return a.tokenize("repeat: the quick brown fox. " * 3)


def _plain_and_spec(make, max_tokens=40, **kw):
    """The same request through plain decoding and through speculation, each on a fresh
    engine: (plain generation, plain engine, speculative generation, its engine)."""
    out = []
    for spec in (None, cheap()):
        a = make()
        logits = a.prefill(_prompt(a), align=a.n_ctx)
        gen = a.generate(logits, max_tokens, speculation=spec, **kw)
        out += [gen, a]
    return out


def _same_state(a: FakeAdapter, b: FakeAdapter) -> None:
    assert a.token_ids == b.token_ids
    assert all(np.array_equal(x, y) for x, y in zip(a._k, b._k, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(a._v, b._v, strict=True))


# -- the draft source -----------------------------------------------------------------------


def test_drafter_proposes_what_followed_the_longest_match():
    d = NGramDrafter([1, 2, 3, 4, 5, 9, 3, 4, 7, 8, 2, 3, 4], SpecConfig(n_min=1, n_max=3))
    # "2 3 4" occurred at the start, followed by 5 9 3; "3 4" last occurred before 7 8
    assert d.propose(3) == [5, 9, 3]
    d.extend([6])  # "3 4 6" is new; "4 6", "6": never seen before
    assert d.propose(4) == []
    d.extend([1, 2])  # "6 1 2"? no; "1 2": at the start, followed by 3 4 5 9
    assert d.propose(4) == [3, 4, 5, 9]
    assert d.propose(0) == []


def test_drafter_index_is_bounded_and_ignores_short_matches():
    d = NGramDrafter([], SpecConfig(n_min=2, n_max=2, window=8))
    d.extend(list(range(30)))
    assert len(d.tokens) <= 16  # rebuilt over the last `window` tokens once past twice that
    d.extend([d.tokens[-5]])  # a single repeated token is below n_min=2: no draft
    assert d.propose(3) == []
    with pytest.raises(ConfigError):
        SpecConfig(n_min=3, n_max=2)


def test_policy_stops_drafting_where_drafts_fail_and_tries_again_later():
    cfg = SpecConfig(fail_limit=2, pause_steps=3, max_pause=6)
    costs = StepCosts(cfg.k_max + 1)
    p = DraftPolicy(cfg, costs)
    assert p.length(room=20) > 0
    for _ in range(2):
        p.observe(drafted=4, accepted=0)
    assert [p.length(room=20) for _ in range(3)] == [0, 0, 0]  # paused
    assert p.length(room=20) > 0  # then drafts again
    for _ in range(2):
        p.observe(drafted=1, accepted=0)
    assert [p.length(room=20) for _ in range(6)] == [0] * 6  # the pause doubled
    assert p.length(room=0) == 0  # no room: the model's own token only


def test_policy_grows_with_acceptance_and_weighs_the_step_cost():
    cfg = SpecConfig(k_max=10)
    costs = StepCosts(cfg.k_max + 1)
    p = DraftPolicy(cfg, costs)
    for _ in range(6):
        p.observe(drafted=p.limit, accepted=p.limit)
    costs.observe(1, 0.010)
    costs.observe(11, 0.013)  # a batch of 11 costs 1.3 steps: long drafts pay
    assert p.length(room=50) == 10
    costs2 = StepCosts(cfg.k_max + 1)
    costs2.observe(1, 0.010)
    costs2.observe(2, 0.020)  # every extra token costs a whole step: drafting never pays
    costs2.observe(11, 0.110)
    p2 = DraftPolicy(cfg, costs2)
    p2.accept_rate = 0.9
    assert p2.length(room=50) == 0


def test_step_costs_interpolate_between_measured_sizes():
    c = StepCosts(10)
    assert c.ratio(1) == 1.0 and c.ratio(3) == pytest.approx(2.0)  # the prior, unmeasured
    c.observe(1, 0.01)
    c.observe(5, 0.02)
    assert c.ratio(5) == pytest.approx(2.0)
    assert c.ratio(3) == pytest.approx(1.5)
    assert c.ratio(9) == pytest.approx(3.0)  # past the largest: the slope extended


# -- exactness against plain decoding --------------------------------------------------------


def test_greedy_speculation_gives_plain_tokens_logits_and_kv():
    plain, pa, spec, sa = _plain_and_spec(CopyingFake, keep_logits=True)
    assert spec.tokens == plain.tokens and len(plain.tokens) == 40
    assert all(np.array_equal(x, y) for x, y in zip(plain.logits, spec.logits, strict=True))
    assert spec.accepted > 10 and spec.drafted >= spec.accepted  # copies were drafted
    assert plain.drafted == plain.accepted == 0
    _same_state(pa, sa)  # rejected drafts left no cell: prompt + answer less its last token
    assert sa.computed_tokens < sa.n_tokens + spec.drafted  # fewer batches than tokens


@pytest.mark.parametrize("temperature,top_p,seed", [(0.8, 1.0, 3), (1.0, 0.9, 11), (2.0, 1.0, 5)])
def test_seeded_speculation_draws_the_same_random_stream(temperature, top_p, seed):
    plain, pa, spec, sa = _plain_and_spec(CopyingFake, max_tokens=48, temperature=temperature,
                                          top_p=top_p, seed=seed)
    assert spec.tokens == plain.tokens
    _same_state(pa, sa)
    assert spec.drafted > 0


class Forbid:
    """A constraint that forbids a set of tokens and logs what it saw (a grammar's shape)."""

    def __init__(self, banned: set[int]) -> None:
        self.banned, self.masked, self.accepted = banned, 0, []

    def mask(self, logits: np.ndarray) -> np.ndarray:
        self.masked += 1
        out = logits.copy()
        out[list(self.banned)] = -np.inf
        return out

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def test_constraint_sees_the_steps_of_plain_decoding():
    a = CopyingFake()
    banned = {_prompt(a)[7]}  # a token the copy would take: drafts holding it are rejected
    runs = []
    for spec in (None, cheap()):
        c = Forbid(banned)
        a = CopyingFake()
        logits = a.prefill(_prompt(a), align=a.n_ctx)
        runs.append((a.generate(logits, 40, constraint=c, speculation=spec), c, a))
    (plain, cp, pa), (spec, cs, sa) = runs
    assert spec.tokens == plain.tokens and not banned & set(spec.tokens)
    assert (cs.masked, cs.accepted) == (cp.masked, cp.accepted)  # no draft reached the state
    _same_state(pa, sa)


@pytest.mark.parametrize("stop_at", [1, 5, 17])
def test_a_stop_inside_accepted_drafts_leaves_plain_state(stop_at):
    def stopper():
        seen: list[int] = []

        def on_token(t: int) -> bool:
            seen.append(t)
            return len(seen) < stop_at

        return on_token, seen

    runs = []
    for spec in (None, cheap()):
        a = CopyingFake()
        on_token, seen = stopper()
        logits = a.prefill(_prompt(a), align=a.n_ctx)
        runs.append((a.generate(logits, 40, on_token=on_token, speculation=spec), seen, a))
    (plain, sp, pa), (spec, ss, sa) = runs
    assert spec.tokens == plain.tokens and len(spec.tokens) == stop_at
    assert ss == sp and spec.stopped_by_callback and spec.finish_reason == "stop"
    _same_state(pa, sa)


def test_end_of_sequence_and_max_tokens_end_where_plain_ends():
    class Ending(CopyingFake):  # end-of-sequence (token 0) once 23 answer tokens are held
        def _logits(self) -> np.ndarray:
            out = super()._logits()
            if len(self._ids) >= self.prompt_len + 23:
                out[0] += 100.0
            return out

    for max_tokens in (1, 2, 7, 24, 60):
        runs = []
        for spec in (None, cheap()):
            a = Ending()
            a.prompt_len = len(_prompt(a))
            logits = a.prefill(_prompt(a), align=a.n_ctx)
            runs.append((a.generate(logits, max_tokens, speculation=spec), a))
        (plain, pa), (spec, sa) = runs
        assert spec.tokens == plain.tokens, max_tokens
        assert spec.stopped_by_eos == plain.stopped_by_eos
        _same_state(pa, sa)


def test_no_repeats_cost_no_batches():
    """A context without repeats: nothing is drafted, every step is a plain one."""
    a = FakeAdapter(vocab=257)
    logits = a.prefill(list(range(1, 200)), align=a.n_ctx)
    before = a.counters.batches
    gen = speculative_loop(a, logits, 12, temperature=0.0, seed=0, keep_logits=False,
                           speculation=Speculation())
    assert gen.drafted <= 6  # the fake's answer may repeat a pair of its own now and then
    assert a.counters.batches - before == 11 - gen.accepted


# -- the probe's schedule and the gate ---------------------------------------------------------


def test_probe_schedule_passes_on_an_invariant_engine_and_fails_on_a_variant_one():
    toks = probe_mod.probe_tokens(FakeAdapter())
    name, diff, same = draft_verify_diff(FakeAdapter(), toks)
    assert name == SPEC_SCHEDULE and diff == 0.0 and same
    _, diff, same = draft_verify_diff(FakeAdapter(batch_variant=True), toks)
    assert diff > 0 and not same
    assert isinstance(FakeAdapter(), DraftVerifier)


def test_gate_follows_the_probe(monkeypatch):
    monkeypatch.setattr(probe_mod, "_checked", {})
    a = FakeAdapter()
    ok = probe_mod.probe_batch_invariance(a)
    assert speculation_check(a, ok)[0]
    assert not speculation_check(a, None)[0]
    row = (SPEC_SCHEDULE, 0.5, False)
    ok, why = speculation_check(a, _with_notes(ok, (row,)))
    assert not ok and "differ" in why


def _with_notes(p: probe_mod.ProbeResult, notes: tuple) -> probe_mod.ProbeResult:
    import dataclasses

    return dataclasses.replace(p, notes=notes)


def test_edgekv_speculates_only_where_configured_and_allowed(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_mod, "_memo", {})
    monkeypatch.setattr(probe_mod, "_checked", {})
    unit = "repeat this: the hub connects lights, thermostats and sensors. "
    prompt, n = unit * 4, len(unit)
    results = {}
    for name, adapter, spec in (("plain", CopyingFake(n), "none"),
                                ("ngram", CopyingFake(n), "ngram"),
                                ("variant", CopyingFake(n, batch_variant=True), "ngram")):
        cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path / name, speculative=spec)
        kv = EdgeKV(adapter, open_store(cfg), cfg)
        results[name] = (kv.generate(prompt, max_tokens=32, use_cache=False), kv)
    (plain, kp), (spec, ks), (variant, kvar) = (results[n] for n in ("plain", "ngram",
                                                                      "variant"))
    assert kp.speculation is None and "speculative=none" in kp.speculation_reason
    assert ks.speculation is not None and spec.tokens == plain.tokens
    assert spec.accepted_tokens > 0 and spec.summary()["accepted_tokens"] == \
        spec.accepted_tokens
    assert spec.drafted_tokens >= spec.accepted_tokens
    assert ks.speculation.stats()["accepted"] == spec.accepted_tokens
    assert kvar.speculation is None and "not batch-invariant" in kvar.speculation_reason
    assert variant.drafted_tokens == 0
    off = ks.generate(prompt, max_tokens=32, use_cache=False, speculative=False)
    assert off.tokens == plain.tokens and off.drafted_tokens == 0
    with pytest.raises(ConfigError):
        CacheConfig(speculative="medusa")


def test_the_ceiling_replay_counts_what_the_drafter_would_have_had_accepted():
    from tests.scriptkit import load_script

    vc = load_script("verify_cost")
    cost = {n: 1.0 + 0.5 * (n - 1) for n in range(1, 12)}
    prompt, answer = [1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 9, 9]
    cfg = SpecConfig(n_min=1)
    # after the answer's first token (3) the drafter proposes the prompt's 4 5 6 ...: 4 5 accepted
    oracle = vc.replay(prompt, answer, None, cost, cfg)
    assert oracle["tokens"] == 5 and oracle["accepted"] == oracle["drafted"] == 2
    fixed = vc.replay(prompt, answer, 3, cost, cfg)
    assert fixed["drafted"] >= fixed["accepted"] == oracle["accepted"]
    assert oracle["decode_steps"] <= fixed["decode_steps"]
    plain = vc.replay(prompt, [8, 8], 3, cost, SpecConfig(n_min=2))  # nothing to match
    assert plain == {"tokens": 2, "steps": 2, "decode_steps": 2.0, "drafted": 0, "accepted": 0}
