"""The store side of a request: what happens after the answer, and the upkeep that keeps
the store and the semantic index in step.

New KV (the prompt's chunks past what was reused, a trailing partial chunk, the answer's
tokens) is extracted from the engine, stored in the configured layer groups in one batch
(`FragmentStore.put_many`) and inserted into the prefix index (`PrefixIndex.insert`); the
deepest fragment carries the request's embedding and gets a semantic index entry. Hits extend
TTLs (the seed's promotion rule), in one batch. Entries that leave the store take their
semantic index entries with them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ..config import CacheConfig
from ..engines.base import FragmentSpec, KVAdapter
from ..errors import EngineError, FragmentError, StoreError
from ..fragment import KVFragment, next_expiry
from ..keys import chain_of, next_key
from ..store.disk import make_private
from .match import ChunkReader, PrefixMatch, Router
from .prefix_index import PrefixIndex

if TYPE_CHECKING:
    from ..semantic.router import Route

__all__ = ["Writeback"]

log = logging.getLogger(__name__)


class Writeback:
    """Stores new KV for one `EdgeKV` and keeps its store, index and hit counts in step."""

    def __init__(self, adapter: KVAdapter, reader: ChunkReader, index: PrefixIndex,
                 config: CacheConfig, *, router: Router | None, token_exact: bool) -> None:
        self.adapter, self.reader, self.store, self.index = adapter, reader, reader.store, index
        self.config, self.router, self.token_exact = config, router, token_exact
        self.fingerprint = reader.fingerprint
        self._unsaved = 0  # index additions not yet written to disk
        # the cache directory holds prompts' KV and token ids: private to the user (0700)
        if config.cache_dir.is_dir():
            make_private(config.cache_dir)

    def store_new(self, tokens: Sequence[int], cached: int, keys: Sequence[str],
                  route: Route | None = None, root: str = "", *,
                  engine: KVAdapter | None = None) -> tuple[int, int]:
        """Store the chunks of `tokens` from `cached` on (the engine holds their KV: `engine`,
        a server's slot, else the adapter); the deepest gets the route's embedding and an
        index entry. Returns (fragments, bytes)."""
        spans = self._spans(tokens, cached, keys, root)
        specs = [FragmentSpec(key, lo, hi, glo, ghi, parent_key=parent)
                 for key, parent, lo, hi in spans
                 for glo, ghi in self.reader.layer_groups
                 if not self.store.contains(self.reader.store_key(key, glo, ghi))]
        now = time.time()
        if not specs:
            self._insert(tokens, spans, [], now)
            return 0, 0
        try:
            frags = (engine or self.adapter).extract_fragments(specs)
        except (EngineError, FragmentError) as e:
            log.warning("could not extract KV for caching (%s); nothing stored", e)
            return 0, 0
        deepest = max(f.token_end for f in frags)
        items: list[tuple[str, KVFragment]] = []
        for spec, frag in zip(specs, frags):
            frag = frag.stamped(now, self.config.ttl_s)
            if route is not None and frag.token_end == deepest:
                frag = replace(frag, embedding=route.embedding)
            items.append((self.reader.store_key(spec.chain_key, spec.layer_start,
                                                frag.layer_end), frag))
        try:
            self.store.put_many(items)
        except StoreError as e:  # e.g. disk full: the answer is already computed
            # the store has counted it (stats().errors) and logged the first of its kind
            log.debug("could not store fragments from %s on (%s)", specs[0].chain_key[:12], e)
            return 0, 0
        finally:
            self._insert(tokens, spans, items, now)
        if route is not None:
            self._index_route(route, specs, frags, deepest)
        return len(frags), sum(f.nbytes for f in frags)

    def _spans(self, tokens: Sequence[int], cached: int, keys: Sequence[str],
               root: str) -> list[tuple[str, str, int, int]]:
        """(chain key, parent, start, end) of what to store: the full chunks past `cached`,
        and the tail after the last one where it is worth a fragment of its own."""
        c = self.config.chunk_size
        spans: list[tuple[str, str, int, int]] = []
        for i, key in enumerate(keys):
            if (i + 1) * c > cached:
                spans.append((key, keys[i - 1] if i else root, i * c, (i + 1) * c))
        start, tail = len(keys) * c, len(tokens) - len(keys) * c
        # the tokens after the last full chunk hang off it on their own: however few where
        # reuse may end at any token or a router finds them by meaning; with whole-chunk reuse
        # cut short (`partial_reuse`) only as many as the radix step takes (`min_reuse_tokens`).
        # Not where a stored tail from the same start holds them already (the same request
        # with fewer tokens to generate); the next turn's longer tail or full chunk supersedes
        # this one (`PrefixIndex.insert`)
        any_length = self.token_exact or self.router is not None
        if tail and (any_length or (self.config.partial_reuse
                                    and tail >= self.config.min_reuse_tokens)):
            parent = keys[-1] if keys else root
            if not self.index.covers(parent, start, tokens[start:]):
                spans.append((next_key(parent, self.fingerprint, tokens[start:]), parent,
                              start, len(tokens)))
        return spans

    def _index_route(self, route: Route, specs: Sequence[FragmentSpec],
                     frags: Sequence[KVFragment], deepest: int) -> None:
        """The semantic index entry of the deepest fragment, once it is stored (not refused
        for want of room)."""
        deep = next((s, f) for s, f in zip(specs, frags) if f.token_end == deepest)
        if self.router is not None and self.store.contains(
                self.reader.store_key(deep[0].chain_key, deep[0].layer_start,
                                      deep[1].layer_end)):
            self.router.index.add(deep[0].chain_key, route.embedding)
            self._unsaved += 1
            if self._unsaved >= self.config.index_save_every:
                self.save_index()

    def _insert(self, tokens: Sequence[int], spans: Sequence[tuple[str, str, int, int]],
                items: Sequence[tuple[str, KVFragment]], now: float) -> None:
        """Tell the prefix index about the chunks of this request past its match, stored now
        or already (it asks the tiers which hold each), parents first."""
        sizes = {name: frag.nbytes for name, frag in items}
        per_token = self.adapter.fingerprint.kv_bytes_per_token
        for key, parent, start, end in spans:
            names = self.reader.store_keys(key)
            nbytes = (sum(sizes.get(n, 0) for n in names) or self.index.nbytes(key)
                      or per_token * (end - start))  # stored earlier: what was recorded
            self.index.insert(key, parent, start, np.asarray(tokens[start:end], np.int32),
                              names, nbytes, now)

    def save_index(self) -> None:
        """The index file is rewritten whole, so not after every request: every
        `config.index_save_every` additions, on sweep, clear, compaction and close. Entries
        lost in a crash only lower approximate-mode recall until `rebuild`; strict reuse never
        uses it."""
        if self.router is not None:
            self.router.index.save()
        self._unsaved = 0

    def record_hits(self, match: PrefixMatch) -> None:
        """New hit counts and expiries of the matched fragments, in one batch."""
        cfg, now = self.config, time.time()
        items: list[tuple[str, int, float]] = []
        for chunk in match.chunks:
            for skey, frag in zip(chunk.store_keys, chunk.fragments):
                hits = frag.hit_count + 1
                expires = next_expiry(hits, now, cfg.ttl_s, cfg.promoted_ttl_s, cfg.promote_hits)
                items.append((skey.name, hits, expires))
        if not items:
            return
        try:
            self.store.touch_many(items, now)
        except StoreError as e:  # counted and logged by the store; the hit stands
            log.debug("could not record hits from %s on (%s)", items[0][0][:12], e)

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
