"""Semantic layer: MiniLM embeddings, an HNSW index and three-tier routing."""

from __future__ import annotations

from .embedder import Embedder, HashEmbedder, MiniLMEmbedder
from .index import VectorIndex
from .router import Route, SemanticRouter, Tier

__all__ = ["Embedder", "HashEmbedder", "MiniLMEmbedder", "Route", "SemanticRouter", "Tier",
           "VectorIndex"]
