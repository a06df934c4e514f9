"""One request through `EdgeKV.generate`: what `prepare` makes of it (`Request`), the
result, and the seams of its steps (the fill step between the injection and the prefill, a
prefetcher told each request's signature).

The pipeline: prepare (the only place a prompt is tokenized and validated) -> match (strict,
approximate, passages cut whole) -> inject -> fill (the step chosen once, at construction:
local prefill, SparKV's stream-or-compute executor in `stream.hybrid`, or passage placement in
`fill`) -> prefill the rest -> generate -> commit (store, index, embed; after the last token).
A step gets what it needs handed to it (`FillRequest`), so it never reaches into the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

import numpy as np

from ..engines.base import KVAdapter
from ..errors import PromptError
from ..fragment import KVFragment
from ..keys import ChunkKey
from ..limits import fit
from .match import PrefixMatch
from .passages import PassageLayout, PassagePolicy, PassageReport

if TYPE_CHECKING:
    from ..config import CacheConfig
    from ..engines.constraint import Constraint

__all__ = ["FillRequest", "FillStep", "Filled", "GenerationResult", "LinkStats", "PrefetchHook",
           "PromptError", "Request", "RequestOptions", "Sampling", "fit", "prepare_tokens"]


def prepare_tokens(adapter: KVAdapter, prompt: str | Sequence[int], max_tokens: int) -> list[int]:
    """The prompt's token ids, refused (`PromptError`) if empty or if `max_tokens` more would
    not fit the context window (`fit`)."""
    tokens = adapter.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    fit(adapter.n_ctx, len(tokens), max_tokens)
    return tokens


@dataclass(frozen=True, slots=True)
class Sampling:
    """How tokens are drawn: greedy at temperature 0; `constraint` (a grammar, a logprob
    recorder, `engines.constraint`) masks what each step may sample, never the KV."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    keep_logits: bool = False
    constraint: Constraint | None = None


class RequestOptions(TypedDict, total=False):
    """`EdgeKV.prepare`'s keywords (and `generate`'s, which hands them on)."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    keep_logits: bool
    constraint: Constraint | None
    use_cache: bool
    store: bool
    approximate: bool | None
    salt: str
    namespace: str
    passages: Sequence[str] | None
    passage_policy: PassagePolicy | None
    speculative: bool | None


@dataclass(frozen=True, slots=True)
class Request:
    """A prepared request: everything the pipeline's steps read, computed once.

    `root`: the tenant's chain root (`keys.tenant_root`); `keys`: the chained keys of the
    prompt's full chunks under it; `text`: what the semantic router embeds (None where no
    router needs it); `layout`: the passages marked (passage reuse), else None."""

    tokens: tuple[int, ...]
    root: str
    keys: tuple[ChunkKey, ...]
    sampling: Sampling
    text: str | None = None
    use_cache: bool = True
    store: bool = True
    approximate: bool = False
    layout: PassageLayout | None = None
    passage_policy: PassagePolicy | None = None
    # verify n-gram drafts in one batch (`engines.spec`: the same tokens): None follows the
    # cache's setting (`CacheConfig.speculative`, where the probe allows it), False never,
    # True where the cache has speculation on
    speculative: bool | None = None


class PrefetchHook(Protocol):
    """What the cache tells a prefetcher (`prefetch.Prefetcher`): each request's signature."""

    def observe(self, sig: str | None) -> None: ...

    def drain(self) -> None:
        """Wait until the work `observe` queued is done (benchmarks charge it to their mode)."""

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class FillRequest:
    """What a fill step is handed: the engine, holding the first `held` tokens of the
    request's tokens (a multiple of `chunk_size` for a step with `whole_chunks`), and
    `check(fragment, i)`, which raises `ChunkRejected` or `IncompatibleFragment` unless
    `fragment` is chunk i of this request (chain key, tokens, model, every layer)."""

    adapter: KVAdapter
    request: Request
    chunk_size: int
    held: int
    check: Callable[[KVFragment, int], None]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.request.tokens

    @property
    def keys(self) -> tuple[ChunkKey, ...]:
        return self.request.keys

    @property
    def n_chunks(self) -> int:
        """The whole chunks a step may fill: the last prompt token is always computed after
        it (the first output token needs its logits)."""
        return (len(self.tokens) - 1) // self.chunk_size


@dataclass(frozen=True, slots=True)
class Filled:
    """What a fill step did: the engine now holds `held` tokens, `streamed` of them came from
    elsewhere and `placed` were passage tokens placed from the cache; `exact`: False if any of
    them is not this request's own bit-exact KV (a lossy codec, passages computed alone), so
    that nothing computed on top is stored. `report`: the step's own account (SparKV's
    `HybridResult`); `passages`: how passages were placed."""

    held: int
    streamed: int = 0
    exact: bool = True
    passages: PassageReport | None = None
    report: Any = None

    @property
    def placed(self) -> int:
        return self.passages.reused_tokens if self.passages is not None else 0


class FillStep(Protocol):
    """The step between the injection of the cache's match and the prefill of the rest,
    chosen once when the `EdgeKV` is built: it may extend what the engine holds (SparKV's
    executor streams or computes whole chunks, `stream.hybrid`; passage placement, `fill`).

    `whole_chunks`: the step continues from whole chunks only (the match is the exact chain
    walk, and the step runs where it ends on a chunk boundary). `attach` is called once by the
    `EdgeKV` it serves, with its model and config (a step may refuse them: `ConfigError`)."""

    whole_chunks: bool

    def attach(self, adapter: KVAdapter, config: CacheConfig) -> None: ...

    def fill(self, request: FillRequest) -> Filled: ...

    def close(self) -> None:
        """The `EdgeKV` closes: finish what the step still does in the background."""


@runtime_checkable
class LinkStats(Protocol):
    """A fill step that reads KV over a link (SparKV's `stream.hybrid.HybridLoader`) reports
    what the link did: a server shows it in /metrics without knowing the step's type."""

    def stats(self) -> dict[str, float]: ...


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
    fill_report: Any = field(default=None, repr=False)  # the fill step's account (`Filled`)
    # time spent waiting for another sequence to store the prompt's next chunk (`--parallel`);
    # part of ttft_s, not of lookup_s
    wait_s: float = 0.0
    # speculative decoding (`engines.spec`): drafted tokens verified, and how many the answer
    # took (each one a decode step saved); 0 and 0 where decoding was plain
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def tier(self) -> str | None:
        """The semantic router's tier for this request (exact, partial, miss); None without a
        router."""
        return None if self.match.tier == "none" else self.match.tier

    def summary(self) -> dict[str, Any]:
        """What reuse did, as `edgekv serve` reports it beside `usage` (the `edgekv` object:
        its keys are a contract)."""
        return {"cached_tokens": self.cached_tokens, "streamed_tokens": self.streamed_tokens,
                "computed_tokens": self.computed_tokens, "tier": self.tier,
                "approximate": self.approximate,
                "passages": None if self.passages is None else self.passages.as_dict(),
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens}

    @property
    def approximate(self) -> bool:
        """Whether any KV this answer rests on is not this prompt's own (approximate reuse, or
        passages placed from elsewhere): the output may differ from a cold run."""
        return self.match.approximate or (self.passages is not None
                                          and self.passages.approximate)

    @property
    def source_tiers(self) -> tuple[str, ...]:
        return self.match.source_tiers

    @property
    def rejections(self) -> tuple[str, ...]:
        return self.match.rejections
