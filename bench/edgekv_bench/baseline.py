"""The naive baseline a user would write first: exact prompt text -> stored response.

It skips the model entirely on an exact repeat and does nothing for anything else; the
benchmarks compare EdgeKV against it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["StringCache"]


@dataclass(frozen=True, slots=True)
class CachedResponse:
    text: str
    tokens: tuple[int, ...]


class StringCache:
    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.capacity = capacity
        self._items: OrderedDict[str, CachedResponse] = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def key(prompt: str, **params: object) -> str:
        tail = repr(sorted(params.items())).encode()
        return hashlib.sha256(prompt.encode() + b"\0" + tail).hexdigest()

    def get(self, prompt: str, **params: object) -> CachedResponse | None:
        k = self.key(prompt, **params)
        hit = self._items.get(k)
        if hit is None:
            self.misses += 1
            return None
        self._items.move_to_end(k)
        self.hits += 1
        return hit

    def put(self, prompt: str, text: str, tokens: tuple[int, ...], **params: object) -> None:
        k = self.key(prompt, **params)
        self._items[k] = CachedResponse(text, tuple(tokens))
        self._items.move_to_end(k)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0
