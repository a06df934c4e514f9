"""`edgekv serve` over the fake engine: wire format, reuse, tenants, queue, cancellation, errors.

The server runs for real (uvicorn on a loopback port, in this process), so streaming and
client disconnects are real too; only the engine is the millisecond fake.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from ..conftest import real_stack

real_stack("the serve extra", "fastapi", "uvicorn", "httpx", "prometheus_client")

import httpx  # noqa: E402

from edgekv import CacheConfig, EdgeKV, open_store  # noqa: E402
from edgekv.cli import main  # noqa: E402
from edgekv.serve.decode import IncrementalText  # noqa: E402

from .servekit import ChatFake, live_server, metric, sse_chunks, wait_for  # noqa: E402

SYSTEM = "You are the hub's assistant. The manual says: " + "Lights pair in ten seconds. " * 12
CHAT = "/v1/chat/completions"


def chat_body(question: str = "How do lights pair?", **kw: object) -> dict[str, object]:
    return {"model": "fake-model", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}], **kw}


@pytest.fixture
def kv(tmp_path: Path):
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path, reuse_granularity="chunk")
    k = EdgeKV(ChatFake(n_ctx=1024), open_store(cfg), cfg)
    yield k
    k.store.close()


@pytest.fixture
def url(kv):
    with live_server(kv) as u:
        yield u


def post(url: str, path: str, body: object, **kw: object) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=20, **kw)  # type: ignore[arg-type]


def test_chat_reuses_a_shared_prefix_and_says_so_in_usage(url):
    first = post(url, CHAT, chat_body()).json()
    assert first["object"] == "chat.completion" and first["id"].startswith("chatcmpl-")
    choice = first["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["logprobs"] is None
    assert choice["finish_reason"] == "length" and len(choice["message"]["content"]) == 8
    u = first["usage"]
    assert u["prompt_tokens_details"]["cached_tokens"] == 0 and u["completion_tokens"] == 8
    assert u["total_tokens"] == u["prompt_tokens"] + 8
    again = post(url, CHAT, chat_body()).json()
    other = post(url, CHAT, chat_body("What about thermostats?")).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128  # the system prompt
    assert again["choices"][0]["message"] == choice["message"]  # warm == cold
    cold = post(url, CHAT, chat_body(cache_salt="fresh")).json()  # another chain: cold
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["choices"][0]["message"] == choice["message"]


def test_no_cache_option_answers_cold_and_stores_nothing(kv):
    with live_server(kv, use_cache=False) as u:
        first = post(u, CHAT, chat_body()).json()
        again = post(u, CHAT, chat_body()).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert kv.store.stats().entries == 0


def test_completions_take_text_or_token_ids(url, kv):
    text = "Lights pair in ten seconds. " * 6
    by_text = post(url, "/v1/completions", {"prompt": text, "max_tokens": 5,
                                            "temperature": 0}).json()
    ids = kv.adapter.tokenize(text)
    by_ids = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 5, "temperature": 0,
                                           "model": "default"}).json()
    assert by_text["object"] == "text_completion" and by_text["id"].startswith("cmpl-")
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    assert by_ids["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128


def test_streamed_chat_matches_the_plain_answer_and_ends_with_usage(url):
    plain = post(url, CHAT, chat_body(max_tokens=12)).json()
    r = post(url, CHAT, chat_body(max_tokens=12, stream=True,
                                  stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(r.text)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    *body, last, tail = chunks
    assert all(c["usage"] is None for c in body + [last])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in body)
    assert text == plain["choices"][0]["message"]["content"]
    assert last["choices"][0]["finish_reason"] == "length"
    assert tail["choices"] == [] and tail["usage"]["completion_tokens"] == 12
    assert tail["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128


def test_streamed_completion_chunks_have_no_usage_unless_asked(url):
    r = post(url, "/v1/completions", {"prompt": "Hello there", "max_tokens": 4,
                                      "temperature": 0, "stream": True})
    chunks = sse_chunks(r.text)
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len("".join(c["choices"][0]["text"] for c in chunks)) == 4


def test_stop_strings_cut_the_answer_plainly_and_streamed(url):
    full = post(url, CHAT, chat_body(max_tokens=24)).json()["choices"][0]["message"]["content"]
    stop = full[5:7]
    expected = full[: full.index(stop)]
    for stops in (stop, ["never-seen", stop]):
        got = post(url, CHAT, chat_body(max_tokens=24, stop=stops)).json()["choices"][0]
        assert got["message"]["content"] == expected and got["finish_reason"] == "stop"
    chunks = sse_chunks(post(url, CHAT, chat_body(max_tokens=24, stop=stop, stream=True)).text)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_incremental_text_never_splits_a_character_nor_shows_a_stop_string():
    data = "héllo wörld, ünïcode ✓ then STOP here".encode()

    def detok(ids):  # a byte-level tokenizer: one token per byte
        return bytes(ids).decode("utf-8", errors="replace")

    t = IncrementalText(detok)
    pieces = [t.push(b) for b in data] + [t.finish()]
    assert "".join(pieces) == data.decode() and not any("\ufffd" in p for p in pieces)
    t = IncrementalText(detok, stop=("STOP",))
    shown = ""
    for b in data:
        shown += t.push(b)
        assert "S" not in shown  # "S", "ST", "STO" are held back until they are ruled out
        if t.stopped:
            break
    shown += t.finish()
    assert t.stopped and shown == t.text == "héllo wörld, ünïcode ✓ then "


def test_models_health_and_unknown_routes(url):
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake-model"]
    assert httpx.get(f"{url}/v1/models/fake-model").json()["id"] == "fake-model"
    for r in (httpx.get(f"{url}/v1/models/gpt-4"), post(url, CHAT, chat_body(model="gpt-4"))):
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and "/v1" in r.json()["error"]["message"]
    assert httpx.delete(f"{url}/v1/models").json()["error"]["code"] == "method_not_allowed"


BAD = [  # (path, raw body, status, error code)
    (CHAT, b"{not json", 400, "invalid_json"),
    (CHAT, b"[1, 2]", 400, "invalid_type"),
    (CHAT, json.dumps(chat_body(foo=1)).encode(), 400, "unknown_field"),
    (CHAT, json.dumps(chat_body(frequency_penalty=0.5)).encode(), 400, "unsupported_parameter"),
    (CHAT, json.dumps(chat_body(max_tokens="8")).encode(), 400, "invalid_type"),
    (CHAT, json.dumps(chat_body(max_tokens=-1)).encode(), 400, "invalid_value"),
    (CHAT, json.dumps(chat_body(max_tokens=10**9)).encode(), 400, "invalid_value"),
    (CHAT, json.dumps({**chat_body(), "messages": []}).encode(), 400, "invalid_value"),
    (CHAT, json.dumps({"model": "fake-model"}).encode(), 400, "missing_field"),
    (CHAT, json.dumps(chat_body(n=2)).encode(), 400, "invalid_value"),
    (CHAT, json.dumps(chat_body(temperature=3)).encode(), 400, "invalid_value"),
    (CHAT, json.dumps(chat_body(stream_options={"include_usage": True})).encode(), 400,
     "invalid_value"),
    (CHAT, json.dumps({**chat_body(), "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), 400, "invalid_value"),
    (CHAT, json.dumps({**chat_body(), "messages": [{"role": "user", "content": "x" * 2000}]}
                      ).encode(), 400, "context_length_exceeded"),
    (CHAT, json.dumps(chat_body(model="nope")).encode(), 404, "model_not_found"),
    (CHAT, b'{"messages": "' + b"x" * (1 << 20) + b'"}', 413, "request_too_large"),
    ("/v1/completions", json.dumps({"prompt": ""}).encode(), 400, "invalid_value"),
    ("/v1/completions", json.dumps({"prompt": [1, 99999]}).encode(), 400, "invalid_value"),
    ("/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode(), 400, "invalid_value"),
    ("/v1/completions", json.dumps({"prompt": "x", "echo": True}).encode(), 400,
     "unsupported_parameter"),
    # the fake engine has no grammar sampler: a constrained request is refused, with why
    (CHAT, json.dumps(chat_body(response_format={"type": "json_object"})).encode(), 400,
     "unsupported_parameter"),
    (CHAT, json.dumps(chat_body(tools=[{"type": "function", "function": {"name": "f"}}],
                                tool_choice="required")).encode(), 400,
     "unsupported_parameter"),
    (CHAT, json.dumps(chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}})).encode(), 400, "invalid_schema"),
    (CHAT, json.dumps(chat_body(top_logprobs=2)).encode(), 400, "invalid_value"),
]


def test_bad_input_gets_an_openai_error_while_a_good_request_runs(url, kv):
    kv.adapter.gate.clear()
    good: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: good.update(r=post(url, CHAT, chat_body(max_tokens=6))))
    t.start()
    assert kv.adapter.decoding.wait(10)  # the good request is generating, held at the gate
    for path, raw, status, code in BAD:
        r = httpx.post(url + path, content=raw, timeout=20,
                       headers={"content-type": "application/json"})
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (raw[:80], r.text)
        assert r.json()["error"]["message"] and r.json()["error"]["type"]
    neutral: list[httpx.Response] = []  # neutral values of unsupported fields are accepted
    t2 = background(url, chat_body(frequency_penalty=0, logprobs=False, user="u1"), neutral)
    wait_for(lambda: metric(url, "edgekv_num_requests_waiting") == 1, what="queued")
    assert metric(url, "edgekv_num_requests_running") == 1  # the good one never stopped
    kv.adapter.gate.set()
    t.join(20)
    t2.join(20)
    assert good["r"].status_code == 200 and good["r"].json()["usage"]["completion_tokens"] == 6
    assert neutral[0].status_code == 200
    assert post(url, CHAT, chat_body()).status_code == 200  # and it still serves


def test_logprobs_on_any_engine_and_tools_with_auto_on_one_without_grammars(url):
    r = post(url, CHAT, chat_body(logprobs=True, top_logprobs=3)).json()
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    assert "".join(t["token"] for t in content) == choice["message"]["content"]
    for t in content:
        lps = [a["logprob"] for a in t["top_logprobs"]]
        assert t["logprob"] <= 0 and lps == sorted(lps, reverse=True) and len(lps) == 3
        assert t["top_logprobs"][0]["token"] == t["token"]  # greedy
    # "auto" needs no grammar: free text, parsed if it is a call (here it is not)
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = post(url, CHAT, chat_body(tools=tools)).json()
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    assert "tool_calls" not in r["choices"][0]["message"]
    streamed = sse_chunks(httpx.post(url + CHAT, json=chat_body(tools=tools, stream=True),
                                     timeout=20).text)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed) == \
        r["choices"][0]["message"]["content"]


def test_api_keys_make_tenants_whose_prefixes_stay_apart(kv):
    with live_server(kv, api_keys=("key-a", "key-b")) as url:
        assert post(url, CHAT, chat_body()).json()["error"]["code"] == "missing_api_key"
        r = post(url, CHAT, chat_body(), headers={"Authorization": "Bearer key-z"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key

        def cached(key: str, **kw: object) -> int:
            r = post(url, CHAT, chat_body(**kw), headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("key-a") == 0
        assert cached("key-a") >= 128
        assert cached("key-b") == 0  # same prompt, another tenant: nothing reused
        assert cached("key-a", cache_salt="s") == 0  # the tenant's own salted chain
        assert cached("key-b") >= 128


def test_cache_salt_separates_chains_without_keys(url):
    assert post(url, CHAT, chat_body(cache_salt="u1")).json()["usage"][
        "prompt_tokens_details"]["cached_tokens"] == 0
    assert post(url, CHAT, chat_body(cache_salt="u2")).json()["usage"][
        "prompt_tokens_details"]["cached_tokens"] == 0
    assert post(url, CHAT, chat_body(cache_salt="u1")).json()["usage"][
        "prompt_tokens_details"]["cached_tokens"] >= 128


def background(url: str, body: dict[str, object], out: list[httpx.Response],
               path: str = CHAT) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(post(url, path, body)))
    t.start()
    return t


def test_a_full_queue_answers_429_at_once_and_other_tenants_still_queue(kv):
    with live_server(kv, max_queue=1) as url:
        kv.adapter.gate.clear()
        done: list[httpx.Response] = []
        threads = [background(url, chat_body(max_tokens=3), done)]
        assert kv.adapter.decoding.wait(10)
        threads.append(background(url, chat_body(max_tokens=2), done))
        wait_for(lambda: metric(url, "edgekv_num_requests_waiting") == 1, what="queued")
        r = post(url, CHAT, chat_body())
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert r.json()["error"]["type"] == "rate_limit_error"
        threads.append(background(url, chat_body(max_tokens=2, cache_salt="other"), done))
        wait_for(lambda: metric(url, "edgekv_num_requests_waiting") == 2, what="2 queued")
        kv.adapter.gate.set()
        for t in threads:
            t.join(20)
        assert sorted(r.status_code for r in done) == [200, 200, 200]
        assert metric(url, "edgekv_requests_total", endpoint=CHAT, status="429") == 1


def test_tenants_take_turns(url, kv):
    kv.adapter.gate.clear()
    done: list[httpx.Response] = []
    threads = [background(url, chat_body(max_tokens=2), done)]
    assert kv.adapter.decoding.wait(10)
    order = [("x", "x1"), ("x", "x2"), ("x", "x3"), ("y", "y1")]
    for i, (salt, prompt) in enumerate(order, 1):
        threads.append(background(url, {"prompt": prompt, "max_tokens": 1, "cache_salt": salt},
                                  done, "/v1/completions"))
        # called at once, inside this iteration: `i` is the value meant
        wait_for(lambda: metric(url, "edgekv_num_requests_waiting") == i,  # noqa: B023
                 what=prompt)
    kv.adapter.gate.set()
    for t in threads:
        t.join(20)
    ran = [kv.adapter.detokenize(p) for p in kv.adapter.prefills[-4:]]
    expected = [kv.adapter.detokenize(kv.adapter.tokenize(p)) for p in ("x1", "y1", "x2", "x3")]
    assert ran == expected  # y1 came after x1, not after all of x's requests


def test_a_client_that_goes_away_is_cancelled_waiting_or_running(url, kv):
    kv.adapter.gate.clear()
    with httpx.Client(timeout=20) as client:
        with client.stream("POST", url + CHAT, json=chat_body(max_tokens=50, stream=True)) as r:
            lines = r.iter_lines()
            assert any('"content":"' in line and '"content":""' not in line for line in lines)
            # the running request is held at the gate; queue one more, then drop it
            port = int(url.rsplit(":", 1)[1])
            raw = json.dumps(chat_body()).encode()
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nContent-Length: "
                          + str(len(raw)).encode() + b"\r\n\r\n" + raw)
                wait_for(lambda: metric(url, "edgekv_num_requests_waiting") == 1, what="queued")
            wait_for(lambda: metric(url, "edgekv_requests_cancelled_total", stage="waiting") == 1,
                     what="the waiting request cancelled")
            assert metric(url, "edgekv_num_requests_waiting") == 0
    wait_for(lambda: metric(url, "edgekv_requests_cancelled_total", stage="running") == 1,
             what="the running request cancelled")
    kv.adapter.gate.set()
    wait_for(lambda: metric(url, "edgekv_num_requests_running") == 0, what="the worker free")
    assert metric(url, "edgekv_generation_tokens_total") <= 3  # stopped, not 50 tokens
    assert post(url, CHAT, chat_body()).status_code == 200


def test_metrics_count_tokens_hits_latency_and_store(url):
    post(url, CHAT, chat_body())
    post(url, CHAT, chat_body())
    assert metric(url, "edgekv_prefix_cache_hits_total") >= 128
    queries = metric(url, "edgekv_prefix_cache_queries_total")
    assert queries >= 2 * 128 and queries == metric(url, "edgekv_prompt_tokens_total")
    assert metric(url, "edgekv_time_to_first_token_seconds_count") == 2
    assert metric(url, "edgekv_e2e_request_latency_seconds_count") == 2
    assert metric(url, "edgekv_requests_total", endpoint=CHAT, status="200") == 2
    assert metric(url, "edgekv_store_entries", tier="ram") >= 2
    assert metric(url, "edgekv_store_bytes", tier="disk") > 0
    assert metric(url, "edgekv_faults_total", kind="corrupt_entry") == 0
    assert metric(url, "edgekv_faults_total", kind="refused_injection") == 0


def test_health_is_503_until_the_model_is_loaded(kv):
    release = threading.Event()

    def load() -> EdgeKV:
        assert release.wait(10)
        return kv

    with live_server(load) as url:
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = post(url, CHAT, chat_body())
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert r.headers["retry-after"] == "1"  # what a client (the openai SDK) waits
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "fake-model"
        release.set()
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, what="loaded")
        assert post(url, CHAT, chat_body()).status_code == 200


def test_a_failed_load_is_reported(tmp_path):
    def load() -> EdgeKV:
        raise RuntimeError("no such engine")

    with live_server(load) as url:
        wait_for(lambda: httpx.get(f"{url}/health").json()["status"] == "failed", what="fail")
        r = post(url, CHAT, chat_body())
        assert r.status_code == 503 and "no such engine" in r.json()["error"]["message"]
        assert "retry-after" not in r.headers  # a retry would fail the same way


def test_the_openai_client_speaks_to_it(url):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        talk(openai, client)


def talk(openai, client) -> None:  # type: ignore[no-untyped-def]
    msgs = chat_body()["messages"]
    r = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=5,
                                       temperature=0)
    assert len(r.choices[0].message.content) == 5
    stream = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=5,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 128
    c = client.completions.create(model="fake-model", prompt="Hi", max_tokens=3, temperature=0)
    assert c.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=msgs)
    with pytest.raises(openai.BadRequestError, match="one choice"):
        client.chat.completions.create(model="fake-model", messages=msgs, n=2)


def test_cli_serve_refuses_a_missing_model_before_listening(tmp_path, capsys):
    code = main(["serve", "--model", str(tmp_path / "nope.gguf"), "--cache-dir", str(tmp_path)])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_cli_serve_reports_a_port_in_use(tmp_path, capsys):
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF" + bytes(60))  # enough for the check made before listening
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--model", str(model), "--port", str(port),
                     "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "cannot listen" in err and "--port" in err


@pytest.mark.parametrize(("argv", "env", "on"), [
    ([], None, True), (["--no-write-behind"], None, False), ([], "0", False),
    (["--write-behind"], "0", True), ([], "1", True), (["--no-write-behind"], "1", False)])
def test_serve_writes_the_disk_tier_behind_unless_told_not_to(tmp_path, monkeypatch, argv, env,
                                                             on):
    import edgekv.serve as serve_pkg

    seen = {}
    monkeypatch.setattr(serve_pkg, "load_edgekv",
                        lambda model, cfg, **k: seen.setdefault("cfg", cfg))
    monkeypatch.setattr(serve_pkg, "run", lambda load, **k: (load(), 0)[1])
    if env is None:
        monkeypatch.delenv("EDGEKV_WRITE_BEHIND", raising=False)
    else:
        monkeypatch.setenv("EDGEKV_WRITE_BEHIND", env)
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    assert main(["serve", "--model", str(model), "--cache-dir", str(tmp_path), *argv]) == 0
    assert seen["cfg"].write_behind is on


def test_a_damaged_store_entry_is_a_counted_miss_not_an_error(url, kv, tmp_path):
    post(url, CHAT, chat_body())
    files = sorted((tmp_path / "store").rglob("*.ekv"))
    assert files
    for f in files:
        blob = bytearray(f.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        f.write_bytes(bytes(blob))
    kv.store.tiers[0].clear()  # RAM forgets, so the next read comes from the damaged disk
    r = post(url, CHAT, chat_body())
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(url, "edgekv_faults_total", kind="corrupt_entry") >= 1
