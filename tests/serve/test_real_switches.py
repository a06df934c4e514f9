"""Every `serve` switch on the real engine, through HTTP and the openai SDK: real processes
(an `edgekv kv-server` and `edgekv serve`s with their own caches) on loopback.

- `--kv-server`: device A answers a long prompt the server does not hold (computed here),
  publishes it (the kv-server precomputes it), and device B, another process with its own
  cache, streams those chunks and answers the same;
- `--semantic`: the tier in the header, the `edgekv` object and /metrics;
- `--prefetch`: its counters in /metrics;
- `--passage-reuse`: `documents`, reused the second time, labelled approximate;
- `--approximate`: a request may ask for it only where the server allows it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from edgekv.engines.models import default_model_path
from edgekv_bench.texts import MANUAL, SYSTEM_PROMPT

from ..conftest import real_stack

real_stack("the real server stack", "llama_cpp", "fastapi", "uvicorn", "openai",
           "onnxruntime", check=default_model_path)

import openai  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from serve_demo import launch, stop, wait_healthy  # noqa: E402

pytestmark = pytest.mark.real
ENV = {"EDGEKV_REUSE_GRANULARITY": "chunk"}  # no probe at start: whole-chunk reuse
LONG = [{"role": "system", "content": SYSTEM_PROMPT + "\n\n" + MANUAL},
        {"role": "user", "content": "How long does the hub take to start?"}]
DOCS = [s.strip() for s in MANUAL.split("\n\n") if s.strip()[:2].rstrip(".").isdigit()][:3]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("switches")
    secret = tmp / "kv.secret"
    procs = {}
    try:
        procs["kv"] = launch(["kv-server", "--port", "0", "--cache-dir", str(tmp / "kv"),
                              "--secret-file", str(secret)], ENV, tmp / "kv.log")
        kv = ["--kv-server", procs["kv"][1], "--kv-secret-file", str(secret)]
        for name, extra in {"A": [*kv, "--kv-link", "200,2", "--semantic", "--prefetch"],
                            "B": kv,
                            "D": ["--passage-reuse", "--semantic", "--approximate"]}.items():
            procs[name] = launch(["serve", "--port", "0", "--cache-dir", str(tmp / name),
                                  *extra], ENV, tmp / f"{name}.log")
        for name in ("A", "B", "D"):
            wait_healthy(*procs[name], timeout=300)
        yield {name: url for name, (_, url) in procs.items()}
    finally:
        for proc, _ in procs.values():
            stop(proc)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)


def chat(url: str, messages, **extra):  # type: ignore[no-untyped-def]
    r = client(url).chat.completions.with_raw_response.create(
        model="default", messages=messages, max_tokens=12, temperature=0,
        extra_body=extra or None)
    return r.parse(), r.headers


def metric(url: str, name: str) -> float | None:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_kv_server_devices_share_what_one_computed(servers):
    first, headers = chat(servers["A"], LONG)
    info = first.model_extra["edgekv"]
    assert info["streamed_tokens"] == 0 and info["computed_tokens"] == first.usage.prompt_tokens
    assert headers["x-edgekv-tier"] == info["tier"] and info["tier"] in ("exact", "partial",
                                                                          "miss")
    assert metric(servers["A"], "edgekv_kv_server_up") == 1.0
    deadline = time.monotonic() + 300  # the kv-server precomputes A's prompt, off its path
    while (metric(servers["A"], "edgekv_kv_published_total") or 0) < 1:
        assert time.monotonic() < deadline, "A never published its prompt"
        time.sleep(0.5)
    second, _ = chat(servers["B"], LONG)
    got = second.model_extra["edgekv"]
    assert got["streamed_tokens"] >= 128 and got["cached_tokens"] == 0
    assert got["streamed_tokens"] + got["computed_tokens"] == second.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content
    assert metric(servers["B"], "edgekv_streamed_tokens_total") == got["streamed_tokens"]


def test_semantic_tiers_and_prefetch_reach_metrics(servers):
    chat(servers["A"], LONG)  # again: its own cache
    again, headers = chat(servers["A"], LONG)
    assert again.model_extra["edgekv"]["cached_tokens"] >= 128
    assert headers["x-edgekv-tier"] == again.model_extra["edgekv"]["tier"]
    tiers = sum(metric(servers["A"], f'edgekv_route_tier_total{{tier="{t}"}}') or 0
                for t in ("exact", "partial", "miss"))
    assert tiers >= 2
    assert metric(servers["A"], "edgekv_prefetch_requests_total") >= 2
    assert metric(servers["A"], "edgekv_prefetch_hit_rate") is not None


def test_documents_are_reused_and_labelled(servers):
    q = [{"role": "user", "content": "What does the warranty cover?"}]
    cold, _ = chat(servers["D"], q, documents=DOCS)
    warm, _ = chat(servers["D"], q, documents=[{"text": d} for d in DOCS])
    c, w = cold.model_extra["edgekv"], warm.model_extra["edgekv"]
    assert c["passages"]["reused_tokens"] == 0 and not c["approximate"]
    assert w["passages"]["reused_tokens"] > 0 and w["approximate"] is True
    assert w["passages"]["passages"] == len(DOCS)
    with pytest.raises(openai.BadRequestError, match="passage-reuse"):
        chat(servers["A"], q, documents=DOCS)


def test_approximate_only_where_the_server_allows_it(servers):
    q = [{"role": "system", "content": SYSTEM_PROMPT + "\n\n" + MANUAL},
         {"role": "user", "content": "Which radios does the hub have?"}]
    ok, _ = chat(servers["D"], q, approximate=True)
    assert ok.choices[0].message.content is not None
    assert isinstance(ok.model_extra["edgekv"]["approximate"], bool)
    with pytest.raises(openai.BadRequestError, match="--approximate"):
        chat(servers["A"], q, approximate=True)
