"""Compaction (the seed's `cache/compactor.go`), made sound.

- Deduplicate: the seed dedups by ContentHash (the hash of a fragment's own token ids). Two
  fragments with equal token ids but different prefixes hold *different* KV (attention saw
  different earlier tokens), so they are not duplicates. EdgeKV dedups entries that are equal
  in content hash, chain key (whole prefix), token range, layers and heads; same-ContentHash
  groups with different prefixes are counted and kept.
- Merge: fragments of the same chunk (same chain key and tokens) with adjacent layer ranges are
  concatenated along the layer axis; with adjacent KV-head ranges, along the head axis. A chunk
  whose parts together cover every layer and head becomes one whole fragment under the chunk's
  plain key, which every reader tries first.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import FragmentError
from ..fragment import KVFragment
from .base import FragmentStore

__all__ = ["CompactionReport", "compact", "merge_heads", "merge_layers"]

log = logging.getLogger(__name__)


def _same_chunk(frags: Sequence[KVFragment]) -> None:
    a = frags[0]
    for b in frags[1:]:
        if (b.chain_key, b.model_fingerprint, b.token_start, b.token_end) != (
                a.chain_key, a.model_fingerprint, a.token_start, a.token_end) \
                or not np.array_equal(a.token_ids, b.token_ids):
            raise FragmentError(
                "merge needs fragments of one chunk (same model, chain key, tokens)")


def merge_layers(frags: Sequence[KVFragment]) -> KVFragment:
    """Concatenate fragments with adjacent dense layer ranges along the layer axis."""
    if not frags:
        raise FragmentError("merge_layers needs at least one fragment")
    _same_chunk(frags)
    parts = sorted(frags, key=lambda f: f.layer_start)
    for a, b in zip(parts, parts[1:]):
        if not (a.is_dense and b.is_dense) or a.layer_end != b.layer_start:
            raise FragmentError(f"layer ranges [{a.layer_start},{a.layer_end}) and "
                                f"[{b.layer_start},{b.layer_end}) are not adjacent dense ranges")
        if (a.head_start, a.head_end) != (b.head_start, b.head_end):
            raise FragmentError("layer merge needs equal head ranges")
    first = parts[0]
    return dataclasses.replace(
        first, layer_start=first.layer_start, layer_end=parts[-1].layer_end,
        keys=np.concatenate([f.keys for f in parts], axis=0),
        values=np.concatenate([f.values for f in parts], axis=0),
        hit_count=max(f.hit_count for f in parts), expires_at=max(f.expires_at for f in parts))


def merge_heads(frags: Sequence[KVFragment], n_head_kv: int) -> KVFragment:
    """Concatenate fragments with adjacent KV-head ranges along the head (width) axis."""
    if not frags:
        raise FragmentError("merge_heads needs at least one fragment")
    _same_chunk(frags)
    parts = sorted(frags, key=lambda f: f.head_start)
    for a, b in zip(parts, parts[1:]):
        if a.head_end == 0 or a.head_end != b.head_start:
            raise FragmentError(f"head ranges [{a.head_start},{a.head_end}) and "
                                f"[{b.head_start},{b.head_end}) are not adjacent")
        if (a.layer_start, a.layer_end, a.layer_stride) != (
                b.layer_start, b.layer_end, b.layer_stride):
            raise FragmentError("head merge needs equal layer ranges")
    lo, hi = parts[0].head_start, parts[-1].head_end
    whole = lo == 0 and hi == n_head_kv
    return dataclasses.replace(
        parts[0], head_start=0 if whole else lo, head_end=0 if whole else hi,
        keys=np.concatenate([f.keys for f in parts], axis=2),
        values=np.concatenate([f.values for f in parts], axis=2),
        hit_count=max(f.hit_count for f in parts), expires_at=max(f.expires_at for f in parts))


@dataclass(frozen=True, slots=True)
class CompactionReport:
    scanned: int
    duplicates_removed: int
    chunks_merged: int
    fragments_merged: int
    same_tokens_other_prefix: int  # seed would have deduplicated these: different KV, kept


def compact(store: FragmentStore, *, n_layer: int, n_head_kv: int) -> CompactionReport:
    """Dedup and merge what `store` holds (everything its `keys()` lists)."""
    keys = list(store.keys())
    frags: dict[str, KVFragment] = {}
    for k in keys:
        f = store.get(k)
        if f is not None:
            frags[k] = f
    dupes = 0
    seen: dict[tuple[object, ...], str] = {}
    for k, f in sorted(frags.items()):
        ident = (f.model_fingerprint, f.chain_key, f.content_hash, f.token_start, f.token_end,
                 f.layer_start, f.layer_end, f.layer_stride, f.head_start, f.head_end)
        if ident in seen:
            store.delete(k)
            dupes += 1
        else:
            seen[ident] = k
    live = {k: frags[k] for k in seen.values()}
    by_hash: defaultdict[str, set[str]] = defaultdict(set)
    by_chunk: defaultdict[str, list[tuple[str, KVFragment]]] = defaultdict(list)
    for k, f in live.items():
        by_hash[f.content_hash].add(f.chain_key)
        by_chunk[f.chain_key].append((k, f))
    merged_chunks = merged_frags = 0
    for chain_key, items in by_chunk.items():
        if any(k == chain_key for k, _ in items) or len(items) < 2:
            continue  # already whole, or nothing to merge
        try:
            whole = _merge_chunk([f for _, f in items], n_layer, n_head_kv)
        except FragmentError as e:
            log.info("chunk %s not merged: %s", chain_key[:12], e)
            continue
        store.put(chain_key, whole)
        for k, _ in items:
            store.delete(k)
        merged_chunks += 1
        merged_frags += len(items)
    other_prefix = sum(len(v) - 1 for v in by_hash.values() if len(v) > 1)
    return CompactionReport(len(frags), dupes, merged_chunks, merged_frags, other_prefix)


def _merge_chunk(frags: list[KVFragment], n_layer: int, n_head_kv: int) -> KVFragment:
    by_layers: defaultdict[tuple[int, int], list[KVFragment]] = defaultdict(list)
    for f in frags:
        by_layers[(f.layer_start, f.layer_end)].append(f)
    layer_parts = [g[0] if len(g) == 1 and g[0].all_heads else merge_heads(g, n_head_kv)
                   for _, g in sorted(by_layers.items())]
    whole = merge_layers(layer_parts)
    if (whole.layer_start, whole.layer_end) != (0, n_layer) or not whole.all_heads:
        raise FragmentError("parts do not cover every layer and head")
    return whole
