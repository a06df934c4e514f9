"""The configuration, one object per part (the cache's, the SparKV client's, the KV server's),
every number readable from the environment by the same `EDGEKV_<NAME>` as before the split."""

from __future__ import annotations

import pytest

from edgekv import CacheConfig, ConfigError
from edgekv.config import KVServerConfig, StreamConfig, config_default
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
    stream, kv = StreamConfig.from_env(), KVServerConfig.from_env()
    assert (cfg.chunk_size, cfg.partial_reuse, cfg.reuse_granularity) == (256, True, "chunk")
    assert (cfg.index_save_every, stream.timeout_s, stream.wait_timeouts) == (4, 1.5, 3.0)
    assert (stream.patient_wait_timeouts, stream.max_replans) == (12.5, 0)
    assert kv.session_ttl_s == 60.0 and cfg.cache_dir == tmp_path
    monkeypatch.setenv("EDGEKV_INDEX_SAVE_EVERY", "often")
    with pytest.raises(ConfigError, match="EDGEKV_INDEX_SAVE_EVERY"):
        CacheConfig.from_env()


def test_stream_and_index_numbers_are_checked(tmp_path):
    parts = {"index_save_every": lambda **kw: CacheConfig(cache_dir=tmp_path, **kw),
             "stream_timeout_s": StreamConfig, "stream_wait_timeouts": StreamConfig,
             "kv_session_ttl_s": KVServerConfig}
    for name, part in parts.items():
        field = name.removeprefix(getattr(part, "PREFIX", ""))
        with pytest.raises(ConfigError, match=name):
            part(**{field: 0})
    with pytest.raises(ConfigError, match="stream_max_replans"):
        StreamConfig(max_replans=-1)


def test_objects_built_without_a_config_take_its_defaults():
    assert config_default("stream_timeout_s") == StreamConfig().timeout_s
    assert config_default("kv_session_ttl_s") == KVServerConfig().session_ttl_s
    assert config_default("chunk_size") == CacheConfig().chunk_size
    assert KVClient("http://127.0.0.1:1", b"s" * 32).timeout_s == StreamConfig().timeout_s
    with pytest.raises(ConfigError):
        config_default("no_such_field")
