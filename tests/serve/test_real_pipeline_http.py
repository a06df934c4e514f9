"""EdgeKV's HTTP extensions on the real engine and model (llama.cpp, SmolLM2), through the real
`openai` client against an in-process server: `documents` with passage reuse on (cold, then
warm: the passages' KV is placed from the cache and the answer is labelled approximate), and
the `edgekv` object's `cached_tokens` on a repeated chat."""

from __future__ import annotations

import pytest

from edgekv import CacheConfig, EdgeKV, open_store
from edgekv.engines.models import default_model_path
from edgekv_bench.texts import MANUAL, SYSTEM_PROMPT

from ..conftest import real_stack

real_stack("the real server stack", "llama_cpp", "fastapi", "uvicorn", "openai", "jinja2",
           check=default_model_path)

import openai  # noqa: E402

from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402

from .servekit import live_server  # noqa: E402

pytestmark = pytest.mark.real

DOCUMENTS = [
    {"title": "zlib",
     "text": "The zlib module allows compression and decompression using the zlib library. The "
     "compress function returns a bytes object containing compressed data, and decompress "
     "undoes it. The default compression level is 6, a compromise between speed and size; "
     "level 9 compresses most and level 1 is fastest."},
    "The json module encodes and decodes JSON documents. json.dumps turns a Python object "
    "into a string, and json.loads parses a string back into Python objects such as dicts, "
    "lists, strings, numbers, True, False and None. The indent argument pretty-prints the "
    "output with that many spaces per level.",
]
QUESTION = [{"role": "user", "content": "What is the default zlib compression level?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    cfg = CacheConfig(chunk_size=128, cache_dir=tmp, reuse_granularity="chunk",
                      passage_reuse=True, passage_budget=16)
    adapter = LlamaCppAdapter(default_model_path(), n_ctx=2048, n_threads=2, memo_dir=tmp)
    kv = EdgeKV(adapter, open_store(cfg), cfg)
    try:
        with live_server(kv, model_id="smollm2") as url, \
                openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                              timeout=300) as c:
            yield c
    finally:
        kv.close()
        adapter.close()


def edgekv(obj: object) -> dict[str, object]:
    extra = getattr(obj, "model_extra", None)
    assert extra is not None and "edgekv" in extra, obj
    e = extra["edgekv"]
    assert set(e) == {"cached_tokens", "streamed_tokens", "computed_tokens", "tier",
                      "approximate", "passages", "drafted_tokens", "accepted_tokens"}
    return dict(e)


def test_documents_are_placed_from_the_passage_cache_the_second_time(client):
    kw = dict(model="smollm2", messages=QUESTION, max_tokens=6, temperature=0,
              extra_body={"documents": DOCUMENTS})
    cold = client.chat.completions.create(**kw)
    warm = client.chat.completions.create(**kw)
    c, w = edgekv(cold), edgekv(warm)
    cp, wp = c["passages"], w["passages"]
    assert isinstance(cp, dict) and isinstance(wp, dict)
    assert cp["passages"] == wp["passages"] == 2
    assert cp["reused_tokens"] == 0 and c["approximate"] is False  # computed here, in place
    assert wp["reused_tokens"] > 100 and wp["restores"] >= 1  # both passages' KV, placed
    assert w["approximate"] is True and wp["approximate"] is True
    assert w["computed_tokens"] < c["computed_tokens"]  # type: ignore[operator]
    assert w["tier"] is None  # no semantic router here
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens > wp["passage_tokens"]
    assert warm.choices[0].message.content  # an answer, approximate but an answer
    streamed = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    last = edgekv(streamed[-1])
    assert last["approximate"] is True and last["passages"]["reused_tokens"] > 100  # type: ignore[index]


def test_a_repeated_chat_reports_its_cached_tokens(client):
    msgs = [{"role": "system", "content": SYSTEM_PROMPT + "\n\n" + MANUAL},
            {"role": "user", "content": "What does an orange ring mean?"}]
    first = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                           temperature=0)
    again = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                           temperature=0)
    f, a = edgekv(first), edgekv(again)
    assert f["cached_tokens"] == 0 and f["computed_tokens"] == first.usage.prompt_tokens
    assert a["cached_tokens"] == again.usage.prompt_tokens_details.cached_tokens >= 512
    assert a["cached_tokens"] + a["computed_tokens"] == again.usage.prompt_tokens
    assert a["approximate"] is False and a["passages"] is None and a["streamed_tokens"] == 0
    assert again.choices[0].message.content == first.choices[0].message.content
    text = client.completions.create(model="smollm2", prompt="The capital of France is",
                                     max_tokens=3, temperature=0)
    assert edgekv(text)["passages"] is None
