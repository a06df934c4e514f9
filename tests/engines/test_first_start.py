"""The first five minutes, for real: `edgekv generate` and `edgekv serve` on a fresh cache dir
with the staged first probe (EDGEKV_FIRST_PROBE=short, the default outside the tests).

The first answer comes after the probe's short stage, with whole-chunk reuse and the model's
chat template; the rest of the probe runs in the background (a detached `edgekv probe
--finish` after `generate`; a second context's thread in `serve`) and records the whole answer,
so the next start, or the same server's next request, reuses at any token. The answers are
the same tokens in both granularities (the kernels are batch-invariant: that is what the
probe's later stages confirm), and with speculative decoding once the whole probe allows it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from edgekv.engines.models import default_model_path
from edgekv.engines.probe import recorded_probes
from edgekv.engines.probe_spec import SPEC_SCHEDULE
from edgekv.serve.runner import stop_process

from ..conftest import real_stack

real_stack("the real engine", "llama_cpp", check=default_model_path)

pytestmark = pytest.mark.real
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "EDGEKV_FIRST_PROBE": "short"}
QUESTION = "Why is the sky blue?"


def _generate(cache: Path, *extra: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "edgekv", "generate", "--json", "--no-semantic",
         "--max-tokens", "12", "--cache-dir", str(cache), *extra, QUESTION],
        capture_output=True, text=True, env=ENV, timeout=300, check=True)
    return json.loads(out.stdout)


def _wait_for_whole_probe(probes: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        done = [p for p in recorded_probes(probes) if not p.pending]
        if done and not (probes / "finishing.lock").exists():
            return
        assert time.monotonic() < deadline, f"no whole probe in {probes} after {timeout_s} s"
        time.sleep(1)


def test_generate_answers_after_the_short_probe_and_finishes_it_in_the_background(tmp_path):
    first = _generate(tmp_path)
    assert first["prompt_mode"] == "chat" and len(first["tokens"]) > 1  # a real answer
    assert first["granularity"] == "chunk" and "not run yet" in first["granularity_reason"]
    assert first["load_s"] > 0 and first["warmup_s"] > 0
    [short] = recorded_probes(tmp_path / "probes")
    assert short.pending and not short.failed
    _wait_for_whole_probe(tmp_path / "probes")
    [whole] = recorded_probes(tmp_path / "probes")
    assert whole.invariant and whole.long_tokens > 0 and whole.sequences > 0
    second = _generate(tmp_path)
    assert second["granularity"] == "token"
    assert second["granularity_reason"] == "batch-invariance probe passed"
    assert second["tokens"] == first["tokens"]
    # whole chunks stored nothing of a 36-token prompt; token granularity stores its tail
    third = _generate(tmp_path)
    assert third["tokens"] == first["tokens"] and third["cached_tokens"] > 0
    # the whole probe holds the draft schedule: speculation runs, the answer unchanged
    assert any(name == SPEC_SCHEDULE and diff == 0.0 and same
               for name, diff, same in whole.notes)
    spec = _generate(tmp_path, "--speculative", "ngram")
    assert spec["speculative"].startswith("ngram drafts") and spec["tokens"] == first["tokens"]
    raw = _generate(tmp_path, "--raw")
    assert raw["prompt_mode"] == "raw" and raw["prompt_tokens"] < first["prompt_tokens"]


def test_serve_is_ready_after_the_short_probe_and_adopts_the_rest(tmp_path):
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgekv", "serve", "--port", "0", "--cache-dir", str(tmp_path),
         "--speculative", "ngram"],
        stdout=subprocess.PIPE, stderr=log, text=True, env=ENV)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "listening on" in line, (tmp_path / "server.log").read_text()[-2000:]
        url = line.split("listening on ")[1].split()[0]
        deadline = time.monotonic() + 180
        while (h := httpx.get(f"{url}/health")).status_code != 200:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "not ready within 180 s"
            time.sleep(0.2)
        engine, parallel = h.json()["engine"], h.json()["parallel"]
        if engine["probe_pending"]:  # (the background stages may already have finished)
            assert engine["reuse_granularity"] == "chunk" and "not run yet" in engine["why"]
            assert engine["speculative"].startswith("off:"), engine  # not before it passed
            # the default 4 slots wait for the probe's multi-sequence schedule
            assert parallel["requested"] == 4 and not parallel["batched"], parallel
        body = {"model": "default", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": QUESTION}]}
        during = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        deadline = time.monotonic() + 300
        while (engine := httpx.get(f"{url}/health").json()["engine"])["probe_pending"]:
            assert time.monotonic() < deadline, "the probe's later stages did not finish"
            time.sleep(1)
        assert engine["reuse_granularity"] == "token", engine
        assert engine["speculative"].startswith("ngram drafts"), engine
        deadline = time.monotonic() + 30  # the slots open right after the probe is adopted
        while not (parallel := httpx.get(f"{url}/health").json()["parallel"])["batched"]:
            assert time.monotonic() < deadline, parallel
            time.sleep(0.2)
        assert parallel["slots"] == 4, parallel
        for _ in range(2):  # the first stores the tail whole chunks left out; the next reuses it
            after = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
            assert after["choices"][0]["message"] == during["choices"][0]["message"]
        assert after["edgekv"]["cached_tokens"] > 0
        [whole] = recorded_probes(tmp_path / "probes")  # the next start reads it
        assert whole.invariant and not whole.pending
    finally:
        stop_process(proc)
        proc.stdout.close()  # type: ignore[union-attr]
        log.close()
