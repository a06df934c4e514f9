"""What one request through `EdgeKV.generate` is made of: the preamble, the result, and the
seams of its optional steps (a fill step between the injection and the prefill, a prefetcher
told each request's signature).

One path: preamble (`prepare_tokens`) -> match (`lookup`) -> inject -> fill (e.g. the SparKV
executor in `stream.hybrid`: chunks streamed from a KV server or computed here) -> prefill the
rest -> generate -> store. A step gets what it needs handed to it (`FillRequest`), so it never
reaches into the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .engines.base import KVAdapter
from .errors import EdgeKVError
from .fragment import KVFragment
from .lookup import PrefixMatch
from .passages import PassageReport

__all__ = ["FillRequest", "FillStep", "Filled", "GenerationResult", "PrefetchHook",
           "prepare_tokens"]


def prepare_tokens(adapter: KVAdapter, prompt: str | Sequence[int], max_tokens: int) -> list[int]:
    """The request preamble: the prompt's token ids, refused if empty or if `max_tokens` more
    would not fit the context window."""
    tokens = adapter.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not tokens:
        raise EdgeKVError("the prompt is empty; give at least one token")
    if len(tokens) + max_tokens > adapter.n_ctx:
        raise EdgeKVError(
            f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the context "
            f"window ({adapter.n_ctx}); shorten the prompt or raise --n-ctx")
    return tokens


class PrefetchHook(Protocol):
    """What the cache tells a prefetcher (`prefetch.Prefetcher`): each request's signature."""

    def observe(self, sig: str | None) -> None: ...

    def drain(self) -> None:
        """Wait until the work `observe` queued is done (benchmarks charge it to their mode)."""

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class FillRequest:
    """What a fill step is handed: the engine, holding the first `held` tokens of `tokens`
    (a multiple of `chunk_size`), the chunk keys of `tokens`, and `check(fragment, i)`, which
    raises `ChunkRejected` or `IncompatibleFragment` unless `fragment` is chunk i of this
    request (chain key, tokens, model, every layer)."""

    adapter: KVAdapter
    tokens: Sequence[int]
    keys: Sequence[str]
    chunk_size: int
    held: int
    check: Callable[[KVFragment, int], None]

    @property
    def n_chunks(self) -> int:
        """The whole chunks a step may fill: the last prompt token is always computed after
        it (the first output token needs its logits)."""
        return (len(self.tokens) - 1) // self.chunk_size


@dataclass(frozen=True, slots=True)
class Filled:
    """What a fill step did: the engine now holds `held` tokens, `streamed` of them came from
    elsewhere; `exact`: False if any of them is not bit-exact (a lossy codec), so that nothing
    computed on top is stored."""

    held: int
    streamed: int = 0
    exact: bool = True


class FillStep(Protocol):
    """A step between the injection of the cache's match and the prefill of the rest: it
    extends what the engine holds by whole chunks (`stream.hybrid.HybridLoader`'s executor)."""

    def fill(self, request: FillRequest) -> Filled: ...


@dataclass(frozen=True, slots=True)
class GenerationResult:
    text: str
    tokens: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    ttft_s: float
    total_s: float
    lookup_s: float
    inject_s: float
    prefill_s: float
    store_s: float
    stored_fragments: int
    kv_bytes_read: int  # fragment bytes read to inject (RAM or disk)
    kv_bytes_written: int  # fragment bytes stored
    prefill_traffic_bytes: int  # bytes the engine moved up to the first token (see EngineCounters)
    first_logits: np.ndarray = field(repr=False)
    match: PrefixMatch = field(default_factory=lambda: PrefixMatch(0), repr=False)
    step_logits: tuple[np.ndarray, ...] = field(default=(), repr=False)  # with keep_logits
    finish_reason: str = "length"  # "stop": end of sequence or `on_token` said stop
    # prompt tokens whose KV a fill step brought from elsewhere (neither cached nor computed)
    streamed_tokens: int = 0
    # passage reuse (opt-in, approximate): how the passages were placed; None when not used
    passages: PassageReport | None = None

    @property
    def source_tiers(self) -> tuple[str, ...]:
        return self.match.source_tiers

    @property
    def rejections(self) -> tuple[str, ...]:
        return self.match.rejections
