"""EdgeKV: keep attention KV as fragments and inject it back so prefill is skipped."""

from __future__ import annotations

from pathlib import Path

from .cache import EdgeKV, GenerationResult, PrefixMatch
from .config import CacheConfig
from .engines.base import FragmentSpec, KVAdapter
from .errors import (
    ConfigError, CorruptEntry, EdgeKVError, EngineError, FragmentError, IncompatibleFragment,
    ModelNotFound, StoreError, UnsupportedLayout,
)
from .fragment import KVFragment
from .store import FragmentStore, open_store

__all__ = [
    "CacheConfig", "ConfigError", "CorruptEntry", "EdgeKV", "EdgeKVError", "EngineError",
    "FragmentError", "FragmentSpec", "FragmentStore", "GenerationResult", "IncompatibleFragment",
    "KVAdapter", "KVFragment", "ModelNotFound", "PrefixMatch", "StoreError", "UnsupportedLayout",
    "open_llamacpp", "open_store",
]

__version__ = "0.1.0"


def open_llamacpp(model: str | Path | None = None, config: CacheConfig | None = None, *,
                  n_ctx: int = 2048, n_threads: int | None = None) -> EdgeKV:
    """An EdgeKV over llama.cpp with the default RAM + disk store (model: SmolLM2 by default)."""
    from .engines.llamacpp import LlamaCppAdapter

    config = config or CacheConfig.from_env()
    adapter = LlamaCppAdapter(model, n_ctx=n_ctx, n_threads=n_threads, memo_dir=config.cache_dir)
    return EdgeKV(adapter, open_store(config), config)
