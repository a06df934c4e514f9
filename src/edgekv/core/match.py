"""The reuse policy: what KV to restore for a request, as one typed `PrefixMatch`.

`PrefixMatcher.match_prefix` walks one way: the exact chain of whole chunks (read in one
batch: `FragmentStore.get_many`, one round trip to Redis, one query to disk), then (where reuse
may end at any token) a radix step into the successors of the chain's last chunks that the
prefix index knows (`prefix_index`), then (opt-in approximate mode only) the semantic router's
best candidate. The orchestrator (`cache.py`) only injects what the match names, and releases
the match's pins (`PrefixMatch.lease`) once its answer is stored.

Rules (why each exists):
- A chunk is identified by its chain key, which hashes the whole prefix; the exact chain walk is
  a dictionary walk and the cheapest path, so it always runs first.
- A semantic candidate is a stored prompt's deepest fragment. Its chain is walked back through
  `parent_key` to where the exact chain stopped; it must hang off the same parent, and then its
  tokens are compared with the request's one by one. The verified common prefix may end inside
  a fragment: the K/V of position i depend only on tokens 0..i, so the matching part is valid.
- In approximate mode (opt-in), the best candidate's KV is injected even where its tokens
  differ; the caller measures what that does to the output and never stores the result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..errors import IncompatibleFragment
from ..fragment import KVFragment
from ..keys import ModelFingerprint, StoreKey, next_key
from ..store.base import FragmentStore, Hit
from .prefix_index import Lease, PrefixIndex

if TYPE_CHECKING:
    from ..semantic.router import Route

__all__ = ["Chunk", "ChunkReader", "PrefixMatch", "PrefixMatcher", "Router"]


class Router(Protocol):
    """The semantic router as the cache uses it (`semantic.SemanticRouter`)."""

    @property
    def index(self) -> VectorIndexLike: ...

    def route(self, text: str) -> Route: ...


class VectorIndexLike(Protocol):
    def add(self, key: str, vector: np.ndarray) -> None: ...

    def remove(self, key: str) -> bool: ...

    def save(self) -> None: ...

    def clear(self) -> None: ...


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What to restore for one request, and how it was found."""

    n_tokens: int  # tokens to restore
    chunks: tuple[Chunk, ...] = ()
    exact_tokens: int = 0  # covered by the exact chain walk
    approximate: bool = False
    mismatched_tokens: int = 0  # approximate mode: restored positions whose token differs
    tier: str = "none"  # exact / partial / miss from the semantic router, "none" without one
    similarity: float = 0.0
    route_s: float = 0.0
    rejections: tuple[str, ...] = ()
    route: Route | None = field(default=None, repr=False)  # the semantic route, if computed
    token_exact: bool = False  # the engine passed the batch-invariance probe
    # pins on the matched path in the prefix index: `EdgeKV.generate` releases them after
    # the answer's KV is stored, so no eviction removes what the new chunks hang off
    lease: Lease | None = field(default=None, repr=False, compare=False)

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

    def with_route(self, route: Route) -> PrefixMatch:
        return replace(self, tier=route.tier.value, similarity=route.similarity,
                       route_s=route.embed_s + route.search_s, route=route)

    def release(self) -> None:
        """Unpin the matched path (idempotent)."""
        if self.lease is not None:
            self.lease.release()

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One token range of one chain: every layer it is needed for (one fragment, or several
    layer groups; a chunk before the last sliding window holds only the global layers)."""

    chain_key: str
    fragments: tuple[KVFragment, ...]
    store_keys: tuple[StoreKey, ...]
    tier: str  # the tier that answered (the slowest of its fragments')

    @property
    def head(self) -> KVFragment:
        return self.fragments[0]

    @property
    def token_start(self) -> int:
        return self.head.token_start

    @property
    def token_end(self) -> int:
        return self.head.token_end


class ChunkReader:
    """Reads chunks from a store and verifies what they claim to be.

    Models with sliding-window (local) layers: a reused prefix of P tokens needs the global
    layers' KV for [0, P) but the local layers' only for [P - window, P). Their chunks are
    stored in layer groups that never mix the two kinds (`local_layers`), and the chain walk
    reads the local groups only of the chunks inside the last window: the rest of the bytes
    stay on disk.
    """

    def __init__(self, store: FragmentStore, fingerprint: str, n_layer: int,
                 layer_groups: Sequence[tuple[int, int]], *,
                 local_layers: Sequence[int] = (), window: int = 0) -> None:
        self.store, self.fingerprint, self.n_layer = store, fingerprint, n_layer
        self.layer_groups = list(layer_groups)
        self.window = window if local_layers else 0
        local = set(local_layers)
        self.local_groups = [(lo, hi) for lo, hi in self.layer_groups if lo in local]
        self.global_groups = [g for g in self.layer_groups if g not in self.local_groups]

    @classmethod
    def for_model(cls, store: FragmentStore, fp: ModelFingerprint,
                  layers_per_fragment: int = 0, *, local_layers: Sequence[int] = (),
                  window: int = 0) -> ChunkReader:
        """A reader of `fp`'s chunks stored in groups of `layers_per_fragment` layers (0: all
        layers in one fragment, see `CacheConfig.layers_per_fragment`), each group split where
        layers change between global and sliding-window (`local_layers`, of `window` tokens)."""
        step = layers_per_fragment or fp.n_layer
        local = set(local_layers)
        groups = []
        for lo in range(0, fp.n_layer, step):
            hi = min(fp.n_layer, lo + step)
            start = lo
            for i in range(lo + 1, hi + 1):
                if i == hi or (i in local) != (start in local):
                    groups.append((start, i))
                    start = i
        return cls(store, fp.digest, fp.n_layer, groups, local_layers=local_layers,
                   window=window)

    def key(self, chain_key: str, lo: int, hi: int) -> StoreKey:
        return StoreKey.of(chain_key, (lo, hi), self.n_layer)

    def store_key(self, chain_key: str, lo: int, hi: int) -> str:
        """The name of layers [lo, hi) of the chunk in a tier (`StoreKey.name`)."""
        return self.key(chain_key, lo, hi).name

    def store_keys(self, chain_key: str) -> list[str]:
        return [self.store_key(chain_key, lo, hi) for lo, hi in self.layer_groups]

    def layouts(self, chain_key: str) -> list[tuple[str, ...]]:
        """The ways a chunk is stored: the whole-layer fragment, or the configured groups."""
        groups = tuple(self.store_keys(chain_key))
        return [(chain_key,)] if groups == (chain_key,) else [(chain_key,), groups]

    def contains(self, chain_key: str) -> bool:
        """Whether every layer of the chunk is stored (whole, or in the configured groups);
        read without verifying (`read` verifies)."""
        return self.store.contains(chain_key) or all(
            self.store.contains(k) for k in self.store_keys(chain_key))

    def read(self, chain_key: str, now: float, rejections: list[str],
             groups: Sequence[tuple[int, int]] | None = None) -> Chunk | None:
        """The chunk stored under `chain_key`: the whole-layer fragment if present (e.g. after
        compaction), else the configured layer groups (or only `groups` of them), each layout
        in one batch; None if anything is missing or wrong."""
        layouts = [[(0, self.n_layer)]]
        wanted = self.layer_groups if groups is None else list(groups)
        if wanted != [(0, self.n_layer)]:
            layouts.append(wanted)
        for layout in layouts:
            keys = [self.key(chain_key, lo, hi) for lo, hi in layout]
            hits = self.store.get_many([k.name for k in keys], now, prefix=True)
            if all(h is not None for h in hits):
                return self._chunk(chain_key, keys, hits, rejections)
        return None

    def walk(self, keys: Sequence[str], now: float, rejections: list[str]) -> list[Chunk]:
        """The exact chain walk: verified chunks under `keys`, from the first until one is
        missing or refused, read in one batch (a chunk stored otherwise than in the
        configured groups, e.g. compacted, and those after it are read one by one)."""
        groups = self.global_groups if self.window else self.layer_groups
        per_chunk = [[self.key(k, lo, hi) for lo, hi in groups] for k in keys]
        hits = self.store.get_many([k.name for ks in per_chunk for k in ks], now, prefix=True)
        chunks: list[Chunk] = []
        at = 0
        for i, (key, skeys) in enumerate(zip(keys, per_chunk)):
            part, at = hits[at : at + len(skeys)], at + len(skeys)
            if all(h is not None for h in part):
                chunk = self._chunk(key, skeys, part, rejections)
            elif groups == [(0, self.n_layer)]:
                break  # the only layout there is: missing
            else:
                chunk = None
                for k in keys[i:]:
                    chunk = self.read(k, now, rejections, groups if self.window else None)
                    if chunk is None:
                        break
                    chunks.append(chunk)
                break
            if chunk is None:
                break
            chunks.append(chunk)
        return self._with_window(chunks, now, rejections) if self.window else chunks

    def _chunk(self, chain_key: str, keys: Sequence[StoreKey], hits: Sequence[Hit | None],
               rejections: list[str]) -> Chunk | None:
        """The chunk of verified `hits` (read under `keys`); None if one is refused."""
        frags: list[KVFragment] = []
        for key, frag in zip(keys, [h.fragment for h in hits if h is not None]):
            lo, hi = key.layers or (0, self.n_layer)
            try:
                self.verify(frag, chain_key, lo, hi, frags[0] if frags else None)
            except IncompatibleFragment as e:
                log.warning("rejected cached fragment %s: %s", key.name, e)
                rejections.append(f"{key.name[:16]}: {e}")
                return None
            frags.append(frag)
        tier = hits[-1].tier if hits and hits[-1] is not None else "store"
        return Chunk(chain_key, tuple(frags), tuple(keys), tier)

    def _with_window(self, chunks: list[Chunk], now: float,
                     rejections: list[str]) -> list[Chunk]:
        """Add the local layer groups to the chunks that overlap the last `window` tokens;
        where one is missing, the chain ends before that chunk (and its window moves back)."""
        while chunks:
            end, out, missing = chunks[-1].token_end, list(chunks), None
            for i in range(len(chunks) - 1, -1, -1):
                if chunks[i].token_end <= end - self.window:
                    break
                full = self._add_local(chunks[i], now, rejections)
                if full is None:
                    missing = i
                    break
                out[i] = full
            if missing is None:
                return out
            chunks = chunks[:missing]
        return []

    def _add_local(self, chunk: Chunk, now: float, rejections: list[str]) -> Chunk | None:
        if (chunk.head.layer_start, chunk.head.layer_end) == (0, self.n_layer):
            return chunk  # a whole-layer fragment already holds them
        local = self.read(chunk.chain_key, now, rejections, self.local_groups)
        if local is None:
            return None
        try:
            for frag in local.fragments:
                self.verify(frag, chunk.chain_key, frag.layer_start, frag.layer_end, chunk.head)
        except IncompatibleFragment as e:
            rejections.append(f"{chunk.chain_key[:16]}: {e}")
            return None
        return replace(chunk, fragments=chunk.fragments + local.fragments,
                       store_keys=chunk.store_keys + local.store_keys)

    def verify(self, frag: KVFragment, chain_key: str, lo: int, hi: int,
                first: KVFragment | None) -> None:
        if frag.model_fingerprint != self.fingerprint:
            raise IncompatibleFragment(f"made by another model ({frag.model_fingerprint[:12]}, "
                                       f"this is {self.fingerprint[:12]})")
        if frag.chain_key != chain_key:
            raise IncompatibleFragment("its chain key does not match the key it is stored under")
        if next_key(frag.parent_key, self.fingerprint, frag.token_ids) != chain_key:
            raise IncompatibleFragment("its token ids and parent do not hash to its chain key")
        layers = (frag.layer_start, frag.layer_end, frag.layer_stride)
        if layers != (lo, hi, 1) or not frag.all_heads:
            raise IncompatibleFragment(
                f"holds layers [{frag.layer_start}, {frag.layer_end}) stride {frag.layer_stride}, "
                f"needed [{lo}, {hi}) stride 1 with all heads")
        if first is not None and (
                (frag.token_start, frag.token_end) != (first.token_start, first.token_end)
                or frag.parent_key != first.parent_key
                or not np.array_equal(frag.token_ids, first.token_ids)):
            raise IncompatibleFragment("its layer groups disagree on tokens or parent")

    def chain_back(self, chain_key: str, stop_at: int, now: float,
                   rejections: list[str], max_steps: int = 4096) -> list[Chunk] | None:
        """Chunks of the chain ending at `chain_key`, from the one holding position `stop_at`
        (token_start <= stop_at) to the end, following parent keys; None if broken or if the
        chain ends before `stop_at`."""
        out: list[Chunk] = []
        key = chain_key
        for _ in range(max_steps):
            chunk = self.read(key, now, rejections)
            if chunk is None:
                return None
            if out and chunk.token_end != out[-1].token_start:
                rejections.append(f"{key[:16]}: chain is not contiguous")
                return None
            out.append(chunk)
            if chunk.token_start <= stop_at:
                return out[::-1] if out[0].token_end > stop_at else None
            if not chunk.head.parent_key:
                return None
            key = chunk.head.parent_key
        return None


class PrefixMatcher:
    """The reuse policy over one store and its prefix index: `match_prefix` returns what to
    restore, its path pinned in the index.

    `token_exact` (the engine passed the batch-invariance probe) lets reuse end at any token;
    otherwise only whole chunks are strict, and the radix step runs only with `partial_reuse`
    or in approximate mode (neither stored nor claimed exact then).
    """

    def __init__(self, reader: ChunkReader, index: PrefixIndex, chunk_size: int, *,
                 token_exact: bool, partial_reuse: bool, min_reuse_tokens: int,
                 router: Router | None) -> None:
        self.reader, self.index, self.chunk_size = reader, index, chunk_size
        self.token_exact = token_exact
        self.partial_reuse, self.min_reuse_tokens = partial_reuse, min_reuse_tokens
        self.router = router

    def match_prefix(self, tokens: Sequence[int], keys: Sequence[str], root: str, *,
                     text: str | None = None, approximate: bool = False,
                     now: float | None = None, whole_chunks: bool = False) -> PrefixMatch:
        """What to restore for `tokens` (whose chunk keys under the tenant `root` are `keys`):
        at most len(tokens) - 1 positions, so the first output token is always computed.
        `whole_chunks`: the exact chain walk only (what a fill step continues from).

        Any KV valid for this request hangs off its own chain, so semantic search cannot find
        more than the chain walk and the radix step; it is needed before the first token only
        in approximate mode (`text` is then embedded).
        """
        now = time.time() if now is None else now
        c, ids, limit = self.chunk_size, np.asarray(tokens, np.int32), len(tokens) - 1
        rejections: list[str] = []
        chunks = self.reader.walk(keys[: limit // c], now, rejections)
        self._saw(chunks, now)
        n = len(chunks) * c
        best = PrefixMatch(n, tuple(chunks), n, token_exact=self.token_exact)
        if whole_chunks:
            return self._pinned(replace(best, rejections=tuple(rejections)))
        if self.partial_reuse or approximate or self.token_exact:
            ext = self._successors(ids, chunks, limit, now, rejections, root)
            if ext is not None:
                best = replace(best, n_tokens=ext[1], chunks=tuple(ext[0]))
        if approximate and self.router is not None and text is not None:
            route = self.router.route(text)
            best = best.with_route(route)
            if route.tier.value != "miss" and route.candidates:
                approx = self._approximate(route.candidates[0][0], ids, limit, now,
                                           rejections, root)
                if approx is not None and approx.n_tokens > best.n_tokens:
                    best = replace(approx, exact_tokens=n, token_exact=self.token_exact
                                   ).with_route(route)
        return self._pinned(replace(best, rejections=tuple(rejections)))

    # -- private helpers -----------------------------------------------------------------

    def _pinned(self, match: PrefixMatch) -> PrefixMatch:
        return replace(match, lease=self.index.pin(c.chain_key for c in match.chunks))

    def _saw(self, chunks: Sequence[Chunk], now: float) -> None:
        """Tell the index what was read and from where (its last access, its tiers)."""
        for ch in chunks:
            names = tuple(k.name for k in ch.store_keys)
            if ch.head.layer_end - ch.head.layer_start != self.reader.n_layer:
                names = tuple(self.reader.store_keys(ch.chain_key))  # every configured group
            self.index.saw(ch.chain_key, ch.head.parent_key, ch.token_start,
                           ch.head.token_ids, names, sum(f.nbytes for f in ch.fragments),
                           ch.tier, now)

    def _successors(self, ids: np.ndarray, exact: list[Chunk], limit: int, now: float,
                    rejections: list[str], root: str) -> tuple[list[Chunk], int] | None:
        """Extend the exact chain with a stored successor whose leading tokens match.

        The prefix index names the candidate (`PrefixIndex.successor`: tokens compared in
        memory); only the best is read. Where reuse may end at any token, any gain is taken
        (a token costs more to compute than to read); elsewhere at least `min_reuse_tokens`.
        """
        c = self.chunk_size
        best = self.index.successor(root, [ch.chain_key for ch in exact], ids, limit, c,
                                    1 if self.token_exact else self.min_reuse_tokens)
        if best is None:
            return None
        k0, end = best.k0, best.end
        chunk = self.reader.read(best.key, now, rejections)
        parent = exact[k0 - 1].chain_key if k0 else root
        if chunk is None:
            self.index.missed(best.key)
            return None
        if (chunk.token_start != k0 * c or chunk.head.parent_key != parent
                or chunk.head.prefix_len(ids[k0 * c : end]) < end - k0 * c):
            return None
        self._saw([chunk], now)
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
        return PrefixMatch(n, tuple(used), approximate=mismatched > 0,
                           mismatched_tokens=mismatched)
