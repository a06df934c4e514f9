"""`edgekv serve --parallel 4` on the real engine, through HTTP and the openai SDK: four
requests sent at once are batched on the server's slots, and each answer equals plain
llama-cpp-python's with no cache, cold and warm (the probe record is made in this process and
handed to the server, so that it starts without probing again)."""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path

import httpx
import pytest

from edgekv import CacheConfig, EdgeKV, open_store
from edgekv.engines.models import default_model_path

from ..conftest import real_stack

real_stack("the real server stack", "llama_cpp", "fastapi", "uvicorn", "openai",
           check=default_model_path)

import openai  # noqa: E402

from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402

from ..cache.test_real_granularity import chat, need_token_granularity, plain  # noqa: E402, F401

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from serve_demo import launch, stop, wait_healthy  # noqa: E402

pytestmark = pytest.mark.real
QUESTIONS = ("How many devices can one hub hold?", "What does an orange ring mean?",
             "How do I reset the hub?", "Which app pairs a sensor?")


@pytest.fixture(scope="module")
def adapter():
    a = LlamaCppAdapter(default_model_path(), n_ctx=2048)
    yield a
    a.close()


@pytest.fixture(scope="module")
def server(adapter, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    cfg = CacheConfig(cache_dir=tmp / "probe")
    kv = EdgeKV(adapter, open_store(cfg), cfg)  # the probe's verdict, recorded in probe/
    try:
        need_token_granularity(kv)
    finally:
        kv.close()
    shutil.copytree(tmp / "probe" / "probes", tmp / "serve" / "probes")
    proc, url = launch(["serve", "--port", "0", "--cache-dir", str(tmp / "serve"),
                        "--parallel", "4"], {}, tmp / "serve.log")
    try:
        wait_healthy(proc, url, timeout=300)
        yield url
    finally:
        stop(proc)


def metric(url: str, name: str) -> float | None:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def at_once(url: str, prompts: list[str]) -> list[object]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    out: list[object] = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def ask(i: int) -> None:
        start.wait()
        out[i] = client.completions.create(model="default", prompt=prompts[i], max_tokens=16,
                                           temperature=0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert all(r is not None for r in out)
    return out


def test_four_at_once_are_batched_and_equal_plain_cold_and_warm(server, adapter, plain):  # noqa: F811
    health = httpx.get(f"{server}/health", timeout=30).json()
    assert health["parallel"]["slots"] == 4 and health["parallel"]["batched"], health
    engine = health["engine"]  # the server's engine is the one the reference runs
    assert engine["reuse_granularity"] == "token" and engine["build"] == adapter.build_info()
    prompts = [chat(adapter, [("user", q)]) for q in QUESTIONS]
    cold = at_once(server, prompts)
    assert (metric(server, "edgekv_batch_max_sequences") or 0) >= 2  # shared a step
    warm = at_once(server, prompts)
    for p, c, w in zip(prompts, cold, warm, strict=True):
        _, out = plain(adapter.tokenize(p), 16)
        want = adapter.detokenize([t for t in out if t != adapter.eos_token])
        assert c.choices[0].text == want and w.choices[0].text == want
        assert w.usage.prompt_tokens_details.cached_tokens > 128
    assert metric(server, "edgekv_batch_slots") == 4.0
