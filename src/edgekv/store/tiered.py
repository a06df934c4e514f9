"""RAM in front of disk: reads fall through and promote, writes go to both."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..errors import StoreError
from ..fragment import KVFragment
from .base import FragmentStore, Hit, StoreStats

__all__ = ["TieredStore"]


class TieredStore(FragmentStore):
    name = "tiered"

    def __init__(self, *tiers: FragmentStore) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers = tiers

    def tier_list(self) -> tuple[FragmentStore, ...]:
        return tuple(t for tier in self.tiers for t in tier.tier_list())

    def get(self, key: str, now: float | None = None) -> KVFragment | None:
        hit = self.get_many([key], now)[0]
        return None if hit is None else hit.fragment

    def get_many(self, keys: Sequence[str], now: float | None = None, *,
                 prefix: bool = False) -> list[Hit | None]:
        """Each key from the fastest tier that holds it, promoted into the faster ones.
        The upper tiers (RAM) are asked per key, the last (disk, Redis) once for all that
        they lack; with `prefix`, it stops at its first miss, and so does the walk."""
        *upper, last = self.tiers
        where = [next((j for j, t in enumerate(upper) if t.contains(k)), None) for k in keys]
        lower = [k for k, j in zip(keys, where) if j is None]
        from_last = iter(last.get_many(lower, now, prefix=prefix) if lower else [])
        out: list[Hit | None] = []
        for key, j in zip(keys, where):
            hit = None
            if j is not None:
                frag = upper[j].get(key, now)
                hit = None if frag is None else Hit(frag, upper[j].name)
                if hit is None:  # evicted or expired since: the last tier may hold it
                    frag = last.get(key, now)
                    hit, j = (None, None) if frag is None else (Hit(frag, last.name), None)
            else:
                hit = next(from_last)
            if hit is not None:
                for faster in upper[: len(upper) if j is None else j]:
                    faster.put(key, hit.fragment)
            elif prefix:
                out += [None] * (len(keys) - len(out))
                break
            out.append(hit)
        return out

    def add_remove_listener(self, fn: Callable[[str], None]) -> None:
        """Listen to every tier: the listener asks `contains`, which checks them all, so an
        entry counts as gone only once no tier holds it."""
        for tier in self.tiers:
            tier.add_remove_listener(fn)

    def children(self, parent: str) -> list[tuple[str, np.ndarray]]:
        """Union over tiers of the entries that follow `parent` (key, token ids)."""
        seen: dict[str, np.ndarray] = {}
        for tier in self.tiers:
            for key, ids in tier.children(parent):
                seen.setdefault(key, ids)
        return list(seen.items())

    def keys(self) -> list[str]:
        return list(self.tiers[-1].keys())

    def persistent_tier(self) -> FragmentStore:
        return self.tiers[-1].persistent_tier()

    def warm(self, key: str) -> KVFragment | None:
        """Copy `key` into the upper tiers if it is only lower down (prefetch); no stats."""
        for i, tier in enumerate(self.tiers):
            if tier.contains(key):
                if i == 0:
                    return tier.get(key)
                frag = tier.get(key)
                if frag is not None:
                    for upper in self.tiers[:i]:
                        upper.put(key, frag)
                return frag
        return None

    def put(self, key: str, fragment: KVFragment) -> None:
        self.put_many([(key, fragment)])

    def put_many(self, items: Sequence[tuple[str, KVFragment]]) -> None:
        for tier in self.tiers:
            tier.put_many(items)

    def touch(self, key: str, hit_count: int, expires_at: float, now: float | None = None) -> None:
        self.touch_many([(key, hit_count, expires_at)], now)

    def touch_many(self, items: Sequence[tuple[str, int, float]],
                   now: float | None = None) -> None:
        for tier in self.tiers:
            tier.touch_many(items, now)

    def contains(self, key: str) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def delete(self, key: str) -> bool:
        return any([t.delete(key) for t in self.tiers])

    def sweep(self, now: float | None = None) -> int:
        return sum(t.sweep(now) for t in self.tiers)

    def clear(self) -> int:
        return max(t.clear() for t in self.tiers)

    def stats(self) -> StoreStats:
        """Stats of the last (largest, persistent) tier; see `tier_stats` for each."""
        return self.tiers[-1].stats()

    def clear_tier(self, name: str) -> int:
        """Empty the tier called `name` (e.g. "ram": the next reads come from disk, as in a
        fresh process); return how many entries it held."""
        for t in self.tiers:
            if t.name == name:
                return t.clear()
        raise StoreError(f"no tier named {name!r}; this store has "
                         f"{', '.join(t.name for t in self.tiers)}")

    def tier_stats(self) -> list[StoreStats]:
        return [t.stats() for t in self.tiers]

    def close(self) -> None:
        for t in self.tiers:
            t.close()
