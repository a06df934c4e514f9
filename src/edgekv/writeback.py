"""The store side of a request: what happens after the answer, and the upkeep that keeps
the store and the semantic index in step.

New KV (the prompt's chunks past what was reused, a trailing partial chunk, the answer's
tokens) is extracted from the engine and stored in the configured layer groups; the deepest
fragment carries the request's embedding and gets an index entry. Hits extend TTLs (the seed's
promotion rule). Entries that leave the store take their index entries with them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from .config import CacheConfig
from .engines.base import FragmentSpec, KVAdapter
from .errors import EngineError, FragmentError, StoreError
from .fragment import MAX_SPAN, MIN_SPAN, next_expiry
from .keys import chain_of, next_key
from .lookup import ChunkReader, PrefixMatch, Router
from .store.disk import make_private

if TYPE_CHECKING:
    from .semantic.router import Route

__all__ = ["Writeback"]

log = logging.getLogger(__name__)


class Writeback:
    """Stores new KV for one `EdgeKV` and keeps its store, index and hit counts in step."""

    def __init__(self, adapter: KVAdapter, reader: ChunkReader, config: CacheConfig, *,
                 router: Router | None, token_exact: bool) -> None:
        self.adapter, self.reader, self.store = adapter, reader, reader.store
        self.config, self.router, self.token_exact = config, router, token_exact
        self.fingerprint = reader.fingerprint
        self._unsaved = 0  # index additions not yet written to disk
        # the cache directory holds prompts' KV and token ids: private to the user (0700)
        if config.cache_dir.is_dir():
            make_private(config.cache_dir)

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
                # the store has counted it (stats().errors) and logged the first of its kind
                log.debug("could not store fragment %s (%s)", spec.chain_key[:12], e)
                return 0, 0
        if route is not None and self.router is not None:
            deep_key = next(s.chain_key for s, f in zip(specs, frags) if f.token_end == deepest)
            self.router.index.add(deep_key, route.embedding)
            self._unsaved += 1
            if self._unsaved >= self.config.index_save_every:
                self.save_index()
        return len(frags), sum(f.nbytes for f in frags)

    def save_index(self) -> None:
        """The index file is rewritten whole, so not after every request: every
        `config.index_save_every` additions, on sweep, clear, compaction and close. Entries
        lost in a crash only lower approximate-mode recall until `rebuild`; strict reuse never
        uses it."""
        if self.router is not None:
            self.router.index.save()
        self._unsaved = 0

    def record_hits(self, match: PrefixMatch) -> None:
        cfg, now = self.config, time.time()
        for chunk in match.chunks:
            for skey, frag in zip(chunk.store_keys, chunk.fragments):
                hits = frag.hit_count + 1
                expires = next_expiry(hits, now, cfg.ttl_s, cfg.promoted_ttl_s, cfg.promote_hits)
                try:
                    self.store.touch(skey, hits, expires, now)
                except StoreError as e:  # counted and logged by the store; the hit stands
                    log.debug("could not record a hit on %s (%s)", skey[:12], e)

    def warm_chain(self, chain_key: str) -> int:
        """Bring the chunks of a chain (back to its start) into the RAM tier; return how many
        fragments were read. Used by the prefetcher's background thread."""
        n, key = 0, chain_key
        while key:
            frag = None
            for skey in self.reader.store_keys(key):
                frag = self.store.warm(skey)
                if frag is None:
                    return n
                n += 1
            key = frag.parent_key if frag is not None else ""
        return n

    def on_store_remove(self, store_key: str) -> None:
        """Keep the index free of dangling entries: drop a chunk's entry once none of its
        fragments (whole or layer groups) is left in the store."""
        chain = chain_of(store_key)
        if not any(self.store.contains(k) for k in {chain, *self.reader.store_keys(chain)}):
            if self.router is not None:
                self.router.index.remove(chain)
