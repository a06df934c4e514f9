"""Finding reusable KV for a request: the exact chain first, then verified semantic candidates.

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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import IncompatibleFragment
from .fragment import KVFragment
from .keys import next_key
from .store.base import FragmentStore

__all__ = ["Chunk", "ChunkReader"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One token range of one chain, all layers (one fragment or several layer groups)."""

    chain_key: str
    fragments: tuple[KVFragment, ...]
    store_keys: tuple[str, ...]
    tier: str

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
    """Reads whole chunks (every layer) from a store and verifies what they claim to be."""

    def __init__(self, store: FragmentStore, fingerprint: str, n_layer: int,
                 layer_groups: Sequence[tuple[int, int]]) -> None:
        self.store, self.fingerprint, self.n_layer = store, fingerprint, n_layer
        self.layer_groups = list(layer_groups)

    def store_key(self, chain_key: str, lo: int, hi: int) -> str:
        return chain_key if (lo, hi) == (0, self.n_layer) else f"{chain_key}.L{lo}-{hi}"

    def store_keys(self, chain_key: str) -> list[str]:
        return [self.store_key(chain_key, lo, hi) for lo, hi in self.layer_groups]

    def read(self, chain_key: str, now: float, rejections: list[str]) -> Chunk | None:
        """The chunk stored under `chain_key`: the whole-layer fragment if present (e.g. after
        compaction), else the configured layer groups; None if anything is missing or wrong."""
        layouts = [[(0, self.n_layer)]]
        if self.layer_groups != [(0, self.n_layer)]:
            layouts.append(self.layer_groups)
        for groups in layouts:
            frags, keys, tier = [], [], "store"
            for lo, hi in groups:
                key = self.store_key(chain_key, lo, hi)
                frag = self.store.get(key, now)
                if frag is None:
                    break
                try:
                    self.verify(frag, chain_key, lo, hi, frags[0] if frags else None)
                except IncompatibleFragment as e:
                    log.warning("rejected cached fragment %s: %s", key, e)
                    rejections.append(f"{key[:16]}: {e}")
                    return None
                frags.append(frag)
                keys.append(key)
                tier = getattr(self.store, "last_tier", None) or tier
            else:
                return Chunk(chain_key, tuple(frags), tuple(keys), tier)
        return None

    def verify(self, frag: KVFragment, chain_key: str, lo: int, hi: int,
                first: KVFragment | None) -> None:
        if frag.model_fingerprint != self.fingerprint:
            raise IncompatibleFragment(f"made by another model ({frag.model_fingerprint[:12]}, "
                                       f"this is {self.fingerprint[:12]})")
        if frag.chain_key != chain_key:
            raise IncompatibleFragment("its chain key does not match the key it is stored under")
        if next_key(frag.parent_key, self.fingerprint, frag.token_ids) != chain_key:
            raise IncompatibleFragment("its token ids and parent do not hash to its chain key")
        if (frag.layer_start, frag.layer_end, frag.layer_stride) != (lo, hi, 1) or not frag.all_heads:
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
