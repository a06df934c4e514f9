"""Three-tier semantic routing (seed: EXACT >= 0.92, PARTIAL >= 0.75, else MISS).

The router only says how similar the nearest stored prompts are and which fragments they
point to. What may be *injected* is decided afterwards by token verification in the cache:
similarity finds candidates, tokens decide reuse. Only the opt-in approximate mode injects a
candidate whose tokens differ from the request.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from .embedder import Embedder
from .index import VectorIndex

__all__ = ["Route", "SemanticRouter", "Tier"]


class Tier(str, enum.Enum):
    EXACT = "exact"
    PARTIAL = "partial"
    MISS = "miss"


@dataclass(frozen=True, slots=True)
class Route:
    tier: Tier
    similarity: float
    candidates: tuple[tuple[str, float], ...]  # (chain key, similarity), best first
    embedding: np.ndarray = field(repr=False)
    embed_s: float = 0.0
    search_s: float = 0.0


class SemanticRouter:
    def __init__(self, embedder: Embedder, index: VectorIndex, *, exact: float = 0.92,
                 partial: float = 0.75, k: int = 4) -> None:
        if not 0.0 <= partial <= exact <= 1.0:
            raise ValueError(
                f"thresholds must satisfy 0 <= partial ({partial}) <= exact ({exact}) <= 1")
        if embedder.dim != index.dim:
            raise ValueError(
                f"embedder gives {embedder.dim}-d vectors, the index holds {index.dim}-d")
        self.embedder, self.index = embedder, index
        self.exact, self.partial, self.k = exact, partial, k

    def tier_of(self, similarity: float) -> Tier:
        if similarity >= self.exact:
            return Tier.EXACT
        if similarity >= self.partial:
            return Tier.PARTIAL
        return Tier.MISS

    def route(self, text: str) -> Route:
        t0 = time.perf_counter()
        emb = self.embedder.embed([text])[0]
        t1 = time.perf_counter()
        cands = tuple(self.index.search(emb, self.k))
        t2 = time.perf_counter()
        best = cands[0][1] if cands else 0.0
        return Route(self.tier_of(best), best, cands, emb, t1 - t0, t2 - t1)
