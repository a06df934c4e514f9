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

import numpy as np

from .config import CacheConfig
from .engines.base import FragmentSpec, KVAdapter
from .engines.probe import ProbeResult, load_or_probe
from .errors import EdgeKVError, EngineError, FragmentError, IncompatibleFragment, StoreError
from .fragment import MAX_SPAN, MIN_SPAN, KVFragment, common_prefix, next_expiry
from .engines.base import TokenCallback
from .keys import ChunkKey, chunk_keys, next_key, tenant_root
from .lookup import Chunk, ChunkReader
from .store.base import FragmentStore

__all__ = ["EdgeKV", "GenerationResult", "PrefixMatch"]

log = logging.getLogger(__name__)

INDEX_SAVE_EVERY = 16  # semantic index additions between saves of its file


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    n_tokens: int  # tokens to restore
    chunks: tuple[Chunk, ...] = ()
    exact_tokens: int = 0  # covered by the exact chain walk
    approximate: bool = False
    mismatched_tokens: int = 0  # approximate mode: restored positions whose token differs
    tier: str = "none"  # exact / partial / miss from the semantic router, "none" without one
    similarity: float = 0.0
    route_s: float = 0.0
    rejections: tuple[str, ...] = ()
    route: object | None = field(default=None, repr=False)  # the semantic route, if computed
    token_exact: bool = False  # the engine passed the batch-invariance probe


    @property
    def fragments(self) -> tuple[KVFragment, ...]:
        return tuple(f for c in self.chunks for f in c.fragments)

    def batch_exact(self, chunk_size: int) -> bool:
        """A warm run equals a cold one bit for bit: this request's own tokens, and either a
        batch-invariant engine or whole chunks (computed by the same batch shape as cold)."""
        return not self.approximate and (self.token_exact or self.n_tokens % chunk_size == 0)

    @property
    def source_tiers(self) -> tuple[str, ...]:
        return tuple(c.tier for c in self.chunks)


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
                 config: CacheConfig | None = None, *, router: object | None = None,
                 prefetcher: object | None = None) -> None:
        self.adapter, self.store = adapter, store
        self.config = config or CacheConfig()
        self.router = router  # semantic.SemanticRouter (duck-typed to keep the layers apart)
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
        """The exact chain walk: verified chunks under `keys`, from the first until one is
        missing or refused."""
        now = time.time() if now is None else now
        rejections = [] if rejections is None else rejections
        chunks: list[Chunk] = []
        for key in keys:
            chunk = self.reader.read(key, now, rejections)
            if chunk is None:
                break
            chunks.append(chunk)
        return chunks

    def lookup(self, tokens: Sequence[int], text: str | None = None, *,
               approximate: bool | None = None, now: float | None = None,
               keys: Sequence[str] | None = None, salt: str = "") -> PrefixMatch:
        """What to restore for `tokens`: at most len(tokens) - 1 positions, so the first
        output token's logits are always computed. `keys`: the tokens' chunk keys, if known.

        Strict reuse starts with the exact chain walk over whole chunks. On a batch-invariant
        engine (and with `partial_reuse` or in approximate mode elsewhere) the stored
        successors of the chain's last chunks are then compared token by token and a common
        prefix ending inside a chunk is reused too (a radix step; token-verified, and exact
        only where the engine is batch-invariant). Any KV valid for this
        request hangs off its own chain, so semantic search cannot find more; it is needed
        before the first token only in approximate mode (`text` is then embedded).
        """
        now = time.time() if now is None else now
        approximate = self.config.approximate if approximate is None else approximate
        c, ids, limit = self.config.chunk_size, np.asarray(tokens, np.int32), len(tokens) - 1
        keys = self.chunk_keys(tokens, salt) if keys is None else keys
        root = tenant_root(self.fingerprint, salt)
        rejections: list[str] = []
        chunks = self.cached_chunks(keys[: limit // c], now, rejections)
        n = len(chunks) * c
        best = PrefixMatch(n, tuple(chunks), n, token_exact=self.token_exact)
        ext = (self._successors(ids, chunks, limit, now, rejections, root)
               if self.config.partial_reuse or approximate or self.token_exact else None)
        if ext is not None:
            best = replace(best, n_tokens=ext[1], chunks=tuple(ext[0]))
        if approximate and self.router is not None and text is not None:
            route = self.router.route(text)  # type: ignore[attr-defined]
            best = replace(best, tier=route.tier.value, similarity=route.similarity,
                           route_s=route.embed_s + route.search_s, route=route)
            if route.tier.value != "miss" and route.candidates:
                approx = self._approximate(route.candidates[0][0], ids, limit, now, rejections,
                                           root)
                if approx is not None and approx.n_tokens > best.n_tokens:
                    best = replace(approx, exact_tokens=n, tier=best.tier, route=route,
                                   token_exact=self.token_exact,
                                   similarity=best.similarity, route_s=best.route_s)
        return replace(best, rejections=tuple(rejections))

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
            route = self.router.route(text)  # type: ignore[attr-defined]
            match = replace(match, tier=route.tier.value, similarity=route.similarity,
                            route_s=route.embed_s + route.search_s, route=route)
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
            self.prefetcher.observe(keys[-1] if keys else None)  # type: ignore[attr-defined]
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
            self.router.index.clear()  # type: ignore[attr-defined]
        self._save_index()
        return n

    def sweep(self, now: float | None = None) -> int:
        """Drop expired fragments (their index entries go with them)."""
        n = self.store.sweep(now)
        self._save_index()
        return n

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()  # type: ignore[attr-defined]
        self._save_index()
        self.store.close()

    # -- private helpers -----------------------------------------------------------------

    def _successors(self, ids: np.ndarray, exact: list[Chunk], limit: int, now: float,
                    rejections: list[str], root: str) -> tuple[list[Chunk], int] | None:
        """Extend the exact chain with a stored successor whose leading tokens match.

        Candidates are the children of the last two chain keys (a trailing fragment shorter
        than the minimum span is stored together with the chunk before it, so it hangs one
        level up). Their token ids come from the store's index; only the best is read.
        """
        children = getattr(self.store, "children", None)
        if children is None:
            return None
        c, start = self.config.chunk_size, len(exact) * self.config.chunk_size
        best: tuple[int, int, str] | None = None  # (end, k0, chain key)
        for k0 in range(max(0, len(exact) - 1), len(exact) + 1):
            parent = exact[k0 - 1].chain_key if k0 else root
            for skey, tok in children(parent):
                same = common_prefix(tok, ids[k0 * c : limit])
                end = k0 * c + same
                gain = end - max(start, best[0] if best else 0)
                if gain > 0 and (gain >= self.config.min_reuse_tokens or self.token_exact):
                    best = (end, k0, skey.split(".", 1)[0])
        if best is None:
            return None
        end, k0, key = best
        chunk = self.reader.read(key, now, rejections)
        parent = exact[k0 - 1].chain_key if k0 else root
        if (chunk is None or chunk.token_start != k0 * c or chunk.head.parent_key != parent
                or chunk.head.prefix_len(ids[k0 * c : end]) < end - k0 * c):
            return None
        return exact[:k0] + [chunk], end

    def _approximate(self, cand: str, ids: np.ndarray, limit: int, now: float,
                     rejections: list[str], root: str) -> PrefixMatch | None:
        chain = self.reader.chain_back(cand, 0, now, rejections)
        if not chain or chain[-1].token_end < 1 or chain[0].head.parent_key != root:
            return None  # broken, empty, or another tenant's chain
        n = min(chain[-1].token_end, limit)
        used = [ch for ch in chain if ch.token_start < n]
        stored_ids = np.concatenate([ch.head.token_ids for ch in used])[:n]
        mismatched = int(np.count_nonzero(stored_ids != ids[:n]))
        return PrefixMatch(n, tuple(used), approximate=mismatched > 0, mismatched_tokens=mismatched)

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
                  route: object | None = None, root: str = "") -> tuple[int, int]:
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
                frag = replace(frag, embedding=route.embedding)  # type: ignore[attr-defined]
            try:
                self.store.put(self.reader.store_key(spec.chain_key, spec.layer_start,
                                                     frag.layer_end), frag)
            except StoreError as e:  # e.g. disk full: the answer is already computed
                log.warning("could not store fragment %s (%s)", spec.chain_key[:12], e)
                return 0, 0
        if route is not None:
            deep_key = next(s.chain_key for s, f in zip(specs, frags) if f.token_end == deepest)
            self.router.index.add(deep_key, route.embedding)  # type: ignore[union-attr, attr-defined]
            self._unsaved += 1
            if self._unsaved >= INDEX_SAVE_EVERY:
                self._save_index()
        return len(frags), sum(f.nbytes for f in frags)

    def _save_index(self) -> None:
        """The index file is rewritten whole, so not after every request: every
        INDEX_SAVE_EVERY additions, on sweep, clear, compaction and close. Entries lost in a
        crash only lower approximate-mode recall until `rebuild`; strict reuse never uses it."""
        if self.router is not None:
            self.router.index.save()  # type: ignore[attr-defined]
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
            self.router.index.remove(chain)  # type: ignore[union-attr]

    def compact(self) -> object:
        from .compactor import compact

        fp = self.adapter.fingerprint
        report = compact(self.store, n_layer=fp.n_layer, n_head_kv=fp.n_head_kv)
        self._save_index()
        return report

