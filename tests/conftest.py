from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, KVFragment, open_store
from edgekv.engines.fake import FakeAdapter


def make_fragment(span: int = 64, n_layer: int = 4, width: int = 8, start: int = 0,
                  fingerprint: str = "fp", chain_key: str = "ck", seed: int = 0,
                  **kw: object) -> KVFragment:
    rng = np.random.default_rng(seed)
    layers = kw.pop("layers", n_layer)
    return KVFragment(
        model_fingerprint=fingerprint, chain_key=chain_key, token_start=start,
        token_end=start + span, layer_start=0, layer_end=layers, layer_stride=1,
        n_layer_model=n_layer, token_ids=rng.integers(0, 1000, span, dtype=np.int32),
        keys=rng.standard_normal((layers, span, width)).astype(np.float16),
        values=rng.standard_normal((layers, span, width)).astype(np.float16), **kw)  # type: ignore[arg-type]


@pytest.fixture
def fragment_factory():
    return make_fragment


@pytest.fixture
def fake_cache(tmp_path: Path) -> EdgeKV:
    """Whole-chunk reuse (what an engine that fails the batch-invariance probe gets); the
    token-granular path has its own tests in test_granularity.py."""
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path, reuse_granularity="chunk")
    kv = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
    yield kv
    kv.store.close()


def require_real() -> bool:
    """Under `make test` (EDGEKV_REQUIRE_REAL=1) a missing engine fails instead of skipping."""
    return os.environ.get("EDGEKV_REQUIRE_REAL") == "1"


def real_stack(what: str, *modules: str, check: Callable[[], object] | None = None) -> None:
    """Import `modules` and run `check` (e.g. find the model): if anything is missing the
    calling test module is skipped, except under `make test`, where it fails."""
    try:
        for name in modules:
            importlib.import_module(name)
        if check is not None:
            check()
    except Exception as e:  # noqa: BLE001 - any import or model problem
        if require_real():
            raise
        pytest.skip(f"{what} unavailable: {e}", allow_module_level=True)
