"""The slots' step budget (stall-free prefill, `engines.llamacpp_slots`): the step cost fitted
to measured steps, and a step's plan: every decode token, prefill cut to what the budget fits
while generations run, whole `max_batch` pieces while none does. The real engine's answers
under the budget: tests/cache/test_real_parallel.py."""

from __future__ import annotations

import threading
import time

import pytest

from edgekv.engines.llamacpp_slots import FIRST_PIECE, MIN_PIECE, SlotPool, StepCost, _Work


def test_the_step_cost_is_the_line_through_the_measured_steps():
    cost = StepCost()
    assert cost.line() is None and cost.tokens_within(0.1) is None
    for n in (1, 4, 8, 64, 512, 3, 100):
        cost.observe(n, 0.004 + 0.006 * n)
    fixed, per_token = cost.line()
    assert fixed == pytest.approx(0.004) and per_token == pytest.approx(0.006)
    assert cost.tokens_within(0.1) == 16  # (100 - 4) / 6
    assert cost.tokens_within(0.001) == 0
    assert cost.longest_s == pytest.approx(0.004 + 0.006 * 512)


def test_one_batch_size_seen_counts_all_of_it_per_token():
    cost = StepCost()
    cost.observe(10, 0.05)
    cost.observe(10, 0.05)
    assert cost.line() == (0.0, pytest.approx(0.005))


def test_recent_steps_count_most():
    cost = StepCost(decay=0.5)
    for n in (1, 100) * 10:
        cost.observe(n, 0.01 * n)  # a slow machine...
    for n in (1, 100) * 20:
        cost.observe(n, 0.001 * n)  # ...that got fast
    assert cost.line()[1] == pytest.approx(0.001, rel=1e-3)


def pool(budget: float | None, max_batch: int = 512) -> SlotPool:
    """A pool's planner alone (no engine): what `_plan` reads."""
    p = SlotPool.__new__(SlotPool)
    p.max_batch, p.step_budget_s, p.cost, p.budgeted_steps = max_batch, budget, StepCost(), 0
    p.gather_s, p.late_s, p._fed = 0.004, 0.02, False
    p._cond, p._pending, p._stepping, p._closed = threading.Condition(), {}, {}, False
    return p


def decode(seq: int) -> _Work:
    return _Work(seq, [7], 100, seq)


def prompt(seq: int, n: int) -> _Work:
    return _Work(seq, list(range(n)), 0, 10 + seq)


def test_running_generations_get_every_token_and_prefill_what_fits():
    p = pool(0.1)
    for n in (1, 50, 200):
        p.cost.observe(n, 0.002 + 0.004 * n)  # 24 tokens in 100 ms
    work = [decode(0), decode(1), prompt(2, 600)]
    items, taken = p._plan(work, running=True)
    assert [(w.seq, n) for w, n in taken] == [(0, 1), (1, 1), (2, 22)]
    assert len(items) == 24 and p.budgeted_steps == 1
    assert [i[2] for i in items[:2]] == [0, 1] and all(i[3] for i in items[:2])
    assert not any(i[3] for i in items[2:])  # no logits before the prompt's last token


def test_with_nothing_decoding_a_prompt_goes_in_max_batch_pieces():
    p = pool(0.1)
    p.cost.observe(100, 1.0)
    items, taken = p._plan([prompt(0, 600), prompt(1, 50)], running=False)
    assert [(w.seq, n) for w, n in taken] == [(0, 512)] and p.budgeted_steps == 0


def test_a_minimum_piece_goes_in_however_many_generations_run():
    p = pool(0.01)
    p.cost.observe(1, 0.02)  # one decode token alone is over the budget
    work = [decode(s) for s in range(8)] + [prompt(8, 100), prompt(9, 100)]
    _, taken = p._plan(work, running=True)
    assert [n for _, n in taken] == [1] * 8 + [MIN_PIECE]


def test_before_any_step_a_first_piece_and_without_a_budget_max_batch():
    _, taken = pool(0.1)._plan([decode(0), prompt(1, 600)], running=True)
    assert [n for _, n in taken] == [1, max(FIRST_PIECE - 1, MIN_PIECE)]
    _, taken = pool(None)._plan([decode(0), prompt(1, 600)], running=True)
    assert [n for _, n in taken] == [1, 511]


def test_a_prompt_that_fits_ends_and_the_next_one_starts_in_the_same_step():
    p = pool(0.1)
    p.cost.observe(1, 0.001)
    p.cost.observe(50, 0.05)  # 100 tokens in 100 ms
    work = [decode(0), prompt(1, 30), prompt(2, 600)]
    items, taken = p._plan(work, running=True)
    assert [(w.seq, n) for w, n in taken] == [(0, 1), (1, 30), (2, 69)]
    assert items[30][3]  # the first prompt's last token has its logits


def test_steps_beside_the_cache_work_measure_a_slowdown_and_leave_the_line_alone():
    cost = StepCost(slowdown_decay=0.5)
    for n in (1, 50, 200):
        cost.observe(n, 0.002 + 0.004 * n)
    line = cost.line()
    assert cost.slowdown == 1.0 and cost.tokens_within(0.1, shared=True) == 24
    for _ in range(20):
        cost.observe(24, 1.5 * (0.002 + 0.004 * 24), shared=True)  # the cores are shared
    assert cost.line() == line  # not fitted: the line is the step with the CPU to itself
    assert cost.slowdown == pytest.approx(1.5, rel=1e-3)
    assert cost.tokens_within(0.1) == 24
    assert cost.tokens_within(0.1, shared=True) == 16  # (100 / 1.5 - 2) / 4
    cost.observe(24, 0.5 * (0.002 + 0.004 * 24), shared=True)  # faster than alone: noise
    assert cost.slowdown >= 1.0


def test_what_the_streams_waited_since_the_last_step_comes_off_the_budget():
    p = pool(0.2)
    for n in (1, 50, 200):
        p.cost.observe(n, 0.002 + 0.004 * n)  # 49 tokens in 200 ms
    work = [decode(0), prompt(1, 600)]
    _, taken = p._plan(work, running=True, waited_s=0.04)  # a state read held the context
    assert [n for _, n in taken] == [1, 38]  # (160 - 2) / 4 = 39 tokens in all
    _, taken = p._plan(work, running=True, waited_s=0.5)
    assert [n for _, n in taken] == [1, MIN_PIECE]  # the budget is gone: the minimum piece
    _, taken = p._plan(work, running=False, waited_s=0.5)
    assert [n for _, n in taken] == [1, 511]  # nothing runs: no budget


def test_a_step_beside_the_cache_work_is_planned_at_the_measured_slowdown():
    p = pool(0.2)
    for n in (1, 50, 200):
        p.cost.observe(n, 0.002 + 0.004 * n)
    p.cost.slowdown = 2.0
    _, taken = p._plan([decode(0), prompt(1, 600)], running=True, shared=True)
    assert [n for _, n in taken] == [1, 23]  # (100 - 2) / 4 = 24 tokens in all
    _, taken = p._plan([decode(0), prompt(1, 600)], running=True)
    assert [n for _, n in taken] == [1, 48]


def test_a_step_is_predicted_from_the_line_and_logged_at_debug(caplog):
    from edgekv.engines.llamacpp_slots import _log_step

    cost = StepCost()
    assert cost.predict(10) is None
    for n in (1, 50, 200):
        cost.observe(n, 0.002 + 0.004 * n)
    assert cost.predict(24) == pytest.approx(0.098)
    cost.slowdown = 1.5
    assert cost.predict(24, shared=True) == pytest.approx(0.147)
    p = prompt(2, 600)
    p.sent = 128  # its next piece starts at position 128
    items = [(7, 100, 0, True), (8, 101, 1, True)] + [(t, 128 + t, 2, False) for t in range(20)]
    with caplog.at_level("DEBUG", logger="edgekv.engines.llamacpp_slots"):
        _log_step(items, [(decode(0), 1), (decode(1), 1), (p, 20)], True, 0.0123, 0.098, 0.1501,
                  False)
    [line] = caplog.messages
    assert line == ("step: 22 tokens, 2 decode, prefill 20@128, context <= 148, running True, "
                    "shared False, waited 12.3 ms, predicted 98.0 ms, took 150.1 ms")


def test_after_a_state_read_held_the_streams_a_fed_prompt_skips_its_minimum_piece():
    """A state read or write that held the context past the rendezvous already cost the
    streams their budget: where the last step fed the prompts, this one takes only what the
    budget fits (here nothing); a prompt the last step did not feed still gets its piece."""
    p = pool(0.1)
    for n in (1, 50, 200):
        p.cost.observe(n, 0.002 + 0.004 * n)
    work = [decode(0), decode(1), prompt(2, 600)]
    p._fed = True
    _, taken = p._plan(work, running=True, waited_s=0.12, held_s=0.1)
    assert [n for _, n in taken] == [1, 1]
    _, taken = p._plan(work, running=True, waited_s=0.12, held_s=0.001)  # the rendezvous
    assert [n for _, n in taken] == [1, 1, MIN_PIECE]
    p._fed = False
    _, taken = p._plan(work, running=True, waited_s=0.12, held_s=0.1)
    assert [n for _, n in taken] == [1, 1, MIN_PIECE]


def test_the_rendezvous_waits_longer_before_a_step_that_holds_a_prompt():
    """A stream that misses a step holding a prompt's piece waits all of it: the rendezvous
    gives a stepping slot `late_s` from its logits there, `gather_s` before a decode-only
    step, and nothing to a slot whose logits are older than that."""
    p = pool(0.1)
    now = time.perf_counter()
    p._pending = {0: decode(0)}
    p._stepping = {1: now}
    assert p._late() == pytest.approx(now + p.gather_s)
    p._pending[2] = prompt(2, 600)
    assert p._late() == pytest.approx(now + p.late_s)
    p._stepping = {1: now - 1.0}  # stepped a second ago and went on to something else
    assert p._late() <= now

    # a stream that hands in 50 ms after its logits (over gather_s) joins the prompt's step
    p.late_s = 5.0  # (a loaded machine may wake the thread late)
    p._pending, p._stepping = {2: prompt(2, 600)}, {1: time.perf_counter()}

    def late_hand_in() -> None:
        time.sleep(0.05)
        with p._cond:
            p._pending[1] = decode(1)
            p._stepping.pop(1)
            p._cond.notify_all()

    t = threading.Thread(target=late_hand_in)
    t.start()
    work, running = p._gather()
    t.join()
    assert [w.seq for w in work] == [1, 2] and running


def test_a_slot_doing_the_cache_work_is_not_waited_for():
    """A slot's cache work (`Slot.aside`: an early store after its first token) is not its
    next token: the rendezvous stops waiting for it, and the steps meanwhile are shared."""
    from types import SimpleNamespace

    from edgekv.engines.llamacpp_slots import Slot

    p = pool(0.1)
    p._aside = p._asides = 0
    p.adapter = SimpleNamespace(fingerprint=None, window=None, weight_bytes=0, n_threads=2,
                                n_ctx=2048)
    slot = Slot(p, 1)
    p._pending, p._stepping = {2: prompt(2, 600)}, {1: time.perf_counter()}
    assert p._late() > time.perf_counter()
    with slot.aside():
        assert p._late() == 0.0 and p._aside == 1
    assert p._aside == 0
