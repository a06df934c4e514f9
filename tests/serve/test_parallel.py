"""`--parallel N` where the engine cannot batch exactly, and the scheduler's workers (the
batched path on the real engine: tests/cache/test_real_parallel.py and
tests/serve/test_real_parallel_http.py)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from ..conftest import real_stack

real_stack("the serve extra", "fastapi", "uvicorn", "httpx", "prometheus_client")

import httpx  # noqa: E402

from edgekv import CacheConfig, EdgeKV, open_store  # noqa: E402
from edgekv.errors import ConfigError, EdgeKVError  # noqa: E402
from edgekv.serve import ServeOptions  # noqa: E402
from edgekv.serve.scheduler import Job, Scheduler  # noqa: E402
from edgekv.serve.slots import open_slots  # noqa: E402

from .servekit import ChatFake, live_server, metric  # noqa: E402


@pytest.fixture
def kv(tmp_path: Path):
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path, reuse_granularity="chunk")
    k = EdgeKV(ChatFake(n_ctx=1024), open_store(cfg), cfg)
    yield k
    k.store.close()


def test_workers_run_jobs_at_once_each_on_its_own_slot():
    """`setup` asks for 3 workers: three jobs run together, on workers 0, 1 and 2."""
    sched = Scheduler(max_queue=8)
    running: list[int] = []  # when all three have arrived: what the scheduler counts
    together = threading.Barrier(3, action=lambda: running.append(sched.running), timeout=10)
    seen: list[int] = []
    loop = asyncio.new_event_loop()
    try:
        sched.start(lambda: 3)
        assert sched.ready.wait(10)

        def work(job: Job) -> None:
            together.wait()  # raises BrokenBarrierError unless three run at once
            seen.append(job.worker)

        jobs = [Job(f"t{i}", work, loop) for i in range(3)]
        for j in jobs:
            sched.submit(j)
        deadline = threading.Event()
        while len(seen) < 3 and not deadline.wait(0.01):
            pass
        assert sorted(seen) == [0, 1, 2] and sched.workers == 3 and running == [3]
    finally:
        sched.stop(5)
        loop.close()


def test_an_engine_without_sequence_ids_serves_one_at_a_time_and_says_why(kv):
    with live_server(kv, parallel=4) as url:
        health = httpx.get(f"{url}/health").json()
        par = health["parallel"]
        assert par["requested"] == 4 and par["slots"] == 1 and par["batched"] is False
        engine = health["engine"]  # what runs, and the granularity the probe decided
        assert engine["reuse_granularity"] in ("token", "chunk") and engine["why"]
        assert engine["build"] == kv.adapter.build_info() and engine["batch_invariant"] is None
        assert "no sequence ids" in par["reason"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake-model", "prompt": "hi",
                                                       "max_tokens": 3}, timeout=20)
        assert r.status_code == 200
        assert metric(url, "edgekv_batch_slots") == 1.0
        assert metric(url, "edgekv_batch_requested") == 4.0
        assert metric(url, "edgekv_batch_steps_total") == 0.0


def test_one_slot_is_the_default(kv):
    with live_server(kv) as url:
        assert httpx.get(f"{url}/health").json()["parallel"] == {
            "requested": 1, "slots": 1, "batched": False,
            "reason": "one request at a time (--parallel 1)"}


def test_bad_parallel_values_are_refused(kv):
    with pytest.raises(ConfigError, match="parallel=0"):
        ServeOptions(parallel=0)
    with pytest.raises(EdgeKVError, match="give 1 or more"):
        open_slots(kv, 0)
    assert "whole chunks" not in open_slots(kv, 2).reason  # the engine is named first
