"""CacheConfig: every number in one place, readable from the environment."""

from __future__ import annotations

import pytest

from edgekv import CacheConfig, ConfigError
from edgekv.config import config_default
from edgekv.stream.client import KVClient


def test_from_env_parses_each_field_by_its_type(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEKV_CHUNK_SIZE", "256")
    monkeypatch.setenv("EDGEKV_PARTIAL_REUSE", "yes")
    monkeypatch.setenv("EDGEKV_REUSE_GRANULARITY", " Chunk ")
    monkeypatch.setenv("EDGEKV_INDEX_SAVE_EVERY", "4")
    monkeypatch.setenv("EDGEKV_STREAM_TIMEOUT_S", "1.5")
    monkeypatch.setenv("EDGEKV_STREAM_WAIT_TIMEOUTS", "3")
    monkeypatch.setenv("EDGEKV_STREAM_PATIENT_WAIT_TIMEOUTS", "12.5")
    monkeypatch.setenv("EDGEKV_STREAM_MAX_REPLANS", "0")
    monkeypatch.setenv("EDGEKV_KV_SESSION_TTL_S", "60")
    cfg = CacheConfig.from_env(cache_dir=tmp_path)
    assert (cfg.chunk_size, cfg.partial_reuse, cfg.reuse_granularity) == (256, True, "chunk")
    assert (cfg.index_save_every, cfg.stream_timeout_s, cfg.stream_wait_timeouts) == (4, 1.5, 3.0)
    assert (cfg.stream_patient_wait_timeouts, cfg.stream_max_replans) == (12.5, 0)
    assert cfg.kv_session_ttl_s == 60.0 and cfg.cache_dir == tmp_path
    monkeypatch.setenv("EDGEKV_INDEX_SAVE_EVERY", "often")
    with pytest.raises(ConfigError, match="EDGEKV_INDEX_SAVE_EVERY"):
        CacheConfig.from_env()


def test_stream_and_index_numbers_are_checked(tmp_path):
    for name in ("index_save_every", "stream_timeout_s", "stream_wait_timeouts",
                 "kv_session_ttl_s"):
        with pytest.raises(ConfigError, match=name):
            CacheConfig(cache_dir=tmp_path, **{name: 0})
    with pytest.raises(ConfigError, match="stream_max_replans"):
        CacheConfig(cache_dir=tmp_path, stream_max_replans=-1)


def test_objects_built_without_a_config_take_its_defaults():
    assert config_default("stream_timeout_s") == CacheConfig().stream_timeout_s
    assert KVClient("http://127.0.0.1:1", b"s" * 32).timeout_s == CacheConfig().stream_timeout_s
    with pytest.raises(ConfigError):
        config_default("no_such_field")
