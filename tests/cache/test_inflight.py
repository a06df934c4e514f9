"""Generations on several sequences at once share the prompt chunks one of them is computing:
the first claims them and stores them once its first token is out; another whose next chunk is
claimed waits for that and reuses them instead of computing them beside it (`EdgeKV.generate`,
`edgekv serve --parallel`). Fake engine; the real slots: tests/cache/test_real_parallel.py."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, open_store
from edgekv.engines import probe as probe_mod
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


def start(kv: EdgeKV, prompt: str, seq: FakeAdapter, out: dict[str, object]) -> threading.Thread:
    def run() -> None:
        try:
            out["result"] = kv.generate(prompt, max_tokens=8, sequence=seq)
        except Exception as e:  # the test reads it
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t


def wait_until(cond, timeout: float = 10) -> None:
    done = threading.Event()
    while not cond():
        assert not done.wait(0.005) and timeout > 0, "timed out"
        timeout -= 0.005


def test_a_request_waits_for_the_chunks_another_is_computing_and_reuses_them(kv):
    a, b = Gated(), FakeAdapter()
    pa, pb = SHARED + "User: reset?", SHARED + "User: pair a sensor?"
    ra: dict[str, object] = {}
    rb: dict[str, object] = {}
    ta = start(kv, pa, a, ra)
    assert a.entered.wait(10)  # A matched nothing and claimed the shared chunks
    tb = start(kv, pb, b, rb)
    wait_until(lambda: kv.inflight_waits == 1)  # B found its first chunk claimed
    assert b.computed_tokens == 0
    a.gate.set()
    ta.join(10)
    tb.join(10)
    res_a, res_b = ra["result"], rb["result"]
    shared = len(kv.adapter.tokenize(SHARED)) // 64 * 64
    assert res_a.cached_tokens == 0 and res_b.cached_tokens >= shared
    assert res_b.computed_tokens <= len(kv.adapter.tokenize(pb)) - shared  # the rest only
    assert list(res_a.tokens) == plain(pa, 8) and list(res_b.tokens) == plain(pb, 8)
    assert res_a.stored_fragments > shared // 64  # the early chunks are counted too
    assert kv._computing == {} and kv.inflight_wait_s > 0


def test_a_failed_generation_leaves_its_waiters_to_compute(kv):
    a, b = Gated(fail=True), FakeAdapter()
    pb = SHARED + "User: pair a sensor?"
    ra: dict[str, object] = {}
    rb: dict[str, object] = {}
    ta = start(kv, SHARED + "User: reset?", a, ra)
    assert a.entered.wait(10)
    tb = start(kv, pb, b, rb)
    wait_until(lambda: kv.inflight_waits == 1)
    a.gate.set()
    ta.join(10)
    tb.join(10)
    assert isinstance(ra["error"], EngineError)
    res_b = rb["result"]
    assert res_b.cached_tokens == 0 and list(res_b.tokens) == plain(pb, 8)
    assert kv._computing == {}


def test_requests_that_store_nothing_claim_nothing(kv):
    """A cold request (use_cache=False) computes for itself and makes no one wait."""
    a, b = Gated(), FakeAdapter()
    ra: dict[str, object] = {}

    def run() -> None:
        ra["result"] = kv.generate(SHARED + "x", max_tokens=4, sequence=a, use_cache=False)

    t = threading.Thread(target=run)
    t.start()
    assert a.entered.wait(10)
    assert kv._computing == {}
    res = kv.generate(SHARED + "y", max_tokens=4, sequence=b)  # does not wait
    assert res.cached_tokens == 0 and kv.inflight_waits == 0
    a.gate.set()
    t.join(10)


def test_one_at_a_time_nothing_is_claimed(kv):
    kv.generate(SHARED + "x", max_tokens=4)
    res = kv.generate(SHARED + "y", max_tokens=4)
    assert kv._computing == {} and kv.inflight_waits == 0 and res.cached_tokens >= 256


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
