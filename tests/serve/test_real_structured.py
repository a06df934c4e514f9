"""Structured outputs, tool calls and logprobs for real: SmolLM2 on llama.cpp behind
`edgekv serve`'s app (uvicorn on loopback, in this process), driven by the openai SDK and
LangChain.

Two servers over one EdgeKV: one with the cache, one with it off (every request cold, the
reference). The tests send one request at a time, so the two never use the engine at once.
Whole-chunk reuse is set in the config, so that no batch-invariance probe runs at start (the
probe has its own tests); the serving path is the same either way.
"""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest

from edgekv.engines.models import default_model_path
from edgekv_bench.texts import MANUAL, SYSTEM_PROMPT

from ..conftest import real_stack

real_stack("the real server stack", "llama_cpp", "fastapi", "uvicorn", "openai", "jsonschema",
           check=default_model_path)

import jsonschema  # noqa: E402
import openai  # noqa: E402

from edgekv import CacheConfig, EdgeKV, open_store  # noqa: E402
from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402

from .servekit import live_server  # noqa: E402

pytestmark = pytest.mark.real
SYSTEM = SYSTEM_PROMPT + "\n\n" + MANUAL[:1500]  # a few chunks: the warm run reuses them
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "pet": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer"}},
        "required": ["kind", "legs"], "additionalProperties": False}]}},
    "required": ["name", "age", "colors", "pet"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                         "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "capital", "description": "The capital city of a country.",
        "parameters": {"type": "object", "properties": {"country": {"type": "string"}},
                       "required": ["country"], "additionalProperties": False}}},
]
ARGS = {"multiply": TOOLS[0]["function"]["parameters"],
        "capital": TOOLS[1]["function"]["parameters"]}


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    cfg = CacheConfig(chunk_size=128, cache_dir=tmp, reuse_granularity="chunk")
    adapter = LlamaCppAdapter(default_model_path(), n_ctx=2048, n_threads=2, memo_dir=tmp)
    k = EdgeKV(adapter, open_store(cfg), cfg)
    yield k
    k.close()
    adapter.close()


@pytest.fixture(scope="module")
def urls(kv):
    with live_server(kv, model_id="smollm2") as warm, \
            live_server(kv, model_id="smollm2", use_cache=False) as cold:
        yield warm, cold


@pytest.fixture(scope="module")
def clients(urls):
    made = [openai.OpenAI(base_url=f"{u}/v1", api_key="none", max_retries=0, timeout=300)
            for u in urls]
    yield made
    for c in made:
        c.close()


def ask(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def person_format(strict: bool = True) -> dict[str, object]:
    return {"type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


# -- structured outputs -------------------------------------------------------------------

@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 7)])
def test_json_schema_output_validates_and_is_the_same_warm_and_cold(clients, kv, temperature,
                                                                     seed):
    warm, cold = clients
    q = ask("Describe a person from the manual's support team as JSON.")
    kw = dict(model="smollm2", messages=q, response_format=person_format(),
              temperature=temperature, seed=seed, max_tokens=120, logprobs=True)
    ref = cold.chat.completions.create(**kw)
    first = warm.chat.completions.create(**kw)  # stores the system prompt's chunks
    again = warm.chat.completions.create(**kw)  # reuses them
    assert again.usage.prompt_tokens_details.cached_tokens >= 128
    assert ref.usage.prompt_tokens_details.cached_tokens == 0
    for r in (ref, first, again):
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    tokens = [[t.token for t in r.choices[0].logprobs.content] for r in (ref, first, again)]
    assert tokens[0] == tokens[1] == tokens[2]
    assert ref.choices[0].message.content == again.choices[0].message.content


def test_json_object_and_the_sdk_parse_helper(clients):
    warm, _ = clients
    r = warm.chat.completions.create(
        model="smollm2", messages=ask("Give the hub's name and its port count as JSON."),
        response_format={"type": "json_object"}, temperature=0, max_tokens=80)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    from pydantic import BaseModel, Field

    # bounded (maximum, maxLength, maxItems: the grammar holds them), so that the answer fits
    # its max_tokens whatever a machine's kernels make the 135M model say: 3 items of a
    # two-digit number and at most 60 characters, with their keys, stay under 300 tokens even
    # at a token a character; unbounded, the AVX2 build's greedy answer ran past 150 tokens
    class Step(BaseModel):
        number: int = Field(ge=0, le=99)
        action: str = Field(max_length=60)

    class Steps(BaseModel):
        steps: list[Step] = Field(max_length=3)

    try:
        parsed = warm.chat.completions.parse(
            model="smollm2", messages=ask("List two pairing steps."), response_format=Steps,
            temperature=0, max_tokens=300)
    except openai.LengthFinishReasonError as e:  # cut by max_tokens: the SDK's own error
        raise AssertionError(f"a bounded schema ran past max_tokens: {e.completion}") from None
    assert parsed.choices[0].finish_reason == "stop"
    steps = parsed.choices[0].message.parsed
    assert isinstance(steps, Steps) and len(steps.steps) <= 3
    assert all(len(s.action) <= 60 for s in steps.steps)


def test_streamed_structured_output_is_the_plain_one(clients):
    warm, _ = clients
    kw = dict(model="smollm2", messages=ask("Who answers support calls? As JSON."),
              response_format=person_format(), temperature=0, max_tokens=120)
    plain = warm.chat.completions.create(**kw).choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in
                   warm.chat.completions.create(stream=True, **kw) if c.choices)
    assert text == plain
    jsonschema.validate(json.loads(text), PERSON)


def test_completions_take_a_response_format(urls):
    warm, _ = urls
    r = httpx.post(f"{warm}/v1/completions", timeout=300, json={
        "prompt": "A person as JSON:", "max_tokens": 100, "temperature": 0,
        "response_format": person_format(), "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    jsonschema.validate(json.loads(choice["text"]), PERSON)
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0 and all(len(t) <= 2 for t in lp["top_logprobs"])


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}},
     "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "[a-z]+"}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
     "response_format.json_schema.schema"),
    ({"type": "xml"}, "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema.json_schema"),
])
def test_bad_schemas_get_a_400_that_says_what_to_fix(clients, fmt, param):
    warm, _ = clients
    with pytest.raises(openai.BadRequestError) as e:
        warm.chat.completions.create(model="smollm2", messages=ask("hi"), response_format=fmt,
                                     max_tokens=4)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"].startswith(param.split(".")[0]), err
    assert err["message"]


# -- logprobs -------------------------------------------------------------------------------

def test_logprobs_are_the_log_softmax_of_the_raw_logits(clients, kv):
    warm, _ = clients
    q = ask("How do lights pair?")
    r = warm.chat.completions.create(model="smollm2", messages=q, temperature=0, max_tokens=12,
                                     logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert content and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 5
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the top one
        assert t.top_logprobs[0].logprob == t.logprob
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    # the same request in the library, its logits kept: the first token's value, recomputed
    from edgekv.chat import ChatTokenizer
    from edgekv.keys import SERVE_TENANTS

    tokens = ChatTokenizer(kv.adapter).tokens(q)
    res = kv.generate(tokens, max_tokens=3, temperature=0, keep_logits=True, use_cache=False,
                      namespace=SERVE_TENANTS)
    z = res.step_logits[0].astype(np.float64)
    want = z[res.tokens[0]] - z.max() - math.log(np.exp(z - z.max()).sum())
    assert content[0].logprob == pytest.approx(want, abs=1e-9)


def test_streamed_logprobs_cover_every_token(clients):
    warm, _ = clients
    kw = dict(model="smollm2", messages=ask("What is the hub?"), temperature=0, max_tokens=10,
              logprobs=True, top_logprobs=2)
    plain = warm.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [t for c in warm.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in plain]


def test_bad_logprob_requests_get_a_400(urls):
    warm, _ = urls
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra in ({"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21},
                  {"logprobs": 3}):
        r = httpx.post(f"{warm}/v1/chat/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(f"{warm}/v1/completions", json={"prompt": "x", "logprobs": True}, timeout=60)
    assert r.status_code == 400


# -- tools ----------------------------------------------------------------------------------

def _check_calls(calls, allowed=("multiply", "capital")):
    assert calls
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function" and c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), ARGS[c.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "capital"}}])
def test_forced_tool_calls_parse_plain_and_streamed(clients, choice):
    warm, _ = clients
    # one call: with parallel calls allowed the grammar admits any number of them, and where
    # the CPU's kernels lead SmolLM2's greedy path there (AMD Zen 4: a multiply call, then
    # capital calls until max_tokens, warm and cold alike) no answer closes the list
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "What is 6 times 7?"}],
              tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=0,
              max_tokens=80)
    r = warm.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    allowed = ("multiply", "capital") if choice == "required" else ("capital",)
    _check_calls(msg.tool_calls, allowed)
    # streamed: the SDK's own accumulator puts the delta.tool_calls together
    with warm.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    got = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in got] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]


def test_one_call_when_parallel_calls_are_off_and_text_with_tool_choice_none(clients):
    warm, _ = clients
    r = warm.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "6 times 7, and France?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0,
        max_tokens=80)
    assert len(r.choices[0].message.tool_calls) == 1
    r = warm.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS, tool_choice="none", temperature=0, max_tokens=12)
    assert r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_results_are_taken_in_the_next_turn(clients):
    warm, _ = clients
    msgs = [{"role": "user", "content": "What is 6 times 7?"}]
    r = warm.chat.completions.create(model="smollm2", messages=msgs, tools=TOOLS,
                                     tool_choice="required", parallel_tool_calls=False,
                                     temperature=0, max_tokens=80)  # (one call: see above)
    call = r.choices[0].message
    msgs.append(call.model_dump(exclude_none=True))  # as an application sends it back
    msgs += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in call.tool_calls]
    r2 = warm.chat.completions.create(model="smollm2", messages=msgs, tools=TOOLS,
                                      temperature=0, max_tokens=30)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.choices[0].message.content or r2.choices[0].message.tool_calls


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
     None, "tools"),
    ([TOOLS[0], TOOLS[0]], None, "tools"),
    ([{"type": "retrieval"}], None, "tools"),
    (TOOLS, {"type": "function", "function": {"name": "nowhere"}}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_malformed_tools_get_a_400(urls, tools, choice, param):
    warm, _ = urls
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **({"tools": tools} if tools is not None else {}),
            **({"tool_choice": choice} if choice is not None else {})}
    r = httpx.post(f"{warm}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and err["message"], err


def test_tool_messages_must_answer_a_call(urls):
    warm, _ = urls
    for msgs in ([{"role": "tool", "tool_call_id": "call_x", "content": "1"}],
                 [{"role": "tool", "content": "1"}],
                 [{"role": "user", "content": "hi", "tool_call_id": "call_x"}],
                 [{"role": "user", "content": None}]):
        r = httpx.post(f"{warm}/v1/chat/completions", json={"messages": msgs,
                                                             "max_tokens": 2}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("messages")


def test_langchain_bind_tools_gets_tool_calls(urls):
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    @tool
    def capital(country: str) -> str:
        """The capital city of a country."""
        return "Paris"

    llm = ChatOpenAI(base_url=f"{urls[0]}/v1", api_key="none", model="smollm2", temperature=0,
                     max_tokens=80, max_retries=0, timeout=300)
    bound = llm.bind_tools([multiply, capital], tool_choice="any")
    msg = bound.invoke("What is 6 times 7?")
    assert msg.tool_calls and all(c["name"] in ("multiply", "capital") for c in msg.tool_calls)
    assert not msg.invalid_tool_calls
    chunks = list(bound.stream("What is 6 times 7?"))
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == \
        [(c["name"], c["args"]) for c in msg.tool_calls]
