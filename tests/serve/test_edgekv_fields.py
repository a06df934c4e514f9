"""EdgeKV's extensions of the OpenAI API over the fake engine: `documents` (passage reuse),
`approximate`, the `edgekv` object on every response kind, the `X-EdgeKV-Tier` header and the
`/metrics` lines for tiers, streamed tokens and prefetch. The real engine's run is in
test_real_pipeline_http.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ..conftest import real_stack

real_stack("the serve extra", "fastapi", "uvicorn", "httpx", "prometheus_client", "openai")

import httpx  # noqa: E402
import openai  # noqa: E402

from edgekv import CacheConfig, EdgeKV, open_router, open_store  # noqa: E402
from edgekv.core.prefetch import Prefetcher  # noqa: E402
from edgekv.engines.fake import FakePassages  # noqa: E402
from edgekv.semantic import HashEmbedder  # noqa: E402

from .servekit import ChatFake, live_server, metric, sse_chunks  # noqa: E402

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
EDGEKV_KEYS = {"cached_tokens", "streamed_tokens", "computed_tokens", "tier", "approximate",
               "passages", "drafted_tokens", "accepted_tokens"}
SYSTEM = "You are the hub's assistant. The manual says: " + "Lights pair in ten seconds. " * 12
DOC_A = "The hub's ring turns orange while it updates its firmware; wait for it. " * 2
DOC_B = {"title": "Pairing", "text": "Hold the light's button for ten seconds to pair it. " * 2}


class ShiftingChatFake(ChatFake):
    def passage_engine(self) -> FakePassages:
        return FakePassages(self)


def _kv(tmp_path: Path, *, passages: bool = False, router: bool = False) -> EdgeKV:
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path, reuse_granularity="chunk",
                      passage_reuse=passages)
    store = open_store(cfg)
    adapter = ShiftingChatFake(n_ctx=1024) if passages else ChatFake(n_ctx=1024)
    return EdgeKV(adapter, store, cfg,
                  router=open_router(HashEmbedder(), store, cfg) if router else None)


class Spy:
    """Wraps `kv.prepare` (what the server makes of a request on arrival, handed to
    `generate` as it is): records each call's keywords."""

    def __init__(self, kv: EdgeKV) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []
        inner = kv.prepare

        def prepare(prompt: Any, **kw: Any) -> Any:
            self.calls.append((prompt, kw))
            return inner(prompt, **kw)

        kv.prepare = prepare  # type: ignore[method-assign]


@pytest.fixture
def kv(tmp_path: Path):
    k = _kv(tmp_path)
    yield k
    k.close()


@pytest.fixture
def pkv(tmp_path: Path):
    k = _kv(tmp_path, passages=True)
    yield k
    k.close()


def post(url: str, path: str, body: object) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=20)


def chat_body(question: str = "How do lights pair?", **kw: object) -> dict[str, object]:
    return {"model": "fake-model", "temperature": 0, "max_tokens": 4,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}], **kw}


def refused(r: httpx.Response, code: str, param: str | None = None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return str(err["message"])


# -- documents ---------------------------------------------------------------------------

def test_documents_reach_generate_as_passages_and_are_reused_the_second_time(pkv):
    spy = Spy(pkv)
    with live_server(pkv) as url:
        first = post(url, CHAT, chat_body(documents=[DOC_A, DOC_B])).json()
        again = post(url, CHAT, chat_body(documents=[DOC_A, DOC_B])).json()
        text = post(url, COMPLETIONS, {"model": "fake-model", "prompt": "Q: pair?\nA:",
                                       "max_tokens": 2, "documents": [DOC_A]}).json()
    prompt, kw = spy.calls[0]
    assert kw["passages"] == [DOC_A + "\n\n", "Pairing\n\n" + DOC_B["text"] + "\n\n"]
    assert prompt[0] != 1  # the chat's BOS is not repeated after the passages
    assert kw["approximate"] is False
    e1, e2 = first["edgekv"], again["edgekv"]
    assert set(e1) == EDGEKV_KEYS and e1["tier"] is None
    assert e1["passages"]["passages"] == 2 and e1["passages"]["reused_tokens"] == 0
    assert e1["approximate"] is False  # cold: computed here, in place
    assert e2["passages"]["reused_tokens"] > 0 and e2["approximate"] is True
    assert e2["computed_tokens"] < e1["computed_tokens"]
    doc_tokens = len(pkv.adapter.tokenize(DOC_A + "\n\n", add_bos=False))
    assert first["usage"]["prompt_tokens"] > doc_tokens  # documents count as prompt tokens
    assert text["edgekv"]["passages"]["passages"] == 1
    assert text["edgekv"]["passages"]["reused_tokens"] > 0  # DOC_A, cached by the chats
    assert spy.calls[2][1]["passages"] == [DOC_A + "\n\n"]


def test_no_documents_means_passages_null_and_an_empty_list_is_no_documents(pkv, kv):
    with live_server(pkv) as url:
        r = post(url, CHAT, chat_body(documents=[])).json()
        assert r["edgekv"]["passages"] is None and r["edgekv"]["approximate"] is False
    with live_server(kv) as url:  # passage reuse off: [] is still no documents
        assert post(url, CHAT, chat_body(documents=[])).status_code == 200


def test_documents_are_refused_while_passage_reuse_is_off(kv):
    with live_server(kv) as url:
        for path, body in ((CHAT, chat_body(documents=[DOC_A])),
                           (COMPLETIONS, {"model": "fake-model", "prompt": "hi",
                                          "documents": [DOC_A]})):
            msg = refused(post(url, path, body), "passage_reuse_off", "documents")
            assert "--passage-reuse" in msg


@pytest.mark.parametrize("docs,code,param", [
    ("one document", "invalid_type", "documents"),
    ([5], "invalid_type", "documents.0"),
    ([{"title": "no text"}], "missing_field", "documents.0.text"),
    ([{"text": "x", "url": "y"}], "unknown_field", "documents.0.url"),
    ([{"text": 3}], "invalid_type", "documents.0.text"),
    ([{"text": "x", "title": 3}], "invalid_type", "documents.0.title"),
    ([""], "invalid_value", "documents.0"),
    ([DOC_A, {"text": "  \n"}], "invalid_value", "documents.1.text"),
    (["d"] * 65, "context_length_exceeded", "documents"),
    (["w" * 1100], "context_length_exceeded", "documents"),  # n_ctx is 1024
])
def test_bad_documents_are_400s_that_name_the_field(pkv, docs, code, param):
    with live_server(pkv) as url:
        refused(post(url, CHAT, chat_body(documents=docs)), code, param)
        assert post(url, CHAT, chat_body()).status_code == 200  # and it keeps serving


def test_documents_and_max_tokens_that_overflow_the_context_are_refused(pkv):
    with live_server(pkv) as url:
        r = post(url, CHAT, chat_body(documents=["w" * 600], max_tokens=300))
        msg = refused(r, "context_length_exceeded", "documents")
        assert "documents" in msg and "1024" in msg


# -- approximate ---------------------------------------------------------------------------

def test_approximate_is_refused_unless_the_server_allows_it(kv):
    spy = Spy(kv)
    with live_server(kv) as url:
        msg = refused(post(url, CHAT, chat_body(approximate=True)), "approximate_not_allowed",
                      "approximate")
        assert "--approximate" in msg
        assert post(url, CHAT, chat_body(approximate=False)).status_code == 200
        refused(post(url, CHAT, chat_body(approximate="yes")), "invalid_type", "approximate")
    with live_server(kv, allow_approximate=True) as url:
        assert post(url, CHAT, chat_body(approximate=True)).status_code == 200
        assert post(url, COMPLETIONS, {"model": "fake-model", "prompt": "hi",
                                       "approximate": True}).status_code == 200
        assert post(url, CHAT, chat_body()).status_code == 200
    assert [kw["approximate"] for _, kw in spy.calls] == [False, True, True, False]


# -- the edgekv object -----------------------------------------------------------------------

def _stream(url: str, path: str, body: dict[str, object]) -> list[dict[str, Any]]:
    r = httpx.post(url + path, json={**body, "stream": True}, timeout=20)
    assert r.status_code == 200 and "x-edgekv-tier" not in r.headers
    return sse_chunks(r.text)


@pytest.mark.parametrize("include_usage", [False, True])
def test_every_response_kind_carries_edgekv_beside_usage(kv, include_usage):
    text = {"model": "fake-model", "prompt": SYSTEM + "Q?", "max_tokens": 4, "temperature": 0}
    with live_server(kv) as url:
        whole = post(url, CHAT, chat_body()).json()  # stores the prompt's chunks
        comp = post(url, COMPLETIONS, text).json()
        extra = {"stream_options": {"include_usage": True}} if include_usage else {}
        chunks = _stream(url, CHAT, chat_body(**extra))
        tchunks = _stream(url, COMPLETIONS, {**text, **extra})
    for obj in (whole, comp):
        e = obj["edgekv"]
        assert set(e) == EDGEKV_KEYS and e["tier"] is None and e["passages"] is None
        assert e["cached_tokens"] == obj["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert e["cached_tokens"] + e["streamed_tokens"] + e["computed_tokens"] == \
            obj["usage"]["prompt_tokens"]
        assert e["approximate"] is False and e["streamed_tokens"] == 0
    assert whole["edgekv"]["cached_tokens"] == 0
    for cs in (chunks, tchunks):
        assert "edgekv" in cs[-1]  # the last chunk, whichever it is
        finish = [c for c in cs if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finish) == 1 and set(finish[0]["edgekv"]) == EDGEKV_KEYS
        assert all("edgekv" not in c for c in cs if c is not finish[0] and c["choices"])
        e = finish[0]["edgekv"]
        assert e["cached_tokens"] >= 128  # the system prompt, stored by the first request
        if include_usage:
            assert cs[-1]["choices"] == [] and cs[-1]["edgekv"] == e
            assert cs[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == \
                e["cached_tokens"]
        else:
            assert cs[-1] is finish[0] and "usage" not in cs[-1]


def test_the_openai_sdk_parses_responses_with_edgekv(kv):
    with live_server(kv) as url, openai.OpenAI(base_url=url + "/v1", api_key="none",
                                                max_retries=0) as c:
        msgs = chat_body()["messages"]
        r = c.chat.completions.create(model="fake-model", messages=msgs,  # type: ignore[arg-type]
                                      max_tokens=4, temperature=0)
        again = c.chat.completions.create(model="fake-model", messages=msgs,  # type: ignore[arg-type]
                                          max_tokens=4, temperature=0)
        assert r.model_extra is not None and set(r.model_extra["edgekv"]) == EDGEKV_KEYS
        e = again.model_extra["edgekv"]  # type: ignore[index]
        assert e["cached_tokens"] == again.usage.prompt_tokens_details.cached_tokens >= 128  # type: ignore[union-attr]
        last = list(c.chat.completions.create(model="fake-model", messages=msgs,  # type: ignore[call-overload]
                                              max_tokens=4, temperature=0, stream=True))[-1]
        assert last.choices[0].finish_reason and last.model_extra["edgekv"]["cached_tokens"] >= 128
        p = c.completions.create(model="fake-model", prompt="hello", max_tokens=2)
        assert set(p.model_extra["edgekv"]) == EDGEKV_KEYS  # type: ignore[index]
        with pytest.raises(openai.BadRequestError, match="--passage-reuse"):
            c.chat.completions.create(model="fake-model", messages=msgs,  # type: ignore[arg-type]
                                      extra_body={"documents": ["d"]})


# -- tier header and metrics -------------------------------------------------------------------

def test_tier_header_and_metrics_with_a_router_and_a_prefetcher(tmp_path):
    kv = _kv(tmp_path, router=True)
    kv.prefetcher = Prefetcher(kv.warm_chain)
    try:
        with live_server(kv) as url:
            assert metric(url, "edgekv_route_tier_total", tier="exact") == 0  # shown from start
            tiers = []
            for q in ("How do lights pair?", "How do lights pair?", "What about doors?"):
                r = post(url, CHAT, chat_body(q))
                tier = r.headers["X-EdgeKV-Tier"]
                assert tier in ("exact", "partial", "miss") and r.json()["edgekv"]["tier"] == tier
                tiers.append(tier)
            chunks = _stream(url, CHAT, chat_body())
            tiers.append(chunks[-1]["edgekv"]["tier"])  # a stream: in the final chunk
            assert tiers[0] == "miss" and tiers[1] == "exact"
            for t in ("exact", "partial", "miss"):
                assert metric(url, "edgekv_route_tier_total", tier=t) == tiers.count(t)
            kv.prefetcher.drain()
            s = kv.prefetcher.stats()
            assert s["requests"] == 4
            assert metric(url, "edgekv_prefetch_requests_total") == 4
            assert metric(url, "edgekv_prefetch_predicted_total") == s["predicted"]
            assert metric(url, "edgekv_prefetch_hits_total") == s["hits"]
            assert metric(url, "edgekv_prefetch_hit_rate") == s["hit_rate"]
            assert metric(url, "edgekv_streamed_tokens_total") == 0
            assert metric(url, "edgekv_computed_tokens_total") > 0
    finally:
        kv.close()


def test_without_router_or_prefetcher_no_header_and_no_such_lines(kv):
    with live_server(kv) as url:
        r = post(url, CHAT, chat_body())
        assert "x-edgekv-tier" not in r.headers and r.json()["edgekv"]["tier"] is None
        text = httpx.get(url + "/metrics").text
    assert "edgekv_route_tier_total{" not in text and "edgekv_prefetch" not in text
    assert "edgekv_streamed_tokens_total 0.0" in text
    assert "edgekv_prefix_cache_hits_total" in text  # the existing names stay


def test_passage_metrics_and_approximate_count(pkv):
    with live_server(pkv) as url:
        for _ in range(2):
            post(url, CHAT, chat_body(documents=[DOC_A, DOC_B]))
        assert metric(url, "edgekv_passage_reused_tokens_total") > 0
        assert metric(url, "edgekv_approximate_requests_total") == 1


def test_model_id_defaults_to_the_model_files_stem_and_a_loader_needs_one(kv):
    from edgekv.serve import create_app

    assert create_app(kv).state.server.model_id == "edgekv"  # the fake runs no model file
    with pytest.raises(ValueError, match="model_id"):
        create_app(lambda: kv)


def test_token_ids_outside_the_adapters_vocabulary_are_refused(kv):
    with live_server(kv) as url:
        n = kv.adapter.n_vocab
        msg = refused(post(url, COMPLETIONS, {"model": "fake-model", "prompt": [1, 2, n]}),
                      "invalid_value", "prompt")
        assert str(n) in msg
        assert post(url, COMPLETIONS, {"model": "fake-model", "prompt": [1, 2, n - 1],
                                       "max_tokens": 1}).status_code == 200


# -- speculative decoding ------------------------------------------------------------------

class RepeatingChatFake(ChatFake):
    """ChatFake with a taste for repeating its context (a bonus on the token `period` back),
    so answers copy text and n-gram drafts get accepted, as on a RAG answer."""

    def __init__(self, period: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.period = period

    def _logits(self):  # type: ignore[no-untyped-def]
        out = super()._logits()
        if len(self._ids) >= self.period:
            out[self._ids[-self.period]] += 12.0
        return out


def test_speculative_answers_equal_plain_ones_and_report_their_drafts(tmp_path):
    unit = "Quote: the hub connects lights, thermostats and sensors. "
    prompt = "Repeat this. " + unit * 4
    answers, drafts, cards = [], [], []
    for spec in ("none", "ngram"):
        cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path / spec, speculative=spec)
        kv = EdgeKV(RepeatingChatFake(len(unit), n_ctx=1024), open_store(cfg), cfg)
        try:
            with live_server(kv) as url:
                body = {"model": "fake-model", "prompt": prompt, "max_tokens": 48,
                        "temperature": 0}
                answers.append(post(url, COMPLETIONS, body).json())
                streamed = _stream(url, COMPLETIONS, {**body, "seed": 3, "temperature": 0.8})
                answers.append("".join(c["choices"][0]["text"] for c in streamed
                                       if c.get("choices")))
                drafts.append((metric(url, "edgekv_spec_drafted_tokens_total"),
                               metric(url, "edgekv_spec_accepted_tokens_total"),
                               metric(url, "edgekv_spec_acceptance_rate"),
                               streamed[-1]["edgekv"]))
                cards.append(httpx.get(f"{url}/health").json()["engine"]["speculative"])
        finally:
            kv.close()
    plain, plain_seeded, spec, spec_seeded = answers
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spec_seeded == plain_seeded  # the same random stream, one draw per token
    assert plain["edgekv"]["drafted_tokens"] == 0 and drafts[0][:3] == (0, 0, 0)
    e = spec["edgekv"]
    assert set(e) == EDGEKV_KEYS and e["accepted_tokens"] > 0
    drafted, accepted, rate, last = drafts[1]
    assert drafted == e["drafted_tokens"] + last["drafted_tokens"]
    assert accepted == e["accepted_tokens"] + last["accepted_tokens"]
    assert rate == pytest.approx(accepted / drafted)
    assert cards[0] == "off (speculative=none)" and cards[1].startswith("ngram drafts")
