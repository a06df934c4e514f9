"""Generations on several sequences at once share the prompt chunks one of them is computing:
the first claims them and stores them once its first token is out; another whose next chunk is
claimed waits for that and reuses them instead of computing them beside it (`EdgeKV.generate`,
`edgekv serve --parallel`). Fake engine; the real slots: tests/cache/test_real_parallel.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, open_store
from edgekv.engines import probe as probe_mod
from edgekv.engines.base import SharedCPU
from edgekv.engines.fake import FakeAdapter
from edgekv.errors import EngineError

SHARED = "System: you answer questions about the hub and its sensors, briefly. " * 4  # ~290


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    monkeypatch.setattr(probe_mod, "_memo", {})


class Gated(FakeAdapter):
    """A sequence whose prompt prefill (more than one token) signals `entered`, then waits
    for `gate` (or raises, with `fail`)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.entered, self.gate, self.fail = threading.Event(), threading.Event(), fail

    def prefill(self, tokens: Sequence[int], *, align: int) -> np.ndarray:
        if len(tokens) > 1:
            self.entered.set()
            assert self.gate.wait(10)
            if self.fail:
                raise EngineError("the sequence's decode failed")
        return super().prefill(tokens, align=align)


def plain(prompt: str, max_tokens: int) -> list[int]:
    a = FakeAdapter()
    return list(a.generate(a.prefill(a.tokenize(prompt), align=a.n_ctx), max_tokens).tokens)


@pytest.fixture
def kv(tmp_path):
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path)
    k = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
    assert k.token_exact
    yield k
    k.close()


def start(kv: EdgeKV, prompt: str, seq: FakeAdapter, out: dict[str, object],
          **kw: object) -> threading.Thread:
    def run() -> None:
        try:
            out["result"] = kv.generate(prompt, max_tokens=8, sequence=seq, **kw)
        except Exception as e:  # the test reads it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def joined(*threads: threading.Thread) -> None:
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a generation did not finish"


def wait_until(cond, timeout: float = 10) -> None:
    done = threading.Event()
    while not cond():
        assert not done.wait(0.005) and timeout > 0, "timed out"
        timeout -= 0.005


def test_a_request_waits_for_the_chunks_another_is_computing_and_reuses_them(kv, tmp_path):
    a, b = Gated(), FakeAdapter()
    pa, pb = SHARED + "User: reset?", SHARED + "User: pair a sensor?"
    ra: dict[str, object] = {}
    rb: dict[str, object] = {}
    answer_a = threading.Event()  # A stops at its second token until B is done
    tokens_a: list[int] = []

    def hold(tok: int) -> bool:
        tokens_a.append(tok)
        assert len(tokens_a) == 1 or answer_a.wait(10)
        return True

    ta = start(kv, pa, a, ra, on_token=hold)
    assert a.entered.wait(10)  # A matched nothing and claimed the shared chunks
    tb = start(kv, pb, b, rb)
    wait_until(lambda: kv.inflight_waits == 1)  # B found its first chunk claimed
    assert b.computed_tokens == 0
    a.gate.set()
    joined(tb)  # B finished while A is still at its second token: the early store served it
    assert ta.is_alive()
    answer_a.set()
    joined(ta)
    res_a, res_b = ra["result"], rb["result"]
    shared = len(kv.adapter.tokenize(SHARED)) // 64 * 64
    assert res_a.cached_tokens == 0 and res_b.cached_tokens >= shared
    assert res_b.computed_tokens <= len(kv.adapter.tokenize(pb)) - shared  # the rest only
    assert list(res_a.tokens) == plain(pa, 8) and list(res_b.tokens) == plain(pb, 8)
    assert res_b.wait_s > 0 and res_b.lookup_s < res_b.wait_s
    # A stored, early and late together, what it stores one at a time: each fragment once
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path / "alone")
    alone = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
    try:
        assert res_a.stored_fragments == alone.generate(pa, max_tokens=8).stored_fragments
    finally:
        alone.close()
    assert kv._computing == {} and kv.inflight_wait_s > 0


PB = SHARED + "User: pair a sensor?"


def claim_then_wait(kv: EdgeKV, a: Gated, b: FakeAdapter, **kw: object
                    ) -> tuple[threading.Thread, threading.Thread, dict[str, object],
                               dict[str, object]]:
    """A claims the shared chunks (held at its prefill), then B (prompt `PB`) starts on the
    same prefix: (A's thread, B's, A's outcome, B's)."""
    ra: dict[str, object] = {}
    rb: dict[str, object] = {}
    ta = start(kv, SHARED + "User: reset?", a, ra)
    assert a.entered.wait(10)
    return ta, start(kv, PB, b, rb, **kw), ra, rb


def test_a_failed_generation_leaves_its_waiters_to_compute(kv):
    a, b = Gated(fail=True), FakeAdapter()
    pb = PB
    ta, tb, ra, rb = claim_then_wait(kv, a, b)
    wait_until(lambda: kv.inflight_waits == 1)
    a.gate.set()
    joined(ta, tb)
    assert isinstance(ra["error"], EngineError)
    res_b = rb["result"]
    assert res_b.cached_tokens == 0 and list(res_b.tokens) == plain(pb, 8)
    assert kv._computing == {}


def test_requests_that_store_nothing_claim_nothing_and_cold_ones_never_wait(kv):
    """A cold request (use_cache=False) computes for itself: it makes no one wait, and it
    waits for no one."""
    a, b, c = Gated(), FakeAdapter(), FakeAdapter()
    ra: dict[str, object] = {}
    ta = start(kv, SHARED + "x", a, ra, use_cache=False)
    assert a.entered.wait(10)
    assert kv._computing == {}
    res = kv.generate(SHARED + "y", max_tokens=4, sequence=b)  # does not wait for A
    assert res.cached_tokens == 0 and kv.inflight_waits == 0
    a.gate.set()
    joined(ta)
    assert list(ra["result"].tokens) == plain(SHARED + "x", 8)
    g = Gated()  # now one that claims, and a cold one beside it
    rg: dict[str, object] = {}
    other = "Another deployment answers about the thermostat schedule. " * 6
    tg = start(kv, other, g, rg)
    assert g.entered.wait(10) and kv._computing
    cold = kv.generate(other, max_tokens=4, sequence=c, use_cache=False)
    assert cold.cached_tokens == 0 and cold.wait_s == 0 and kv.inflight_waits == 0
    g.gate.set()
    joined(tg)


def test_with_no_one_waiting_nothing_is_stored_before_the_last_token(kv):
    """The early store only serves a waiting request: alone, the second token is not delayed
    by it, and the prompt's chunks are stored with the answer, as one at a time."""
    prompt = SHARED + "User: reset?"
    seen: list[int] = []

    def on_token(tok: int) -> bool:
        if len(seen) == 1:  # the second token: the first one's claim has ended
            m = kv.lookup(kv.adapter.tokenize(prompt))
            seen.append(m.n_tokens)
            m.release()
            assert kv._computing == {}
        else:
            seen.append(-1)
        return True

    res = kv.generate(prompt, max_tokens=4, sequence=FakeAdapter(), on_token=on_token)
    assert seen[1] == 0 and res.stored_fragments > 0 and kv.inflight_waits == 0
    m = kv.lookup(kv.adapter.tokenize(prompt))
    assert m.n_tokens >= 256
    m.release()


def test_a_wait_ends_at_its_timeout_and_the_waiter_computes_for_itself(kv):
    """A producer slower than `inflight_timeout_s`: the waiter stops waiting and computes the
    chunks itself (exact as ever), and does not wait again."""
    kv.inflight_timeout_s = 0.2
    a, b = Gated(), FakeAdapter()
    pb = PB
    ta, tb, ra, rb = claim_then_wait(kv, a, b)
    joined(tb)  # while A is still held at its prefill
    assert ta.is_alive() and kv.inflight_waits == 1 and kv.inflight_timeouts == 1
    res_b = rb["result"]
    assert res_b.cached_tokens == 0 and list(res_b.tokens) == plain(pb, 8)
    assert 0.2 <= res_b.wait_s < 5
    a.gate.set()
    joined(ta)
    assert kv._computing == {}


def test_a_waiter_whose_client_left_stops_waiting(kv):
    from edgekv.errors import Cancelled

    a, b = Gated(), FakeAdapter()
    gone = threading.Event()
    ta, tb, ra, rb = claim_then_wait(kv, a, b, cancelled=gone)
    wait_until(lambda: kv.inflight_waits == 1)
    gone.set()
    joined(tb)  # A still computes: B left without it
    assert isinstance(rb["error"], Cancelled) and ta.is_alive()
    assert b.computed_tokens == 0  # it computed nothing
    a.gate.set()
    joined(ta)
    assert kv._computing == {}


def test_waiters_woken_by_a_failed_producer_do_not_chain_behind_each_other(kv):
    """Two wait for A; A fails. Each computes for itself: neither waits for the other's new
    claim (a second wait would serialize them behind each other)."""
    a = Gated(fail=True)
    b, c = Gated(), Gated()
    outs: list[dict[str, object]] = [{}, {}, {}]
    ta = start(kv, SHARED + "User: reset?", a, outs[0])
    assert a.entered.wait(10)
    tb = start(kv, SHARED + "User: pair a sensor?", b, outs[1])
    tc = start(kv, SHARED + "User: what does orange mean?", c, outs[2])
    wait_until(lambda: kv.inflight_waits == 2)
    a.gate.set()
    joined(ta)
    # both compute the shared chunks at once: neither waits for the other's claim
    wait_until(lambda: b.entered.is_set() and c.entered.is_set())
    b.gate.set()
    c.gate.set()
    joined(tb, tc)
    assert isinstance(outs[0]["error"], EngineError)
    for out, p in ((outs[1], "User: pair a sensor?"), (outs[2], "User: what does orange mean?")):
        assert list(out["result"].tokens) == plain(SHARED + p, 8)
    assert kv._computing == {}


def test_chunks_stored_early_carry_the_route_semantic_routing_gives(tmp_path):
    """With a router, the chunks a producer stores early for its waiters get their route (an
    index entry, found by meaning), as chunks stored after the answer do, and the prompt is
    embedded once."""
    from edgekv import open_router
    from edgekv.semantic import HashEmbedder

    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path)
    store = open_store(cfg)
    router = open_router(HashEmbedder(), store, cfg)
    kv = EdgeKV(FakeAdapter(), store, cfg, router=router)
    routed: list[str] = []
    route = router.route
    router.route = lambda text: routed.append(text) or route(text)  # type: ignore[method-assign]
    try:
        a, b = Gated(), FakeAdapter()
        ra: dict[str, object] = {}
        rb: dict[str, object] = {}
        answer_a = threading.Event()
        seen: list[int] = []

        def hold(tok: int) -> bool:
            seen.append(tok)
            assert len(seen) == 1 or answer_a.wait(10)
            return True

        ta = start(kv, SHARED + "User: reset?", a, ra, on_token=hold)
        assert a.entered.wait(10)
        tb = start(kv, SHARED + "User: pair a sensor?", b, rb, store=False)  # adds nothing
        wait_until(lambda: kv.inflight_waits == 1)
        a.gate.set()
        joined(tb)  # B reused what A stored early, while A is held at its second token
        assert rb["result"].cached_tokens > 0 and rb["result"].stored_fragments == 0
        assert len(router.index) == 1  # A's early chunks are in the index already
        answer_a.set()
        joined(ta)
        assert routed.count(SHARED + "User: reset?") == 1  # A embedded once
        assert ra["result"].match.route is not None
    finally:
        kv.close()


class Marked(FakeAdapter):
    """A sequence that shares the CPU with its caller (`base.SharedCPU`, as a server's slot):
    records which of its calls ran inside the caller's marked cache work."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.calls: list[tuple[str, bool]] = []

    @contextmanager
    def aside(self) -> Iterator[None]:
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    def inject_fragments(self, fragments, limit=None):
        self.calls.append(("inject", self.inside > 0))
        return super().inject_fragments(fragments, limit)

    def extract_fragments(self, specs):
        self.calls.append(("extract", self.inside > 0))
        return super().extract_fragments(specs)

    def prefill(self, tokens: Sequence[int], *, align: int) -> np.ndarray:
        self.calls.append(("prefill", self.inside > 0))
        return super().prefill(tokens, align=align)


def test_the_cache_work_on_a_sequence_is_marked_and_its_decoding_is_not(kv):
    """On a sequence whose steps share the CPU (a server's slot), the cache's own work, the
    lookup and injection and the store, runs inside `aside()`, so the slots' steps plan for
    the slower cores; the sequence's own prefill and decode run outside it."""
    assert isinstance(Marked(), SharedCPU) and not isinstance(FakeAdapter(), SharedCPU)
    prompt = SHARED + "User: reset?"
    kv.generate(prompt, max_tokens=4, sequence=Marked())  # stores the prompt's chunks
    seq = Marked()
    res = kv.generate(prompt + " And the hub?", max_tokens=4, sequence=seq)
    assert res.cached_tokens > 0 and seq.inside == 0
    kinds = {k for k, _ in seq.calls}
    assert {"inject", "extract", "prefill"} <= kinds
    assert all(inside == (kind != "prefill") for kind, inside in seq.calls), seq.calls
