"""The modes the seed benchmark compares, each answering one request the same way:
`run(text, tokens, max_tokens) -> Outcome`. Engines are shared where that is fair (modes that
clear the context on every request share one); the llama-cpp-python peer gets its own `Llama`
so that its in-context prefix reuse between consecutive requests survives, as in real use."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..baseline import StringCache
from ..cache import EdgeKV
from ..engines.base import EngineCounters

__all__ = ["EdgeKVMode", "LlamaRAMCacheMode", "NoCacheMode", "Outcome", "StringMode"]


@dataclass(frozen=True, slots=True)
class Outcome:
    ttft_s: float
    reused: int
    computed: int
    text: str
    hit: bool
    traffic_bytes: int  # prefill up to the first token + KV the cache reads and writes
    tier: str = "none"
    approximate: bool = False


class NoCacheMode:
    name = "nocache"

    def __init__(self, kv: EdgeKV, min_reuse: int) -> None:
        self.kv = kv

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        r = self.kv.generate(tokens, max_tokens=max_tokens, use_cache=False)
        return Outcome(r.ttft_s, 0, r.computed_tokens, r.text, False, r.prefill_traffic_bytes)


class StringMode:
    name = "string"

    def __init__(self, kv: EdgeKV, min_reuse: int) -> None:
        self.kv, self.cache = kv, StringCache()

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        t0 = time.perf_counter()
        hit = self.cache.get(text, max_tokens=max_tokens)
        if hit is not None:
            return Outcome(time.perf_counter() - t0, len(tokens), 0, hit.text, True, 0)
        r = self.kv.generate(tokens, max_tokens=max_tokens, use_cache=False)
        self.cache.put(text, r.text, r.tokens, max_tokens=max_tokens)
        return Outcome(time.perf_counter() - t0 - (r.total_s - r.ttft_s), 0, r.computed_tokens,
                       r.text, False, r.prefill_traffic_bytes)


class EdgeKVMode:
    def __init__(self, kv: EdgeKV, min_reuse: int, *, approximate: bool) -> None:
        self.kv, self.min_reuse, self.approximate = kv, min_reuse, approximate
        self.name = "edgekv_approx" if approximate else "edgekv_strict"

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        r = self.kv.generate(text, max_tokens=max_tokens, approximate=self.approximate)
        traffic = r.prefill_traffic_bytes + r.kv_bytes_read + r.kv_bytes_written
        return Outcome(r.ttft_s, r.cached_tokens, r.computed_tokens, r.text,
                       r.cached_tokens >= self.min_reuse, traffic, r.match.tier,
                       r.match.approximate)


class LlamaRAMCacheMode:
    """llama-cpp-python's own prompt cache (`LlamaRAMCache`), greedy, streamed for TTFT."""

    name = "llama_ram_cache"

    def __init__(self, model_path: str, n_ctx: int, min_reuse: int, weight_bytes: int,
                 kv_bytes_per_token: int, capacity_bytes: int = 2 << 30) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path, n_ctx=n_ctx, n_batch=512, verbose=False)
        self.cache = llama_cpp.LlamaRAMCache(capacity_bytes=capacity_bytes)
        self.llm.set_cache(self.cache)
        self.min_reuse, self.n_batch = min_reuse, 512
        self.weight_bytes, self.kvpt = weight_bytes, kv_bytes_per_token

    def _reused(self, tokens: Sequence[int]) -> tuple[int, bool, int]:
        lcp = self._lib.Llama.longest_token_prefix
        resident = lcp(self.llm._input_ids.tolist(), list(tokens))
        key = self.cache._find_longest_prefix_key(tuple(tokens))
        cached = lcp(key, list(tokens)) if key is not None else 0
        size = self.cache.cache_state[key].llama_state_size if key is not None else 0
        loads = cached > resident
        return min(max(resident, cached), len(tokens) - 1), loads, size if loads else 0

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        reused, _, loaded_bytes = self._reused(tokens)
        before = self.cache.cache_size
        t0 = time.perf_counter()
        ttft = None
        parts = []
        for chunk in self.llm.create_completion(text, max_tokens=max_tokens, temperature=0.0,
                                                top_k=1, repeat_penalty=1.0, stream=True):
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(chunk["choices"][0]["text"])
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        saved = max(0, self.cache.cache_size - before)
        c = EngineCounters()
        for lo in range(reused, len(tokens), self.n_batch):
            c.add_batch(lo, min(len(tokens), lo + self.n_batch))
        traffic = c.traffic_bytes(self.weight_bytes, self.kvpt) + loaded_bytes + saved
        return Outcome(ttft, reused, len(tokens) - reused, "".join(parts),
                       reused >= self.min_reuse, traffic)

    def close(self) -> None:
        self.llm.close()


def describe(mode: Any) -> str:
    return getattr(mode, "name", type(mode).__name__)
