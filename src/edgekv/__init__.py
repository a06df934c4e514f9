"""EdgeKV: keep attention KV as fragments and inject it back so prefill is skipped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .config import CacheConfig
from .core.pipeline import EdgeKV, GenerationResult, PrefixMatch
from .engines.base import FragmentSpec, KVAdapter
from .errors import (
    ChunkRejected,
    ConfigError,
    CorruptEntry,
    EdgeKVError,
    EngineError,
    FragmentError,
    IncompatibleFragment,
    ModelNotFound,
    StoreError,
    StreamTimeout,
    TransportError,
    UnsupportedLayout,
)
from .fragment import KVFragment
from .keys import chain_of
from .store import FragmentStore, open_store

if TYPE_CHECKING:
    import numpy as np

    from .core.request import FillStep
    from .semantic import Embedder, SemanticRouter

__all__ = [
    "CacheConfig", "ChunkRejected", "ConfigError", "CorruptEntry", "EdgeKV", "EdgeKVError",
    "EngineError", "FragmentError", "FragmentSpec", "FragmentStore", "GenerationResult",
    "IncompatibleFragment", "KVAdapter", "KVFragment", "ModelNotFound", "PrefixMatch",
    "StoreError", "StreamTimeout", "TransportError", "UnsupportedLayout", "open_llamacpp",
    "open_router", "open_store",
]

__version__ = "0.1.0"


def open_llamacpp(model: str | Path | None = None, config: CacheConfig | None = None, *,
                  n_ctx: int = 2048, n_threads: int | None = None, semantic: bool = False,
                  prefetch: bool = False, engine: str = "llamacpp",
                  fill: FillStep | None = None, store_url: str | None = None,
                  staged_probe: bool = False, **llama_kwargs: object) -> EdgeKV:
    """An EdgeKV over an engine (llama.cpp by default, `engine="torch"` or `"onnx"`) with the
    default RAM + disk store (model: SmolLM2 by default).

    `semantic=True` adds MiniLM + HNSW routing (index kept beside the disk store);
    `prefetch=True` adds the n-gram prefetcher that warms predicted contexts into RAM;
    `fill`: the step between injection and prefill, e.g. SparKV loading from a KV server
    (`stream.hybrid.HybridLoader`); `store_url`: the store behind RAM instead of the disk
    store (`store.open_store_url`: redis://... shares fragments between processes);
    `staged_probe`: a first start runs the probe's short stage only (`EdgeKV`).
    """
    from .engines import open_adapter

    config = config or CacheConfig.from_env()
    adapter = open_adapter(engine, model, n_ctx=n_ctx, n_threads=n_threads,
                           memo_dir=config.cache_dir, **llama_kwargs)
    store = open_store(config, store_url)
    router = None
    if semantic:
        from .semantic import MiniLMEmbedder

        router = open_router(MiniLMEmbedder(config.cache_dir), store, config)
    return EdgeKV(adapter, store, config, router=router, prefetch=prefetch, fill=fill,
                  staged_probe=staged_probe)


def open_router(embedder: Embedder, store: FragmentStore,
                config: CacheConfig) -> SemanticRouter:
    """A SemanticRouter whose index lives beside the disk store and is rebuilt from it."""
    from .semantic import SemanticRouter, VectorIndex

    def from_store() -> Iterator[tuple[str, np.ndarray]]:
        persistent = store.persistent_tier()  # read without filling the RAM tier
        for key in persistent.keys():
            frag = persistent.get(key)
            if frag is not None and frag.embedding is not None:
                yield chain_of(key), frag.embedding

    index = VectorIndex(embedder.dim, config.cache_dir / "store" / "semantic.usearch",
                        rebuild_from=from_store)
    return SemanticRouter(embedder, index, exact=config.semantic_exact,
                          partial=config.semantic_partial, k=config.semantic_k)
