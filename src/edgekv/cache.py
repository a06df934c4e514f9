"""The orchestrator: find reusable KV, inject it, prefill the rest, generate, store.

Strict by default: KV is injected only where the model fingerprint, the chain of prefix keys
and the token ids all match the request (see `lookup`), so a warm request produces the same
logits as a cold one. How far reuse may go depends on the engine, measured once by the
batch-invariance probe (`engines.probe`): where the engine computes the same numbers whatever
the batch shape, reuse ends at any token (the longest verified common prefix with anything
stored), prefill runs in one batch like a plain user of the engine, and the KV of trailing
partial chunks and of generated tokens is stored for the next turn; the output then equals a
plain cold run of the engine bit for bit. Where it does not, reuse is whole chunks and prefill
runs in chunk-aligned batches, so a chunk's KV comes from the same batch shape warm or cold
(the output equals EdgeKV's own aligned cold run). Approximate reuse (the
EdgeSync seed's "inject on similarity") must be asked for, is labelled in every result, and
never writes fragments: KV computed on top of another prompt's KV is not this prompt's KV.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .config import CacheConfig
from .engines.base import FragmentSpec, KVAdapter, TokenCallback
from .engines.probe import ProbeResult, load_or_probe
from .errors import EdgeKVError, EngineError, FragmentError, IncompatibleFragment, StoreError
from .fragment import MAX_SPAN, MIN_SPAN, next_expiry
from .keys import ChunkKey, chunk_keys, next_key, tenant_root
from .lookup import Chunk, ChunkReader, PrefixMatch, PrefixMatcher, Router
from .store.base import FragmentStore

__all__ = ["EdgeKV", "GenerationResult", "PrefetchHook", "PrefixMatch"]

if TYPE_CHECKING:
    from .semantic.router import Route

log = logging.getLogger(__name__)


class PrefetchHook(Protocol):
    """What the cache tells a prefetcher (`prefetch.Prefetcher`): each request's signature."""

    def observe(self, sig: str | None) -> None: ...

    def close(self) -> None: ...

INDEX_SAVE_EVERY = 16  # semantic index additions between saves of its file


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

    @property
    def source_tiers(self) -> tuple[str, ...]:
        return self.match.source_tiers

    @property
    def rejections(self) -> tuple[str, ...]:
        return self.match.rejections


class EdgeKV:
    """Prefix KV reuse over one engine adapter, one (tiered) store and an optional router."""

    def __init__(self, adapter: KVAdapter, store: FragmentStore,
                 config: CacheConfig | None = None, *, router: Router | None = None,
                 prefetcher: PrefetchHook | None = None) -> None:
        self.adapter, self.store = adapter, store
        self.config = config or CacheConfig()
        self.router = router
        self.prefetcher = prefetcher
        self.fingerprint = adapter.fingerprint.digest
        n_layer = adapter.fingerprint.n_layer
        step = self.config.layers_per_fragment or n_layer
        groups = [(lo, min(n_layer, lo + step)) for lo in range(0, n_layer, step)]
        self.reader = ChunkReader(store, self.fingerprint, n_layer, groups)
        self._unsaved = 0  # index additions not yet written to disk
        self.probe: ProbeResult | None = None
        self.granularity_reason = "configured: reuse_granularity=chunk"
        if self.config.reuse_granularity == "auto":
            try:
                self.probe = load_or_probe(adapter, self.config.cache_dir / "probes")
                self.granularity_reason = (
                    "batch-invariance probe passed" if self.probe.invariant else
                    "batch-invariance probe failed: " + ", ".join(self.probe.failed))
            except EdgeKVError as e:  # e.g. a state layout the probe cannot read
                log.warning("batch-invariance probe could not run (%s); whole-chunk reuse", e)
                self.granularity_reason = f"batch-invariance probe could not run: {e}"
        # reuse ends at any token, prefill runs in one batch, tails and answers are stored
        self.token_exact = self.probe is not None and self.probe.invariant
        if not self.token_exact:
            log.info("reuse is whole %d-token chunks (%s)", self.config.chunk_size,
                     self.granularity_reason)
        self.matcher = PrefixMatcher(
            self.reader, self.config.chunk_size, token_exact=self.token_exact,
            partial_reuse=self.config.partial_reuse,
            min_reuse_tokens=self.config.min_reuse_tokens, router=router)
        if router is not None and hasattr(store, "add_remove_listener"):
            store.add_remove_listener(self._on_store_remove)

    # -- public API ----------------------------------------------------------------------

    @property
    def granularity(self) -> str:
        """"token": reuse ends at any token; "chunk": whole chunks only (see the module doc)."""
        return "token" if self.token_exact else "chunk"

    @property
    def prefill_align(self) -> int:
        """Batch boundaries for prefill: one batch where the engine is batch-invariant (as a
        plain user runs it), else multiples of the chunk size."""
        return self.adapter.n_ctx if self.token_exact else self.config.chunk_size

    def chunk_keys(self, tokens: Sequence[int], salt: str = "") -> list[ChunkKey]:
        """Chained keys of the full chunks of `tokens`, in the tenant `salt`'s own chain."""
        return chunk_keys(self.fingerprint, tokens, self.config.chunk_size,
                          tenant_root(self.fingerprint, salt))

    def cached_chunks(self, keys: Sequence[str], now: float | None = None,
                      rejections: list[str] | None = None) -> list[Chunk]:
        """The exact chain walk (see `ChunkReader.walk`)."""
        return self.reader.walk(keys, time.time() if now is None else now,
                                [] if rejections is None else rejections)

    def lookup(self, tokens: Sequence[int], text: str | None = None, *,
               approximate: bool | None = None, now: float | None = None,
               keys: Sequence[str] | None = None, salt: str = "") -> PrefixMatch:
        """What to restore for `tokens` (`PrefixMatcher.match_prefix`); `keys`: the tokens'
        chunk keys under `salt`, if already computed."""
        keys = self.chunk_keys(tokens, salt) if keys is None else keys
        return self.matcher.match_prefix(
            tokens, keys, tenant_root(self.fingerprint, salt), text=text, now=now,
            approximate=self.config.approximate if approximate is None else approximate)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 64,
                 temperature: float = 0.0, seed: int = 0, use_cache: bool = True,
                 store: bool = True, keep_logits: bool = False,
                 approximate: bool | None = None, top_p: float = 1.0,
                 on_token: TokenCallback | None = None, salt: str = "") -> GenerationResult:
        """Answer `prompt` (text, or token ids), reusing what the cache holds for it.

        `salt` names a tenant (an API key, an OpenAI `cache_salt`): its prefixes are cached in
        a chain of its own and never reused for another salt. `on_token` sees each sampled
        token as it comes and may stop the generation by returning False."""
        t0 = time.perf_counter()
        a = self.adapter
        tokens = a.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise EdgeKVError("the prompt is empty; give at least one token")
        if len(tokens) + max_tokens > a.n_ctx:
            raise EdgeKVError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"window ({a.n_ctx}); shorten the prompt or raise --n-ctx")
        text = prompt if isinstance(prompt, str) else None
        if text is None and self.router is not None and use_cache:
            text = a.detokenize(tokens)
        keys = self.chunk_keys(tokens, salt)  # once per request: lookup, store, prefetch
        match = (self.lookup(tokens, text, approximate=approximate, keys=keys, salt=salt)
                 if use_cache else PrefixMatch(0))
        rejections = match.rejections
        t_lookup = time.perf_counter()
        cached = self._inject(match)
        if cached != match.n_tokens:
            match = PrefixMatch(0, rejections=rejections, token_exact=self.token_exact)
        t_inject = time.perf_counter()
        before = a.counters.snapshot()
        logits = a.prefill(tokens[cached:], align=self.prefill_align)
        prefill_traffic = a.counters.since(before).traffic_bytes(
            getattr(a, "weight_bytes", 0), a.fingerprint.kv_bytes_per_token)
        t_first = time.perf_counter()  # choosing the first token from logits is ~20 us more
        if self.router is not None and use_cache and text is not None and match.route is None:
            # strict mode: the route is for reporting and indexing, off the TTFT path
            match = match.with_route(self.router.route(text))
        gen = a.generate(logits, max_tokens, temperature=temperature, seed=seed,
                         keep_logits=keep_logits, top_p=top_p, on_token=on_token)
        t_gen = time.perf_counter()
        stored = written = 0
        # KV computed on top of reuse that was not batch-exact is not what a cold run would
        # hold, so it is never stored (it would spread the difference to later requests)
        if store and use_cache and match.batch_exact(self.config.chunk_size):
            seq, seq_keys = tokens, keys
            if self.token_exact:  # the answer's KV too: the next turn's prompt holds it
                held = a.token_ids  # prompt + answer, less the last sampled token
                if len(held) > len(tokens) and held[: len(tokens)] == list(tokens):
                    seq, seq_keys = held, self.chunk_keys(held, salt)
            stored, written = self.store_new(seq, cached, seq_keys, match.route,
                                             tenant_root(self.fingerprint, salt))
        self._record_hits(match)
        if self.prefetcher is not None and use_cache:
            # a request's signature: its deepest full chunk, which names its context
            self.prefetcher.observe(keys[-1] if keys else None)
        t_end = time.perf_counter()
        return GenerationResult(
            text=a.detokenize(gen.tokens), tokens=gen.tokens, prompt_tokens=len(tokens),
            cached_tokens=cached, computed_tokens=len(tokens) - cached,
            ttft_s=t_first - t0, total_s=t_gen - t0, lookup_s=t_lookup - t0,
            inject_s=t_inject - t_lookup, prefill_s=t_first - t_inject,
            store_s=t_end - t_gen, stored_fragments=stored,
            kv_bytes_read=sum(f.nbytes for f in match.fragments) if cached else 0,
            kv_bytes_written=written, prefill_traffic_bytes=prefill_traffic,
            first_logits=logits, match=match,
            step_logits=gen.logits, finish_reason=gen.finish_reason)

    def clear(self) -> int:
        n = self.store.clear()
        if self.router is not None:
            self.router.index.clear()
        self._save_index()
        return n

    def sweep(self, now: float | None = None) -> int:
        """Drop expired fragments (their index entries go with them)."""
        n = self.store.sweep(now)
        self._save_index()
        return n

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self._save_index()
        self.store.close()

    # -- private helpers -----------------------------------------------------------------

    def _inject(self, match: PrefixMatch) -> int:
        self.adapter.clear_kv_cache()
        if not match.chunks:
            return 0
        try:
            return self.adapter.inject_fragments(match.fragments, limit=match.n_tokens)
        except (IncompatibleFragment, EngineError) as e:
            log.warning("injection refused (%s); recomputing the whole prompt", e)
            self.adapter.clear_kv_cache()
            return 0

    def store_new(self, tokens: Sequence[int], cached: int, keys: Sequence[str],
                  route: Route | None = None, root: str = "") -> tuple[int, int]:
        """Store the chunks of `tokens` from `cached` on (the engine holds their KV); the
        deepest gets the route's embedding and an index entry. Returns (fragments, bytes)."""
        c = self.config.chunk_size
        spans: list[tuple[str, str, int, int]] = []  # chain key, parent, start, end
        for i, key in enumerate(keys):
            if (i + 1) * c > cached:
                spans.append((key, keys[i - 1] if i else root, i * c, (i + 1) * c))
        tail = len(tokens) - len(keys) * c
        if tail and (self.router is not None or self.config.partial_reuse or self.token_exact):
            # the tokens after the last full chunk, found again by semantic search and verified
            # token by token; a tail shorter than a fragment's minimum span is stored together
            # with the chunk before it (that chunk's KV is then held twice)
            k = len(keys) if tail >= MIN_SPAN else len(keys) - 1
            if k >= 0 and len(tokens) - k * c <= MAX_SPAN:
                parent, start = (keys[k - 1] if k else root), k * c
                spans.append((next_key(parent, self.fingerprint, tokens[start:]), parent, start,
                              len(tokens)))
        specs = [FragmentSpec(key, lo, hi, glo, ghi, parent_key=parent)
                 for key, parent, lo, hi in spans
                 for glo, ghi in self.reader.layer_groups
                 if not self.store.contains(self.reader.store_key(key, glo, ghi))]
        if not specs:
            return 0, 0
        now = time.time()
        try:
            frags = self.adapter.extract_fragments(specs)
        except (EngineError, FragmentError) as e:
            log.warning("could not extract KV for caching (%s); nothing stored", e)
            return 0, 0
        deepest = max(f.token_end for f in frags)
        for spec, frag in zip(specs, frags):
            frag = frag.stamped(now, self.config.ttl_s)
            if route is not None and frag.token_end == deepest:
                frag = replace(frag, embedding=route.embedding)
            try:
                self.store.put(self.reader.store_key(spec.chain_key, spec.layer_start,
                                                     frag.layer_end), frag)
            except StoreError as e:  # e.g. disk full: the answer is already computed
                log.warning("could not store fragment %s (%s)", spec.chain_key[:12], e)
                return 0, 0
        if route is not None and self.router is not None:
            deep_key = next(s.chain_key for s, f in zip(specs, frags) if f.token_end == deepest)
            self.router.index.add(deep_key, route.embedding)
            self._unsaved += 1
            if self._unsaved >= INDEX_SAVE_EVERY:
                self._save_index()
        return len(frags), sum(f.nbytes for f in frags)

    def _save_index(self) -> None:
        """The index file is rewritten whole, so not after every request: every
        INDEX_SAVE_EVERY additions, on sweep, clear, compaction and close. Entries lost in a
        crash only lower approximate-mode recall until `rebuild`; strict reuse never uses it."""
        if self.router is not None:
            self.router.index.save()
        self._unsaved = 0

    def _record_hits(self, match: PrefixMatch) -> None:
        cfg, now = self.config, time.time()
        for chunk in match.chunks:
            for skey, frag in zip(chunk.store_keys, chunk.fragments):
                hits = frag.hit_count + 1
                expires = next_expiry(hits, now, cfg.ttl_s, cfg.promoted_ttl_s, cfg.promote_hits)
                self.store.touch(skey, hits, expires, now)

    def warm_chain(self, chain_key: str) -> int:
        """Bring the chunks of a chain (back to its start) into the RAM tier; return how many
        fragments were read. Used by the prefetcher's background thread."""
        warm = getattr(self.store, "warm", None)
        if warm is None:
            return 0
        n, key = 0, chain_key
        while key:
            frag = None
            for skey in self.reader.store_keys(key):
                frag = warm(skey)
                if frag is None:
                    return n
                n += 1
            key = frag.parent_key if frag is not None else ""
        return n

    def _on_store_remove(self, store_key: str) -> None:
        """Keep the index free of dangling entries: drop a chunk's entry once none of its
        fragments (whole or layer groups) is left in the store."""
        chain = store_key.split(".", 1)[0]
        if not any(self.store.contains(k) for k in {chain, *self.reader.store_keys(chain)}):
            if self.router is not None:
                self.router.index.remove(chain)

    def compact(self) -> object:
        from .compactor import compact

        fp = self.adapter.fingerprint
        report = compact(self.store, n_layer=fp.n_layer, n_head_kv=fp.n_head_kv)
        self._save_index()
        return report

