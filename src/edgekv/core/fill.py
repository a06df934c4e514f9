"""The fill steps that run on the device alone (`request.FillStep`); SparKV's, which streams
chunks from a KV server, is `stream.hybrid.HybridLoader`.

An `EdgeKV` holds one, chosen when it is built: `LocalPrefill` (nothing between the injection
and the prefill: the cache's own prefill computes the rest) unless passage reuse is on, then
`PassagePlacement`, which places a request's cached passages at their positions before the
rest is prefilled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .request import Filled, FillRequest

if TYPE_CHECKING:
    from ..config import CacheConfig
    from ..engines.base import KVAdapter
    from .passages import PassageReuse

__all__ = ["LocalPrefill", "PassagePlacement"]


class LocalPrefill:
    """No step: the engine keeps what was injected; the prefill computes everything else."""

    whole_chunks = False

    def attach(self, adapter: KVAdapter, config: CacheConfig) -> None:
        pass

    def fill(self, request: FillRequest) -> Filled:
        return Filled(request.held)

    def close(self) -> None:
        pass


class PassagePlacement:
    """Passage reuse (opt-in, approximate, `passages`): a request whose prompt was prepared
    with passages gets each cached passage placed where it sits (K re-rotated), with its
    recompute budget; a request without passages is left as `LocalPrefill` leaves it. What is
    computed on top of placed passages is never stored in the exact chains (`exact=False`)."""

    whole_chunks = False

    def __init__(self, reuse: PassageReuse) -> None:
        self.reuse = reuse

    def attach(self, adapter: KVAdapter, config: CacheConfig) -> None:
        pass

    def fill(self, request: FillRequest) -> Filled:
        req = request.request
        if req.layout is None or not req.use_cache:
            return Filled(request.held)
        placed = self.reuse.place(req.layout, request.held, req.passage_policy)
        return Filled(request.adapter.n_tokens, exact=False, passages=placed)

    def close(self) -> None:
        pass
