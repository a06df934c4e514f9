"""The modes the seed benchmark compares, each answering one request the same way:
`run(text, tokens, max_tokens) -> Outcome`. Engines are shared where that is fair (modes that
clear the context on every request share one); the llama-cpp-python peer gets its own `Llama`
so that its in-context prefix reuse between consecutive requests survives, as in real use.
`PlainMode` is what a user of llama-cpp-python gets with no cache at all: the reference the
other systems' outputs are also compared with. Every `Llama` here gets the EdgeKV adapter's
thread count, so that no mode is faster or slower for its threads alone."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..baseline import StringCache
from ..cache import EdgeKV
from ..engines.base import EngineCounters

__all__ = ["EdgeKVMode", "LlamaRAMCacheMode", "NoCacheMode", "Outcome", "PlainMode",
           "StringMode"]


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
    total_s: float = 0.0  # the whole request: lookup, prefill, generation, the cache's upkeep


class NoCacheMode:
    name = "nocache"

    def __init__(self, kv: EdgeKV, min_reuse: int) -> None:
        self.kv = kv

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        t0 = time.perf_counter()
        r = self.kv.generate(tokens, max_tokens=max_tokens, use_cache=False)
        return Outcome(r.ttft_s, 0, r.computed_tokens, r.text, False, r.prefill_traffic_bytes,
                       total_s=time.perf_counter() - t0)


class StringMode:
    name = "string"

    def __init__(self, kv: EdgeKV, min_reuse: int) -> None:
        self.kv, self.cache = kv, StringCache()

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        t0 = time.perf_counter()
        hit = self.cache.get(text, max_tokens=max_tokens)
        if hit is not None:
            t = time.perf_counter() - t0
            return Outcome(t, len(tokens), 0, hit.text, True, 0, total_s=t)
        r = self.kv.generate(tokens, max_tokens=max_tokens, use_cache=False)
        self.cache.put(text, r.text, r.tokens, max_tokens=max_tokens)
        total = time.perf_counter() - t0
        return Outcome(total - (r.total_s - r.ttft_s), 0, r.computed_tokens, r.text, False,
                       r.prefill_traffic_bytes, total_s=total)


class EdgeKVMode:
    def __init__(self, kv: EdgeKV, min_reuse: int, *, approximate: bool,
                 name: str | None = None) -> None:
        self.kv, self.min_reuse, self.approximate = kv, min_reuse, approximate
        self.name = name or ("edgekv_approx" if approximate else "edgekv_strict")

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        # timed around the call: GenerationResult.total_s stops before the fragments are
        # stored, while llama-cpp-python's cache saves its state inside the streamed loop
        t0 = time.perf_counter()
        r = self.kv.generate(text, max_tokens=max_tokens, approximate=self.approximate)
        total = time.perf_counter() - t0
        traffic = r.prefill_traffic_bytes + r.kv_bytes_read + r.kv_bytes_written
        return Outcome(r.ttft_s, r.cached_tokens, r.computed_tokens, r.text,
                       r.cached_tokens >= self.min_reuse, traffic, r.match.tier,
                       r.match.approximate, total)


@dataclass(frozen=True, slots=True)
class _Streamed:
    text: str
    ttft_s: float
    total_s: float


def _stream(llm: Any, tokens: Sequence[int], max_tokens: int) -> _Streamed:
    """Greedy streamed completion: TTFT at the first chunk, total at the last. The prompt goes
    in as token ids, so every mode answers exactly the same tokens."""
    t0 = time.perf_counter()
    ttft = None
    parts = []
    for chunk in llm.create_completion(list(tokens), max_tokens=max_tokens, temperature=0.0,
                                       top_k=1, repeat_penalty=1.0, stream=True):
        if ttft is None:
            ttft = time.perf_counter() - t0
        parts.append(chunk["choices"][0]["text"])
    total = time.perf_counter() - t0
    return _Streamed("".join(parts), total if ttft is None else ttft, total)


def _prefill_traffic(n_from: int, n_to: int, n_batch: int, weight_bytes: int,
                     kv_bytes_per_token: int) -> int:
    c = EngineCounters()
    for lo in range(n_from, n_to, n_batch):
        c.add_batch(lo, min(n_to, lo + n_batch))
    return c.traffic_bytes(weight_bytes, kv_bytes_per_token)


class PlainMode:
    """llama-cpp-python as a user runs it with no cache: default batching, a fresh context
    for every request (`reset`, or `Llama.generate` would reuse the previous prompt's
    longest common prefix), greedy, streamed for TTFT. The reference output."""

    name = "plain"

    def __init__(self, model_path: str, n_ctx: int, n_threads: int, weight_bytes: int,
                 kv_bytes_per_token: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path, n_ctx=n_ctx, n_threads=n_threads,
                                   n_threads_batch=n_threads, verbose=False)
        self.n_batch = int(self.llm.n_batch)
        self.weight_bytes, self.kvpt = weight_bytes, kv_bytes_per_token

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        self.llm.reset()
        s = _stream(self.llm, tokens, max_tokens)
        traffic = _prefill_traffic(0, len(tokens), self.n_batch, self.weight_bytes, self.kvpt)
        return Outcome(s.ttft_s, 0, len(tokens), s.text, False, traffic, total_s=s.total_s)

    def close(self) -> None:
        self.llm.close()


class LlamaRAMCacheMode:
    """llama-cpp-python's own prompt cache (`LlamaRAMCache`), greedy, streamed for TTFT."""

    name = "llama_ram_cache"

    def __init__(self, model_path: str, n_ctx: int, min_reuse: int, weight_bytes: int,
                 kv_bytes_per_token: int, capacity_bytes: int = 2 << 30, *,
                 n_threads: int | None = None) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path, n_ctx=n_ctx, n_batch=512, n_threads=n_threads,
                                   n_threads_batch=n_threads, verbose=False)
        self.cache = llama_cpp.LlamaRAMCache(capacity_bytes=capacity_bytes)
        self.llm.set_cache(self.cache)
        self.min_reuse, self.n_batch = min_reuse, 512
        self.weight_bytes, self.kvpt = weight_bytes, kv_bytes_per_token

    def _reused(self, tokens: Sequence[int]) -> tuple[int, bool, int]:
        """What the next request reuses, from public state: the prefix the context holds
        (`Llama.input_ids` up to `n_tokens`) or the cached state llama-cpp-python would load
        (the first entry of `cache_state` with the longest common prefix, as its lookup picks
        it); whether that is a load, and the bytes loaded."""
        lcp, toks = self._lib.Llama.longest_token_prefix, list(tokens)
        resident = lcp(self.llm.input_ids[: self.llm.n_tokens].tolist(), toks)
        key, cached = None, 0
        for k in self.cache.cache_state.keys():
            n = lcp(k, toks)
            if n > cached:
                key, cached = k, n
        size = self.cache.cache_state[key].llama_state_size if key is not None else 0
        loads = cached > resident
        return min(max(resident, cached), len(tokens) - 1), loads, size if loads else 0

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        reused, _, loaded_bytes = self._reused(tokens)
        before = self.cache.cache_size
        s = _stream(self.llm, tokens, max_tokens)
        saved = max(0, self.cache.cache_size - before)
        traffic = _prefill_traffic(reused, len(tokens), self.n_batch, self.weight_bytes,
                                   self.kvpt) + loaded_bytes + saved
        return Outcome(s.ttft_s, reused, len(tokens) - reused, s.text,
                       reused >= self.min_reuse, traffic, total_s=s.total_s)

    def close(self) -> None:
        self.llm.close()


def describe(mode: Any) -> str:
    return getattr(mode, "name", type(mode).__name__)
