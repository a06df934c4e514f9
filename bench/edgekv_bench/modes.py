"""The modes the seed benchmark compares, each answering one request the same way:
`run(text, tokens, max_tokens) -> Outcome`. Engines are shared where that is fair (modes that
clear the context on every request share one); the llama-cpp-python peer gets its own `Llama`
so that its in-context prefix reuse between consecutive requests survives, as in real use.
`PlainMode` is what a user of llama-cpp-python gets with no cache at all: the reference the
other systems' outputs are also compared with. Every `Llama` here gets the EdgeKV adapter's
thread count, so that no mode is faster or slower for its threads alone."""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekv.core.pipeline import EdgeKV
from edgekv.engines.base import EngineCounters

from .baseline import StringCache

__all__ = ["EdgeKVMode", "LlamaRAMCacheMode", "LlamaServerMode", "NoCacheMode", "Outcome",
           "PlainMode", "StateSeqMode", "StringMode"]


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
    # where the time to the first token went (seconds): lookup, load (state or KV inject),
    # eval (prefill and the first token); `save` is after the first token
    parts: dict[str, float] = field(default_factory=dict)


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
        if self.kv.prefetcher is not None:
            # the prefetch it queued runs now, inside this mode's CPU and energy accounting
            # (not its latency: a device does it between requests), never in another mode's
            self.kv.prefetcher.drain()
        traffic = r.prefill_traffic_bytes + r.kv_bytes_read + r.kv_bytes_written
        parts = {"lookup": r.lookup_s, "load": r.inject_s,
                 "eval": r.ttft_s - r.lookup_s - r.inject_s, "save": r.store_s}
        return Outcome(r.ttft_s, r.cached_tokens, r.computed_tokens, r.text,
                       r.cached_tokens >= self.min_reuse, traffic, r.match.tier,
                       r.match.approximate, total, parts)


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
        # time its three steps where llama-cpp-python takes them: the cache's longest-prefix
        # scan (`__getitem__`), `load_state` (KV state + its saved `scores` rows + input ids)
        # and `save_state` (the same copies, after the answer); bytes moved are counted
        self._clock: dict[str, float] = {}
        self._moved = 0
        self._wrap_cache_lookup()
        for step, attr in (("load", "load_state"), ("save", "save_state")):
            self._wrap(step, attr)

    def _wrap(self, step: str, attr: str) -> None:
        inner = getattr(self.llm, attr)

        def timed(*a: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(*a)
            self._clock[step] = self._clock.get(step, 0.0) + time.perf_counter() - t0
            state = a[0] if a else out
            self._moved += (int(state.llama_state_size) + state.scores.nbytes
                            + state.input_ids.nbytes)
            return out

        setattr(self.llm, attr, timed)

    def _wrap_cache_lookup(self) -> None:
        cache, clock = self.cache, self._clock
        base = type(cache)

        class TimedLookup(base):  # type: ignore[misc, valid-type]
            def __getitem__(self, key: Sequence[int]) -> Any:
                t0 = time.perf_counter()
                try:
                    return super().__getitem__(key)
                finally:
                    clock["lookup"] = clock.get("lookup", 0.0) + time.perf_counter() - t0

        cache.__class__ = TimedLookup

    def _reused(self, tokens: Sequence[int]) -> tuple[int, bool, int]:
        """What the next request reuses, from public state: the prefix the context holds
        (`Llama.input_ids` up to `n_tokens`) or the cached state llama-cpp-python would load
        (the first entry of `cache_state` with the longest common prefix, as its lookup picks
        it); whether that is a load, and the bytes loaded."""
        lcp, toks = self._lib.Llama.longest_token_prefix, list(tokens)
        resident = lcp(self.llm.input_ids[: self.llm.n_tokens].tolist(), toks)
        key, cached = None, 0
        for k, state in self.cache.cache_state.items():
            # its keys end in the last answer token, whose KV the state does not hold
            n = min(lcp(k, toks), int(state.n_tokens))
            if n > cached:
                key, cached = k, n
        size = self.cache.cache_state[key].llama_state_size if key is not None else 0
        loads = cached > resident
        return min(max(resident, cached), len(tokens) - 1), loads, size if loads else 0

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        reused, _, _ = self._reused(tokens)
        self._clock.clear()
        self._moved = 0
        s = _stream(self.llm, tokens, max_tokens)
        traffic = _prefill_traffic(reused, len(tokens), self.n_batch, self.weight_bytes,
                                   self.kvpt) + self._moved
        c = self._clock
        parts = {"lookup": c.get("lookup", 0.0), "load": c.get("load", 0.0),
                 "eval": s.ttft_s - c.get("lookup", 0.0) - c.get("load", 0.0),
                 "save": c.get("save", 0.0)}
        return Outcome(s.ttft_s, reused, len(tokens) - reused, s.text,
                       reused >= self.min_reuse, traffic, total_s=s.total_s, parts=parts)

    def close(self) -> None:
        self.llm.close()


def describe(mode: Any) -> str:
    return getattr(mode, "name", type(mode).__name__)


class StateSeqMode:
    """The stronger peer: plain prefix caching as a careful llama-cpp-python user writes it in
    about fifty lines, at token granularity with no chunks. After each answer the sequence's
    KV (`llama_state_seq_get_data`: KV cells only, no logits) is kept in RAM under the tokens
    it holds (prompt + answer less its last token); a new prompt loads the entry with the
    longest common prefix (`llama_state_seq_set_data`) when that beats what the context holds,
    and llama-cpp-python's own prefix check then drops the cells past the common prefix and
    evaluates the rest in one batch. LRU within `capacity_bytes`."""

    name = "state_seq"

    def __init__(self, model_path: str, n_ctx: int, min_reuse: int, weight_bytes: int,
                 kv_bytes_per_token: int, capacity_bytes: int = 2 << 30, *,
                 n_threads: int | None = None) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path, n_ctx=n_ctx, n_threads=n_threads,
                                   n_threads_batch=n_threads, verbose=False)
        self.entries: OrderedDict[tuple[int, ...], bytes] = OrderedDict()
        self.capacity = capacity_bytes
        self.min_reuse, self.n_batch = min_reuse, int(self.llm.n_batch)
        self.weight_bytes, self.kvpt = weight_bytes, kv_bytes_per_token

    def _best(self, tokens: Sequence[int]) -> tuple[tuple[int, ...] | None, int]:
        lcp = self._lib.Llama.longest_token_prefix
        best, n = None, 0
        for k in self.entries:
            m = lcp(k, tokens)
            if m > n:
                best, n = k, m
        return best, n

    def _save(self) -> int:
        held = tuple(int(t) for t in self.llm.input_ids[: self.llm.n_tokens])
        if any(k[: len(held)] == held for k in self.entries):
            return 0  # an entry already holds this sequence
        for k in [k for k in self.entries if held[: len(k)] == k]:
            del self.entries[k]  # superseded: the new entry extends it
        ctx = self.llm.ctx
        size = self._lib.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        n = self._lib.llama_state_seq_get_data(ctx, buf, size, 0)
        self.entries[held] = bytes(buf[:n])
        while sum(map(len, self.entries.values())) > self.capacity:
            self.entries.popitem(last=False)
        return int(n)

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        t0 = time.perf_counter()
        lcp = self._lib.Llama.longest_token_prefix
        resident = lcp(self.llm.input_ids[: self.llm.n_tokens].tolist(), tokens)
        key, cached = self._best(tokens)
        t_lookup = time.perf_counter()
        loaded = 0
        if key is not None and cached > resident:
            blob = self.entries[key]
            self.entries.move_to_end(key)
            ctx = self.llm.ctx
            self._lib.llama_memory_seq_rm(self._lib.llama_get_memory(ctx), 0, -1, -1)
            arr = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
            if self._lib.llama_state_seq_set_data(ctx, arr, len(blob), 0) != len(blob):
                raise RuntimeError("llama_state_seq_set_data refused a saved state")
            held = len(key)
            if list(key) == list(tokens):
                # the whole prompt is loaded but its logits are not: drop its last cell so
                # that generate computes that token again (what llama-cpp-python's own
                # `_requires_eval` flag makes it do, without reaching into the object)
                held -= 1
                self._lib.llama_memory_seq_rm(self._lib.llama_get_memory(ctx), 0, held, -1)
            self.llm.input_ids[:held] = key[:held]
            self.llm.n_tokens = held
            loaded = len(blob)
        t_load = time.perf_counter()
        reused = min(max(resident, cached), len(tokens) - 1)
        s = _stream(self.llm, tokens, max_tokens)
        t_save = time.perf_counter()
        saved = self._save()
        total = time.perf_counter() - t0
        ttft = t_load - t0 + s.ttft_s
        traffic = _prefill_traffic(reused, len(tokens), self.n_batch, self.weight_bytes,
                                   self.kvpt) + loaded + saved
        parts = {"lookup": t_lookup - t0, "load": t_load - t_lookup, "eval": s.ttft_s,
                 "save": time.perf_counter() - t_save}
        return Outcome(ttft, reused, len(tokens) - reused, s.text, reused >= self.min_reuse,
                       traffic, total_s=total, parts=parts)

    def close(self) -> None:
        self.llm.close()


class LlamaServerMode:
    """llama.cpp's own server, as its users run it (`bench serve` shares the command line):
    `llama_server` with its default prompt cache (`cache_prompt` on: the slot keeps the KV of
    the previous prompt, and its RAM prompt cache keeps earlier ones), `llama_server_nocache`
    with `--no-cache-prompt` as its own cache-off run. Token-id prompts go to its native
    `/completion` endpoint, greedy, streamed; TTFT at the first streamed token."""

    def __init__(self, name: str, binary: Path, model_path: str, n_ctx: int, threads: int,
                 workdir: Path, min_reuse: int, weight_bytes: int,
                 kv_bytes_per_token: int) -> None:
        from .servers import Server, free_port, peer_env, server_command

        self.name, self.min_reuse = name, min_reuse
        self.weight_bytes, self.kvpt = weight_bytes, kv_bytes_per_token
        got = server_command(name, model=model_path, n_ctx=n_ctx, threads=threads,
                             root=workdir, llama_server=binary)
        assert got is not None
        port = free_port()
        self.server = Server(name, [c.replace("{port}", str(port)) for c in got[0]], got[1],
                             port, workdir / f"{name}.log", env=peer_env(name))
        self.server.start()

    def run(self, text: str, tokens: Sequence[int], max_tokens: int) -> Outcome:
        import http.client
        import json

        body = json.dumps({"prompt": list(map(int, tokens)), "n_predict": max_tokens,
                           "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0,
                           "stream": True, "cache_prompt": not self.name.endswith("nocache")})
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=900)
        try:
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {resp.status}: {resp.read()[:200]!r}")
            ttft, parts, cached = None, [], 0
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                ev = json.loads(line[6:])
                if ev.get("content"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(ev["content"])
                if ev.get("stop"):
                    cached = int(ev.get("timings", {}).get("cache_n", 0) or 0)
                    break
        finally:
            conn.close()
        total = time.perf_counter() - t0
        traffic = _prefill_traffic(cached, len(tokens), 512, self.weight_bytes, self.kvpt)
        return Outcome(total if ttft is None else ttft, cached, len(tokens) - cached,
                       "".join(parts), cached >= self.min_reuse, traffic, total_s=total)

    def close(self) -> None:
        self.server.stop()
