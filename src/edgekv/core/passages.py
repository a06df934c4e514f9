"""Passage reuse for retrieval-augmented prompts (opt-in, approximate, labelled).

Prefix reuse stops at the first token that differs, so in RAG, where the same passages come
back in another order or after other passages, little is reused. Here the passages a caller
marks (`EdgeKV.generate(..., passages=[...])`, or `PASSAGE_SEPARATOR` in a CLI prompt) are
cached each with its own KV, computed alone (after the model's BOS, if it adds one) and keyed
by model + that context + its own tokens, in a key namespace of their own (`keys.passage_key`):
never confused with the exact prefix chains.

At request time each cached passage is placed at its new position (K re-rotated for the
position change by the engine, `engines.llamacpp_shift`), then a budget of its tokens is
recomputed so that they see the passages before them:

- "epic" (EPIC, arXiv 2410.15332): the first k tokens of each passage, where its attention sink
  sits when it is computed alone;
- "blend" (CacheBlend-like): the tokens whose early-layer KV changes most when the passage is
  computed after other text. CacheBlend measures this deviation at request time on one layer;
  llama.cpp cannot run one layer alone, so it is measured once, when the passage is cached,
  against a fixed preceding text (`BLEND_PREFIX`), on layer `BLEND_LAYER`, and tokens are
  chosen in blocks of `BLEND_BLOCK` (each block is one more state restore and one more forward
  pass, since llama.cpp only evaluates at consecutive positions after its last cell).

The question and everything after the passages are computed normally. A passage that sits
where it was cached, after the same tokens, is exact and recomputes nothing. The result is
labelled (`PassageReport`), and nothing computed on top of placed passages is written back
into the exact chains (the cache stores no fragment for such a request).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..engines.base import FragmentSpec, KVAdapter, PassageEngine, ShiftableKV
from ..errors import ConfigError, EdgeKVError, PromptError, UnsupportedLayout
from ..fragment import MAX_SPAN, PASSAGE_MIN_SPAN, PASSAGE_PARENT, KVFragment
from ..keys import passage_key
from ..limits import fit

if TYPE_CHECKING:
    from ..config import CacheConfig
    from ..store.base import FragmentStore

__all__ = ["PASSAGE_SEPARATOR", "POLICIES", "PassageEngine", "PassageLayout", "PassagePolicy",
           "PassageReport", "PassageReuse", "PlacedRun", "split_passages"]

log = logging.getLogger(__name__)

# The CLI's convention: "passage 1<|passage|>passage 2<|passage|>question"
PASSAGE_SEPARATOR = "<|passage|>"
POLICIES = ("epic", "blend")
# CacheBlend picks its tokens on an early layer (layer 1 in its paper); layer 0's KV does not
# depend on the context at all (it is the token's own projection), so 1 is the earliest that says
# anything.
BLEND_LAYER = 1
BLEND_BLOCK = 8
# the parent key of every passage fragment (`fragment.PASSAGE_PARENT`): never a chain's root,
# so the prefix lookup's radix step (which lists a parent's children) never meets a passage
BLEND_PREFIX = ("The following passages were retrieved from the Python documentation to help "
                "answer a question about the standard library.\n\n")


@dataclass(frozen=True, slots=True)
class PlacedRun:
    """A run of a request's tokens: cached KV at its new position (K re-rotated) to restore,
    or, with `keys` None, tokens the engine computes after what it holds."""

    tokens: Sequence[int]
    keys: np.ndarray | None = None  # [layer, token, n_embd_k]
    values: np.ndarray | None = None


def split_passages(text: str) -> tuple[list[str], str]:
    """A CLI prompt "p1<|passage|>p2<|passage|>question" as (passages, question)."""
    *passages, question = text.split(PASSAGE_SEPARATOR)
    return passages, question


@dataclass(frozen=True, slots=True)
class PassagePolicy:
    """Which tokens of each placed passage to recompute. `budget`: below 1, a fraction of the
    passage tokens (0.15); from 1 up, a number of tokens per passage (EPIC's k, e.g. 16)."""

    name: str = "epic"
    budget: float = 16

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ConfigError(f"passage policy {self.name!r}: use one of {', '.join(POLICIES)}")
        if self.budget < 0 or (self.budget >= 1 and self.budget != int(self.budget)):
            raise ConfigError(f"passage budget {self.budget}: a fraction in [0, 1) of the "
                              "passage tokens, or a whole number of tokens per passage")

    @property
    def label(self) -> str:
        if self.budget >= 1:
            return f"{self.name}/k{int(self.budget)}"
        return f"{self.name}/{self.budget * 100:g}%"

    def select(self, lengths: Sequence[int], scores: Sequence[np.ndarray | None]) -> list[
            np.ndarray]:
        """Per passage, a boolean mask of the tokens to recompute."""
        masks = [np.zeros(n, bool) for n in lengths]
        if self.budget == 0 or not lengths:
            return masks
        if self.name == "epic":
            for m in masks:
                k = int(self.budget) if self.budget >= 1 else math.ceil(self.budget * len(m))
                m[: min(k, len(m))] = True
            return masks
        total = (int(self.budget) * len(lengths) if self.budget >= 1
                 else math.ceil(self.budget * sum(lengths)))
        blocks: list[tuple[float, int, int, int]] = []  # (-mean score, passage, lo, hi)
        for i, (n, s) in enumerate(zip(lengths, scores, strict=True)):
            sc = np.zeros(n) if s is None else np.asarray(s, np.float64)
            for lo in range(0, n, BLEND_BLOCK):
                hi = min(n, lo + BLEND_BLOCK)
                blocks.append((-float(sc[lo:hi].mean()), i, lo, hi))
        chosen = 0
        for _, i, lo, hi in sorted(blocks):
            if chosen >= total:
                break
            masks[i][lo:hi] = True
            chosen += hi - lo
        return masks


@dataclass(frozen=True, slots=True)
class PassageSpan:
    start: int  # position in the request
    tokens: tuple[int, ...]
    key: str


@dataclass(frozen=True, slots=True)
class PassageLayout:
    """A request's tokens: the anchor (BOS, if the model adds one), the passages, the
    question; where each passage starts."""

    tokens: list[int]
    spans: tuple[PassageSpan, ...]

    @property
    def end(self) -> int:
        return self.spans[-1].start + len(self.spans[-1].tokens) if self.spans else 0

    def cut(self, n: int) -> int:
        """The largest passage boundary at or below `n` (a strict prefix match is cut there, so
        passages are placed whole)."""
        if not self.spans or n >= self.end:
            return n
        best = 0
        for s in self.spans:
            if s.start <= n:
                best = s.start
        return best


@dataclass(frozen=True, slots=True)
class PassageReport:
    """How a request's passages were placed: the label every passage-reuse result carries."""

    policy: str
    passages: int
    passage_tokens: int
    reused_tokens: int  # passage tokens placed from the cache (not recomputed)
    recomputed_tokens: int  # placed passages' tokens recomputed by the policy
    computed_passages: int  # not cached (new, or outside the fragment span range): computed
    exact_passages: int  # placed after the same tokens they were cached after: exact
    restores: int  # state restores (llama.cpp: one per cached run)
    # the passages none of whose KV came from the cache: (index, tokens, why)
    not_reused: tuple[tuple[int, int, str], ...] = ()

    @property
    def approximate(self) -> bool:
        """Reused KV sits in a context other than the one it was computed in."""
        return self.reused_tokens > 0 and self.exact_passages < self.passages - \
            self.computed_passages

    def as_dict(self) -> dict[str, object]:
        return {"policy": self.policy, "approximate": self.approximate,
                "passages": self.passages, "passage_tokens": self.passage_tokens,
                "reused_tokens": self.reused_tokens, "recomputed_tokens": self.recomputed_tokens,
                "computed_passages": self.computed_passages,
                "exact_passages": self.exact_passages, "restores": self.restores,
                "not_reused": [{"passage": i, "tokens": n, "reason": why}
                               for i, n, why in self.not_reused]}


class PassageReuse:
    """The passage step of `EdgeKV.generate`: layout, cache, place."""

    def __init__(self, adapter: KVAdapter, store: FragmentStore, config: CacheConfig) -> None:
        if not isinstance(adapter, ShiftableKV):
            raise UnsupportedLayout(
                f"{type(adapter).__name__} cannot move cached KV to another position (no RoPE "
                "shift); passage reuse runs on the llama.cpp engine. Drop --passage-reuse")
        self.engine: PassageEngine = adapter.passage_engine()
        self.adapter, self.store, self.config = adapter, store, config
        self.policy = PassagePolicy(config.passage_policy, config.passage_budget)
        self.anchor = adapter.tokenize("", add_bos=True)
        self.scores: dict[str, np.ndarray] = {}  # blend: per-token deviation, by passage key

    # -- public API ----------------------------------------------------------------------

    def layout(self, question: str | Sequence[int], passages: Sequence[str],
               max_tokens: int, root: str = "") -> PassageLayout:
        """The request's tokens with `passages` before `question`; `root`: the tenant's chain
        root (`keys.tenant_root`), whose passages alone are reused."""
        a, fp = self.adapter, self.adapter.fingerprint.digest
        tokens = list(self.anchor)
        spans = []
        for text in passages:
            ids = tuple(a.tokenize(text, add_bos=False, special=False))  # text only
            if ids:
                spans.append(PassageSpan(len(tokens), ids,
                                         passage_key(fp, ids, self.anchor, root)))
                tokens.extend(ids)
        asked = (a.tokenize(question, add_bos=False) if isinstance(question, str)
                 else [int(t) for t in question])
        if not asked:
            raise PromptError("the question after the passages is empty; the first output "
                              "token needs at least one token computed after them",
                              "invalid_value", "prompt")
        fit(a.n_ctx, len(asked), max_tokens, held=len(tokens))
        tokens += asked
        return PassageLayout(tokens, tuple(spans))

    def warm(self, passages: Sequence[str], scores: bool | None = None) -> int:
        """Cache each passage not cached yet (the RAG indexing step); return how many were.
        `scores`: also measure the deviation the blend policy ranks tokens by (default: when
        the configured policy is blend; else it is measured when a request first needs it)."""
        n = 0
        for text in passages:
            ids = tuple(self.adapter.tokenize(text, add_bos=False, special=False))
            key = passage_key(self.adapter.fingerprint.digest, ids, self.anchor)
            if not self._cacheable(ids):
                continue
            frag = self.store.get(key)
            if frag is None:
                frag = self._cache(key, ids)
                n += 1
            if (self.policy.name == "blend" if scores is None else scores) and \
                    key not in self.scores:
                self.scores[key] = self._deviation(frag)
        return n

    def place(self, layout: PassageLayout, held: int,
              policy: PassagePolicy | None = None) -> PassageReport:
        """The engine holds `layout.tokens[:held]` (a passage boundary, see `cut`); extend it
        up to the end of the last passage."""
        policy = policy or self.policy
        a = self.adapter
        todo = [s for s in layout.spans if s.start >= held]
        frags = [self._fragment(s) for s in todo]
        placed = [(s, f) for s, f in zip(todo, frags, strict=True) if f is not None]
        exact = {s.key for s, f in placed
                 if f.token_start == s.start and layout.tokens[: s.start] == list(self.anchor)}
        moved = [(s, f) for s, f in placed if s.key not in exact]
        scores = ([self._scores(s, f) for s, f in moved] if policy.name == "blend"
                  and policy.budget > 0 else [None] * len(moved))
        masks = dict(zip([s.key for s, _ in moved],
                         policy.select([len(s.tokens) for s, _ in moved], scores), strict=True))
        runs: list[PlacedRun] = []
        pos = held
        reused = recomputed = 0
        index = {sp.key: i for i, sp in enumerate(layout.spans)}
        not_reused: list[tuple[int, int, str]] = []
        for s, f in zip(todo, frags, strict=True):
            if pos < s.start:
                runs.append(PlacedRun(layout.tokens[pos : s.start]))
            pos = s.start + len(s.tokens)
            if f is None:
                runs.append(PlacedRun(s.tokens))
                not_reused.append((index[s.key], len(s.tokens), (
                    f"longer than the {MAX_SPAN}-token fragment maximum: computed, not cached"
                    if not self._cacheable(s.tokens) else
                    "not cached yet: computed here, cached after the answer")))
                continue
            keys = self.engine.shift_keys(f.keys, s.start - f.token_start)
            mask = masks.get(s.key, np.zeros(len(s.tokens), bool))
            if mask.all():
                not_reused.append((index[s.key], len(s.tokens),
                                   f"every token is within the recompute budget "
                                   f"({policy.label}): recomputed"))
            for lo, hi, compute in _runs(mask):
                if compute:
                    runs.append(PlacedRun(s.tokens[lo:hi]))
                    recomputed += hi - lo
                else:
                    runs.append(PlacedRun(s.tokens[lo:hi], keys[:, lo:hi], f.values[:, lo:hi]))
                    reused += hi - lo
        before = self.engine.restores
        if runs:
            self.engine.build(runs)
        if a.n_tokens != max(held, layout.end) or a.token_ids != layout.tokens[: a.n_tokens]:
            raise EdgeKVError("passage placement left the engine out of step with the request")
        return PassageReport(
            policy=policy.label, passages=len(layout.spans),
            passage_tokens=sum(len(s.tokens) for s in layout.spans), reused_tokens=reused,
            recomputed_tokens=recomputed, computed_passages=len(todo) - len(placed),
            exact_passages=len(exact), restores=self.engine.restores - before,
            not_reused=tuple(not_reused))

    def store_missing(self, layout: PassageLayout) -> int:
        """Cache the request's passages that were not cached (after the answer: each is
        computed alone, which clears the engine's context). Returns how many."""
        n = 0
        for s in layout.spans:
            if self._cacheable(s.tokens) and not self.store.contains(s.key):
                self._cache(s.key, s.tokens)
                n += 1
        return n

    # -- private helpers -----------------------------------------------------------------

    def _cacheable(self, ids: Sequence[int]) -> bool:
        return PASSAGE_MIN_SPAN <= len(ids) <= MAX_SPAN  # a passage fragment's span range

    def _fragment(self, span: PassageSpan) -> KVFragment | None:
        if not self._cacheable(span.tokens):
            return None
        frag = self.store.get(span.key)
        if frag is None or tuple(frag.token_ids.tolist()) != span.tokens:
            return None
        return frag

    def _cache(self, key: str, ids: Sequence[int]) -> KVFragment:
        """Compute the passage alone (after the anchor) and store its KV."""
        a = self.adapter
        a.clear_kv_cache()
        a.prefill([*self.anchor, *ids], align=a.n_ctx)
        lo = len(self.anchor)
        spec = FragmentSpec(key, lo, lo + len(ids), parent_key=PASSAGE_PARENT)
        (frag,) = a.extract_fragments([spec])
        self.store.put(key, frag.stamped(time.time(), self.config.ttl_s))
        if self.policy.name == "blend":
            self.scores[key] = self._deviation(frag)
        a.clear_kv_cache()
        return frag

    def _scores(self, span: PassageSpan, frag: KVFragment) -> np.ndarray:
        if span.key not in self.scores:  # cached by another process: measured now
            log.info("measuring the deviation of passage %s now", span.key[:12])
            self.scores[span.key] = self._deviation(frag)
        return self.scores[span.key]

    def _deviation(self, frag: KVFragment) -> np.ndarray:
        """Per token, how far its layer-`BLEND_LAYER` KV moves when the passage follows
        `BLEND_PREFIX` instead of standing alone (the K of both at the same position)."""
        a = self.adapter
        prefix = [*self.anchor, *a.tokenize(BLEND_PREFIX, add_bos=False)]
        ids = frag.token_ids.tolist()
        a.clear_kv_cache()
        a.prefill(prefix + ids, align=a.n_ctx)
        k, v = self.engine.layer_kv(BLEND_LAYER)
        a.clear_kv_cache()
        layer = BLEND_LAYER - frag.layer_start
        alone_k = self.engine.shift_keys(frag.keys[layer : layer + 1],
                                         len(prefix) - frag.token_start)[0]
        dk = k[len(prefix):].astype(np.float32) - alone_k.astype(np.float32)
        dv = v[len(prefix):].astype(np.float32) - frag.values[layer].astype(np.float32)
        return np.asarray((dk**2).sum(axis=1) + (dv**2).sum(axis=1), np.float64)


def _runs(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """Maximal runs of equal values in `mask`: (lo, hi, value)."""
    out: list[tuple[int, int, bool]] = []
    lo = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[lo]:
            out.append((lo, i, bool(mask[lo])))
            lo = i
    return out
