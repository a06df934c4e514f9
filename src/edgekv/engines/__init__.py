"""Engine adapters behind the `KVAdapter` protocol (heavy engines import lazily)."""

from __future__ import annotations

from .base import FragmentSpec, Generation, KVAdapter, aligned_batches, check_injectable
from .fake import FakeAdapter

__all__ = ["FakeAdapter", "FragmentSpec", "Generation", "KVAdapter", "aligned_batches",
           "check_injectable"]
