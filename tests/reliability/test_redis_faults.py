"""The Redis store under faults, on real redis-server processes: stopped and restarted
mid-run, full (maxmemory with allkeys-lru, with noeviction). Every request completes by local
compute with its cold output, the outage is logged once and counted in `stats().errors`.
The fault rows run on the fake engine here; `edgekv bench faults` runs them on the real one
(and `test_restart_on_the_real_engine` does once)."""

from __future__ import annotations

import logging
import signal
import time

import pytest

from edgekv import CacheConfig, EdgeKV, StoreError
from edgekv.engines.fake import FakeAdapter
from edgekv.store.redis import RedisStore
from edgekv_harness import faults_redis

from .. import redis_kit
from ..conftest import make_fragment

REDIS_LOG = "edgekv.store.redis"


@pytest.fixture(autouse=True)
def _redis_installed():
    redis_kit.need_redis()


def warnings_of(caplog, name=REDIS_LOG):
    return [r for r in caplog.records if r.name == name and r.levelno >= logging.WARNING]


def test_stopped_redis_is_a_miss_logged_once_and_counted(tmp_path, caplog):
    srv = redis_kit.RedisServer(tmp_path / "r", "--appendonly", "yes", "--appendfsync", "always")
    srv.start()
    try:
        store = RedisStore(srv.url)
        f = make_fragment(chain_key="c", parent_key="p").stamped(time.time(), 600)
        store.put("c", f)
        srv.stop(kill=True)
        with caplog.at_level(logging.WARNING, logger=REDIS_LOG):
            for _ in range(20):
                assert store.get("c") is None
                assert not store.contains("c") and store.children("p") == []
            with pytest.raises(StoreError):
                store.put("d", make_fragment(chain_key="d"))
        assert len(warnings_of(caplog)) == 1  # one outage, one line
        assert store.stats().errors == 20 * 3 + 1
        assert store.stats().misses == 20
        srv.start()  # same port, same append-only file: the acknowledged entry is back
        g = store.get("c")
        assert g is not None and (g.keys == f.keys).all()
        caplog.clear()
        srv.stop(kill=True)
        with caplog.at_level(logging.WARNING, logger=REDIS_LOG):
            store.get("c")
            store.get("c")
        assert len(warnings_of(caplog)) == 1  # a new outage is logged again, once
        store.close()
    finally:
        srv.stop()


def test_hung_server_is_skipped_for_retry_s(tmp_path):
    """A server that times out (SIGSTOP: it accepts nothing, answers nothing) is not tried
    again for `retry_s`: one timeout, not one per call. Proof without a clock: once it runs
    again, calls still count as errors until the window is over."""
    with redis_kit.server(tmp_path / "r") as srv:
        store = RedisStore(srv.url, timeout_s=0.3, retry_s=3600.0)
        store.put("c", make_fragment(chain_key="c").stamped(time.time(), 600))
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            assert store.get("c") is None  # times out, marks the server down for an hour
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        assert not store.contains("c") and store.stats().errors == 2  # skipped, not tried
        with pytest.raises(StoreError):
            store.put("d", make_fragment(chain_key="d"))
        store._skip_until.clear()  # the window is over
        assert store.get("c") is not None and store.stats().errors == 3


def test_noeviction_refuses_a_put_whole(tmp_path, caplog):
    """A full Redis under noeviction refuses the transaction: neither the fragment nor its
    metadata is written, the put raises, the error is logged once, reads keep working."""
    with redis_kit.server(tmp_path / "r", "--maxmemory-policy", "noeviction") as srv:
        store = RedisStore(srv.url)
        small = make_fragment(chain_key="a").stamped(time.time(), 600)
        store.put("a", small)
        admin = srv.client()
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + 1024)
        big = make_fragment(span=2048, n_layer=8, width=64, chain_key="b").stamped(time.time(), 600)
        with caplog.at_level(logging.WARNING, logger=REDIS_LOG):
            for _ in range(5):
                with pytest.raises(StoreError, match="OOM|maxmemory"):
                    store.put("b", big)
        assert not admin.exists(store._k("frag", "b"), store._k("meta", "b"))
        assert len(warnings_of(caplog)) == 1 and store.stats().errors == 5
        assert store.get("a") is not None  # a full Redis still serves reads
        admin.config_set("maxmemory", 0)
        store.put("b", big)
        assert store.get("b") is not None
        admin.close()


def test_restart_row_on_the_fake_engine(tmp_path):
    eng = redis_kit.fake_engine(tmp_path)
    row = faults_redis.restart(eng, tmp_path, {"requests": 4, "duration": 0.0,
                                               "redis_restarts": 2})
    assert row["fault"] == "redis_restart" and row["runs"] == 2
    assert row["wrong_outputs"] == 0 and row["lost_requests"] == 0
    assert row["lost_entries"] == 0 and row["acked_entries"] > 0
    assert row["recovery_s"] is not None
    assert row["errors_logged"] == 2  # once per outage
    assert row["errors_counted"] > row["errors_logged"]
    # while Redis is down, what it acknowledged is unavailable (not lost: it comes back)
    assert 0 < row["unavailable_entries"] <= row["acked_entries"]
    assert row["recovery_s_max"] == max(row["recovery_each_s"]) >= row["recovery_s"]
    assert row["not_recovered"] == 0 and row["status"] == "measured"
    assert 0 <= row["kills_during_request"] <= row["runs"]


def test_full_row_on_the_fake_engine(tmp_path):
    eng = redis_kit.fake_engine(tmp_path, n_prompts=8)
    row = faults_redis.full(eng, tmp_path, {})
    assert row["wrong_outputs"] == 0 and row["lost_requests"] == 0
    assert row["lost_entries"] == 0
    lru, noev = row["policies"]["allkeys-lru"], row["policies"]["noeviction"]
    assert lru["evicted_entries"] > 0 and lru["errors_counted"] == 0
    assert noev["evicted_keys_info"] == 0 and noev["errors_while_full"] > 0
    assert noev["errors_logged"] == 1  # refused writes: one line, however many
    assert row["recovery_s"] is not None
    assert row["evicted_entries"] == lru["evicted_entries"] > 0  # shown, apart from lost
    assert row["recovery_s_max"] == max(row["recovery_each_s"]) >= row["recovery_s"]


@pytest.mark.real
def test_restart_on_the_real_engine(tmp_path):
    from edgekv.engines.models import default_model_path

    from ..conftest import real_stack

    real_stack("llama.cpp", "llama_cpp", check=default_model_path)
    row = faults_redis.FAULTS["redis_restart"](tmp_path, {
        "requests": 3, "duration": 0.0, "kills": 1, "max_tokens": 6})
    assert row["wrong_outputs"] == 0 and row["lost_requests"] == 0
    assert row["lost_entries"] == 0 and row["errors_logged"] == 1


def test_a_cache_over_a_dead_redis_still_answers(tmp_path):
    """The store object outlives its server: a fresh EdgeKV over it answers every request."""
    with redis_kit.server(tmp_path / "r") as srv:
        store = RedisStore(srv.url)
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path, reuse_granularity="chunk")
    kv = EdgeKV(FakeAdapter(), store, cfg)
    prompt = "The hub connects lights, thermostats and sensors. " * 6
    cold = kv.generate(prompt, max_tokens=4, use_cache=False, store=False)
    for _ in range(3):
        r = kv.generate(prompt, max_tokens=4)
        assert r.tokens == cold.tokens and r.cached_tokens == 0
    assert store.stats().errors > 0
