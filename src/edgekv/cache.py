"""The orchestrator: look up the longest cached prefix, inject it, prefill the rest, store.

Strict by construction: a fragment is injected only if its model fingerprint, chain key (the
whole prefix), token ids, positions and layers all match the request; anything else is
reported as a rejection and recomputed. With aligned prefill (see `engines.base`) a warm
request therefore produces the same logits as a cold one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .config import CacheConfig
from .engines.base import FragmentSpec, KVAdapter
from .errors import EdgeKVError, EngineError, IncompatibleFragment
from .fragment import KVFragment, next_expiry
from .keys import ChunkKey, chunk_keys
from .store.base import FragmentStore

__all__ = ["EdgeKV", "GenerationResult", "PrefixMatch"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    n_tokens: int  # tokens covered by `fragments`
    fragments: tuple[KVFragment, ...]
    store_keys: tuple[str, ...]
    rejections: tuple[str, ...] = ()
    source_tiers: tuple[str, ...] = ()


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
    first_logits: np.ndarray = field(repr=False)
    source_tiers: tuple[str, ...] = ()
    rejections: tuple[str, ...] = ()
    step_logits: tuple[np.ndarray, ...] = field(default=(), repr=False)  # with keep_logits


class EdgeKV:
    """Prefix KV reuse over one engine adapter and one (tiered) fragment store."""

    def __init__(self, adapter: KVAdapter, store: FragmentStore,
                 config: CacheConfig | None = None) -> None:
        self.adapter = adapter
        self.store = store
        self.config = config or CacheConfig()
        self.fingerprint = adapter.fingerprint.digest
        n_layer = adapter.fingerprint.n_layer
        step = self.config.layers_per_fragment or n_layer
        self._layer_groups = [(lo, min(n_layer, lo + step)) for lo in range(0, n_layer, step)]

    # -- public API ----------------------------------------------------------------------

    def chunk_keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        return chunk_keys(self.fingerprint, tokens, self.config.chunk_size)

    def lookup(self, tokens: Sequence[int], now: float | None = None) -> PrefixMatch:
        """Longest run of verified cached chunks from position 0.

        At most (len(tokens) - 1) // chunk_size chunks are reused, so at least one prompt
        token is always computed: the first generated token needs its logits.
        """
        now = time.time() if now is None else now
        c = self.config.chunk_size
        ids = np.asarray(tokens, dtype=np.int32)
        keys = self.chunk_keys(tokens)[: max(0, (len(tokens) - 1) // c)]
        frags: list[KVFragment] = []
        store_keys: list[str] = []
        tiers: list[str] = []
        rejections: list[str] = []
        for i, key in enumerate(keys):
            got: list[tuple[str, KVFragment]] = []
            for lo, hi in self._layer_groups:
                skey = self._store_key(key, lo, hi)
                frag = self.store.get(skey, now)
                if frag is None:
                    break
                try:
                    self._verify(frag, key, ids, i * c, (i + 1) * c, lo, hi)
                except IncompatibleFragment as e:
                    log.warning("rejected cached fragment %s: %s", skey, e)
                    rejections.append(f"{skey[:16]}: {e}")
                    break
                got.append((skey, frag))
                tier = getattr(self.store, "last_tier", None)
                tiers.append(tier or "store")
            if len(got) != len(self._layer_groups):
                break
            for skey, frag in got:
                store_keys.append(skey)
                frags.append(frag)
        n = (len(frags) // len(self._layer_groups)) * c
        return PrefixMatch(n, tuple(frags), tuple(store_keys), tuple(rejections), tuple(tiers))

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 64,
                 temperature: float = 0.0, seed: int = 0, use_cache: bool = True,
                 store: bool = True, keep_logits: bool = False) -> GenerationResult:
        t0 = time.perf_counter()
        a = self.adapter
        tokens = a.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise EdgeKVError("the prompt is empty; give at least one token")
        if len(tokens) + max_tokens > a.n_ctx:
            raise EdgeKVError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"window ({a.n_ctx}); shorten the prompt or raise --n-ctx")
        match = self.lookup(tokens) if use_cache else PrefixMatch(0, (), ())
        t_lookup = time.perf_counter()
        cached = self._inject(match)
        t_inject = time.perf_counter()
        logits = a.prefill(tokens[cached:], align=self.config.chunk_size)
        t_first = time.perf_counter()  # choosing the first token from logits is ~20 us more
        gen = a.generate(logits, max_tokens, temperature=temperature, seed=seed,
                         keep_logits=keep_logits)
        t_gen = time.perf_counter()
        stored = self._store_new(tokens, cached) if (store and use_cache) else 0
        self._record_hits(match)
        t_end = time.perf_counter()
        return GenerationResult(
            text=a.detokenize(gen.tokens), tokens=gen.tokens, prompt_tokens=len(tokens),
            cached_tokens=cached, computed_tokens=len(tokens) - cached,
            ttft_s=t_first - t0, total_s=t_gen - t0, lookup_s=t_lookup - t0,
            inject_s=t_inject - t_lookup, prefill_s=t_first - t_inject,
            store_s=t_end - t_gen, stored_fragments=stored, first_logits=logits,
            source_tiers=match.source_tiers, rejections=match.rejections, step_logits=gen.logits)

    def clear(self) -> int:
        return self.store.clear()

    # -- private helpers -----------------------------------------------------------------

    def _store_key(self, key: str, lo: int, hi: int) -> str:
        if len(self._layer_groups) == 1:
            return key
        return f"{key}.L{lo}-{hi}"

    def _verify(self, frag: KVFragment, key: str, ids: np.ndarray, start: int, end: int,
                lo: int, hi: int) -> None:
        if frag.model_fingerprint != self.fingerprint:
            raise IncompatibleFragment(
                f"made by another model ({frag.model_fingerprint[:12]}, this is {self.fingerprint[:12]})")
        if frag.chain_key != key:
            raise IncompatibleFragment("its chain key does not match the request prefix")
        if (frag.token_start, frag.token_end) != (start, end):
            raise IncompatibleFragment(
                f"covers tokens [{frag.token_start}, {frag.token_end}), needed [{start}, {end})")
        if not np.array_equal(frag.token_ids, ids[start:end]):
            raise IncompatibleFragment("its token ids differ from the request's")
        if (frag.layer_start, frag.layer_end, frag.layer_stride) != (lo, hi, 1):
            raise IncompatibleFragment(
                f"holds layers [{frag.layer_start}, {frag.layer_end}) stride {frag.layer_stride}, "
                f"needed [{lo}, {hi}) stride 1")

    def _inject(self, match: PrefixMatch) -> int:
        self.adapter.clear_kv_cache()
        if not match.fragments:
            return 0
        try:
            return self.adapter.inject_fragments(match.fragments)
        except (IncompatibleFragment, EngineError) as e:
            log.warning("injection refused (%s); recomputing the whole prompt", e)
            self.adapter.clear_kv_cache()
            return 0

    def _store_new(self, tokens: Sequence[int], cached: int) -> int:
        c = self.config.chunk_size
        keys = self.chunk_keys(tokens)
        first_new = cached // c
        specs = [
            FragmentSpec(key, i * c, (i + 1) * c, lo, hi)
            for i, key in enumerate(keys) if i >= first_new
            for lo, hi in self._layer_groups
            if not self.store.contains(self._store_key(key, lo, hi))
        ]
        if not specs:
            return 0
        now = time.time()
        try:
            frags = self.adapter.extract_fragments(specs)
        except EngineError as e:
            log.warning("could not extract KV for caching (%s); nothing stored", e)
            return 0
        for spec, frag in zip(specs, frags):
            key = self._store_key(spec.chain_key, spec.layer_start, frag.layer_end)
            self.store.put(key, frag.stamped(now, self.config.ttl_s))
        return len(frags)

    def _record_hits(self, match: PrefixMatch) -> None:
        cfg, now = self.config, time.time()
        for skey, frag in zip(match.store_keys, match.fragments):
            hits = frag.hit_count + 1
            expires = next_expiry(hits, now, cfg.ttl_s, cfg.promoted_ttl_s, cfg.promote_hits)
            self.store.touch(skey, hits, expires, now)
