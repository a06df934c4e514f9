"""The page at `/` over the fake engine: its headers and files, what needs a key, `--no-ui`,
path traversal, and `/v1/edgekv/stats` stating the numbers of `/metrics`. The page's
behaviour in a browser is tests/serve/test_browser.py's."""

from __future__ import annotations

import re
import socket
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ..conftest import real_stack

real_stack("the serve extra", "fastapi", "uvicorn", "httpx", "prometheus_client")

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import edgekv.serve  # noqa: E402
from edgekv import CacheConfig, EdgeKV, open_store  # noqa: E402
from edgekv.cli import main  # noqa: E402
from edgekv.serve.ui import FILES  # noqa: E402

from .servekit import ChatFake, live_server, sse_chunks  # noqa: E402

CHAT = "/v1/chat/completions"
SYSTEM = "You are the hub's assistant. The manual says: " + "Lights pair in ten seconds. " * 12
STATIC = resources.files("edgekv.serve").joinpath("static")
KEY = "key-a"


def chat_body(question: str, **kw: object) -> dict[str, object]:
    return {"model": "default", "temperature": 0, "max_tokens": 6,
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


def raw_get(url: str, path: str) -> tuple[int, bytes]:
    """GET `path` exactly as written (httpx would resolve `..` before sending it)."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


def test_the_page_is_served_with_a_strict_csp_and_no_inline_script(url):
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    csp = r.headers["content-security-policy"]
    for rule in ("default-src 'none'", "script-src 'self'", "style-src 'self'",
                 "connect-src 'self'", "frame-ancestors 'none'", "base-uri 'none'"):
        assert rule in csp
    assert "unsafe" not in csp and "*" not in csp and "http" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"
    assert r.text == STATIC.joinpath("index.html").read_text()
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", r.text, re.S)
    assert scripts == [(' src="/ui/app.js" defer', "")]  # one script, from a file
    assert not re.search(r"<[^>]*\son\w+\s*=", r.text)  # no inline handlers (onclick=...)
    assert "//" not in re.sub(r"<!--.*?-->", "", r.text, flags=re.S)  # no other origin, no CDN


@pytest.mark.parametrize("name", sorted(FILES))
def test_static_files_are_served_with_their_types_and_the_same_headers(url, name):
    r = httpx.get(f"{url}/ui/{name}")
    assert r.status_code == 200 and r.content == STATIC.joinpath(name).read_bytes()
    assert r.headers["content-type"] == FILES[name]
    assert r.headers["x-content-type-options"] == "nosniff"
    assert "script-src 'self'" in r.headers["content-security-policy"]


def test_the_script_puts_text_in_the_page_never_html():
    js = STATIC.joinpath("app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function", "setAttribute(\"style", "localStorage"):
        assert sink not in js, sink
    assert "textContent" in js and "sessionStorage" in js


def test_the_page_needs_no_key_and_holds_no_data_but_the_data_routes_need_the_key(kv):
    with live_server(kv, api_keys=(KEY,)) as u:
        page = httpx.get(u + "/")
        assert page.status_code == 200 and httpx.get(u + "/ui/app.js").status_code == 200
        assert KEY not in page.text and "fake-model" not in page.text
        for path in ("/metrics", "/v1/edgekv/stats", "/v1/models"):
            assert httpx.get(u + path).status_code == 401, path
            assert httpx.get(u + path, headers={"Authorization": "Bearer nope"}
                             ).status_code == 401, path
            assert httpx.get(u + path, headers={"Authorization": f"Bearer {KEY}"}
                             ).status_code == 200, path
        assert httpx.post(u + CHAT, json=chat_body("Hi")).status_code == 401
        ok = httpx.post(u + CHAT, json=chat_body("Hi"),
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=20)
        assert ok.status_code == 200
        assert httpx.get(u + "/health").status_code == 200  # open, as before


def test_no_ui_turns_the_page_off_and_keeps_the_api(kv):
    with live_server(kv, ui=False) as u:
        for path in ("/", "/ui/app.js", "/ui/app.css"):
            r = httpx.get(u + path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
        assert httpx.get(u + "/health").status_code == 200
        assert httpx.get(u + "/v1/edgekv/stats").status_code == 200  # an API route, not the page


def test_the_cli_switch_no_ui_reaches_the_server_options(tmp_path, monkeypatch):
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF" + bytes(60))  # enough for the check made before listening
    seen = []
    monkeypatch.setattr(edgekv.serve, "run", lambda *a, options, **kw: seen.append(options) or 0)
    base = ["serve", "--model", str(model), "--cache-dir", str(tmp_path)]
    assert main(base) == 0 and main([*base, "--no-ui"]) == 0
    assert [o.ui for o in seen] == [True, False]


@pytest.mark.parametrize("path", [
    "/ui/../ui.py", "/ui/..%2Fui.py", "/ui/%2e%2e%2fui.py", "/ui/..%2F..%2Fcli.py",
    "/ui/ui.py", "/ui/index.html", "/ui/static/app.js", "/ui/app.js%00.py", "/ui//etc/passwd",
    "/ui/%2Fetc%2Fpasswd", "/static/app.js", "/ui/", "/ui/.", "/ui/.."])
def test_only_the_listed_files_are_served(url, path):
    status, body = raw_get(url, path)
    assert status in (400, 404), (path, status)
    assert b"__future__" not in body and b"root:" not in body and b"<html" not in body


def test_stats_json_states_the_numbers_of_metrics(url):
    for q in ("How do lights pair?", "What about thermostats?"):
        assert httpx.post(url + CHAT, json=chat_body(q), timeout=20).status_code == 200
    s = httpx.get(url + "/v1/edgekv/stats").json()
    samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
               for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
               for x in f.samples}

    def m(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    pc = s["prefix_cache"]
    assert pc["queries"] == m("edgekv_prefix_cache_queries_total") > 0
    assert pc["hits"] == m("edgekv_prefix_cache_hits_total") >= 64  # the shared system prompt
    assert pc["hit_rate"] == pc["hits"] / pc["queries"]
    t = s["tokens"]
    assert t["prompt"] == m("edgekv_prompt_tokens_total") == pc["queries"]
    assert t["generated"] == m("edgekv_generation_tokens_total") == 12
    assert t["computed"] == m("edgekv_computed_tokens_total") == pc["queries"] - pc["hits"]
    assert t["streamed"] == m("edgekv_streamed_tokens_total") == 0
    tiers = [x["tier"] for x in s["store"]]
    assert tiers and len(set(tiers)) == len(tiers)
    for x in s["store"]:
        assert x["bytes"] == m("edgekv_store_bytes", tier=x["tier"])
        assert x["entries"] == m("edgekv_store_entries", tier=x["tier"])
        assert x["evictions"] == m("edgekv_store_evictions_total", tier=x["tier"])
    assert sum(x["entries"] for x in s["store"]) > 0
    r = s["requests"]
    assert r["running"] == m("edgekv_num_requests_running") == 0
    assert r["waiting"] == m("edgekv_num_requests_waiting") == 0
    assert r["slots"] == m("edgekv_batch_slots") == 1
    assert s["ttft_seconds"]["count"] == m("edgekv_time_to_first_token_seconds_count") == 2
    assert s["ttft_seconds"]["sum"] == m("edgekv_time_to_first_token_seconds_sum") > 0
    assert s["route_tiers"] is None  # no router without --semantic
    assert s["faults"]["corrupt_entry"] == m("edgekv_faults_total", kind="corrupt_entry")


def test_stats_before_any_request_say_no_hit_rate_yet(url):
    s = httpx.get(url + "/v1/edgekv/stats").json()
    assert s["prefix_cache"] == {"queries": 0, "hits": 0, "hit_rate": None}


def test_the_stream_carries_what_the_page_reads(url):
    """The page's contract: content deltas, then `edgekv` and `usage` in the last chunks."""
    httpx.post(url + CHAT, json=chat_body("How do lights pair?"), timeout=20)
    body = chat_body("How do lights pair?", stream=True, stream_options={"include_usage": True})
    chunks = sse_chunks(httpx.post(url + CHAT, json=body, timeout=20).text)
    info = [c["edgekv"] for c in chunks if "edgekv" in c][-1]
    usage = [c["usage"] for c in chunks if c.get("usage")][-1]
    assert info["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert (info["cached_tokens"] + info["streamed_tokens"] + info["computed_tokens"]
            == usage["prompt_tokens"])
    assert info["tier"] is None and info["passages"] is None
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def test_the_page_and_its_files_are_counted_under_their_own_endpoints(url):
    httpx.get(url + "/")
    httpx.get(url + "/ui/app.js")
    httpx.get(url + "/no-such-route")
    counted = {(s.labels["endpoint"], s.labels["status"]): s.value
               for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
               if f.name == "edgekv_requests" for s in f.samples
               if s.name == "edgekv_requests_total"}
    assert counted[("/", "200")] == 1 and counted[("/ui", "200")] == 1
    assert counted[("other", "404")] == 1
    r = httpx.get(url + "/no-such-route")
    assert "the page at /" in r.json()["error"]["message"]
