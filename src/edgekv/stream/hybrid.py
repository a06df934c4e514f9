"""The SparKV executor: stream some chunks, compute others, overlap both, adapt, fall back.

The device computes chunks in order. Chunks planned for streaming arrive on a background
thread; whenever the next chunk (or a run of them) has arrived it is injected, otherwise the
device either waits for it (if it is predicted to land sooner than computing it would take)
or computes it itself. When the stream finishes early the rest of the plan is revised from the
measured throughput and more chunks are requested; a timeout, dropped connection, rejected
chunk or wrong model turns every remaining chunk into local compute. The answer never depends
on which path a chunk took: streamed chunks are verified (chain key, tokens, layers) and, at
the default f16 level, bit-identical to computed ones.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..cache import EdgeKV
from ..errors import ChunkRejected, EdgeKVError, IncompatibleFragment, TransportError
from ..fragment import KVFragment
from .client import KVClient, Received
from .costmodel import CostModel
from .planner import COMPUTE, STREAM, Plan, plan

__all__ = ["HybridLoader", "HybridResult"]

log = logging.getLogger(__name__)


@dataclass
class HybridResult:
    text: str
    tokens: tuple[int, ...]
    first_logits: np.ndarray = field(repr=False)
    ttft_s: float = 0.0
    strategy: str = "hybrid"
    plan: Plan | None = None
    local_chunks: int = 0
    streamed_chunks: int = 0
    computed_chunks: int = 0
    wire_bytes: int = 0
    computed_tokens: int = 0
    replans: int = 0
    fallback: str | None = None  # why streaming stopped early, if it did
    stream_s: float = 0.0  # seconds the radio was receiving (request sent -> last chunk)


class _Stream:
    """One streaming request on a background thread; results arrive on a queue."""

    def __init__(self, client: KVClient, keys: Sequence[tuple[int, str]], codec: str) -> None:
        self.q: queue.Queue[tuple[int, Received] | BaseException | None] = queue.Queue()
        self.pending = [i for i, _ in keys]
        self.cancelled = False  # set when the executor no longer needs this stream
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(client, keys, codec), daemon=True)
        self._thread.start()

    def _run(self, client: KVClient, keys: Sequence[tuple[int, str]], codec: str) -> None:
        try:
            idx = [i for i, _ in keys]
            for n, rec in enumerate(client.stream([k for _, k in keys], codec)):
                if self.cancelled:
                    return  # closing the generator closes the connection
                self.q.put((idx[n], rec))
            self.q.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the executor
            self.q.put(e)


class HybridLoader:
    def __init__(self, kv: EdgeKV, client: KVClient | None, cost: CostModel | None = None, *,
                 codec: str = "f16", objective: str = "ttft", max_replans: int = 3) -> None:
        self.kv, self.client = kv, client
        self.cost = cost or CostModel()
        self.codec, self.objective, self.max_replans = codec, objective, max_replans
        self.server_ok: str | None = None  # reason streaming is off, if it is
        if client is not None:
            try:
                t = time.perf_counter()
                info = client.info()
                self.cost.observe_rtt(time.perf_counter() - t)
                if info.get("fingerprint") != kv.fingerprint:
                    self.server_ok = (f"server model {str(info.get('fingerprint'))[:12]} differs from "
                                      f"this device's {kv.fingerprint[:12]}")
                    log.warning("KV server refused: %s; computing locally", self.server_ok)
                elif info.get("chunk_size") != kv.config.chunk_size:
                    self.server_ok = (f"server chunks are {info.get('chunk_size')} tokens, this "
                                      f"device uses {kv.config.chunk_size}")
                    log.warning("KV server refused: %s; computing locally", self.server_ok)
            except TransportError as e:
                self.server_ok = f"server unreachable: {e}"
                log.warning("KV server unreachable (%s); computing locally", e)

    @property
    def streaming(self) -> bool:
        return self.client is not None and self.server_ok is None

    # -- public API ----------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 16,
                 strategy: str = "hybrid", store: bool = True) -> HybridResult:
        if strategy not in ("hybrid", "local", "stream"):
            raise EdgeKVError(f"strategy must be hybrid, local or stream, not {strategy!r}")
        kv, a = self.kv, self.kv.adapter
        t0 = time.perf_counter()
        tokens = a.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if len(tokens) + max_tokens > a.n_ctx:
            raise EdgeKVError(f"prompt + max_tokens exceeds the context window ({a.n_ctx})")
        c = kv.config.chunk_size
        all_keys = kv.chunk_keys(tokens)
        keys = all_keys[: (len(tokens) - 1) // c]
        n = len(keys)
        # the device's own cache first; the executor handles one fragment per chunk
        local = [ch.fragments[0] for ch in
                 itertools.takewhile(lambda ch: len(ch.fragments) == 1, kv.cached_chunks(keys))]
        raw = c * a.fingerprint.kv_bytes_per_token
        stream_ok = self.streaming and strategy != "local"
        flags = [i < len(local) for i in range(n)]
        if strategy == "local" or not stream_ok:
            actions = tuple("local" if f else COMPUTE for f in flags)
            p = None
        elif strategy == "stream":
            actions = tuple("local" if f else STREAM for f in flags)
            p = None
        else:
            p = plan(n, flags, [True] * n, raw, self.cost, objective=self.objective)
            actions = p.actions
        res = HybridResult("", (), np.zeros(0, np.float32), strategy=strategy, plan=p,
                           local_chunks=len(local))
        if not stream_ok and self.server_ok and strategy != "local":
            res.fallback = self.server_ok
        logits = self._execute(tokens, keys, local, list(actions), res,
                               patient=strategy == "stream", adaptive=strategy == "hybrid")
        res.ttft_s = time.perf_counter() - t0
        res.first_logits = logits
        gen = a.generate(logits, max_tokens)
        res.tokens, res.text = gen.tokens, a.detokenize(gen.tokens)
        # quantized chunks are not this request's exact KV: nothing computed on them is stored
        if store and (self.codec == "f16" or res.streamed_chunks == 0):
            kv.store_new(tokens, len(local) * c, all_keys)
        return res

    # -- execution -----------------------------------------------------------------------

    def _verify(self, frag: KVFragment, key: str, i: int, tokens: Sequence[int]) -> None:
        c = self.kv.config.chunk_size
        fp = self.kv.adapter.fingerprint
        self.kv.reader.verify(frag, key, 0, fp.n_layer, None)
        if (frag.keys.shape[2], frag.values.shape[2], frag.kv_dtype) != (fp.n_embd_k, fp.n_embd_v, fp.kv_dtype):
            raise ChunkRejected(f"chunk {i} has KV widths/dtype {frag.keys.shape[2]}/"
                                f"{frag.values.shape[2]}/{frag.kv_dtype}, the engine "
                                f"{fp.n_embd_k}/{fp.n_embd_v}/{fp.kv_dtype}")
        if frag.token_start != i * c or not np.array_equal(frag.token_ids, tokens[i * c : (i + 1) * c]):
            raise ChunkRejected(f"chunk {i} does not hold the request's tokens")

    def _execute(self, tokens: list[int], keys: list[str], local: list[KVFragment],
                 actions: list[str], res: HybridResult, *, patient: bool = False,
                 adaptive: bool = True) -> np.ndarray:
        """`patient`: wait for every streamed chunk (the all-stream baseline) instead of
        computing one that is predicted to arrive later than it would take to compute."""
        a, c = self.kv.adapter, self.kv.config.chunk_size
        n = len(keys)
        frags: dict[int, KVFragment] = dict(enumerate(local))
        a.clear_kv_cache()
        if local:
            try:
                a.inject_fragments(local)
            except (IncompatibleFragment, EdgeKVError) as e:
                log.warning("local chunks refused (%s); recomputing them", e)
                a.clear_kv_cache()
                frags.clear()
                actions = [COMPUTE if x == "local" else x for x in actions]
                local = []
        pos = len(local)  # chunks whose KV the engine holds
        waiting_since: dict[int, float] = {}
        stream: _Stream | None = None
        dead = False
        got: dict[int, KVFragment] = {}

        def start(idx: list[int]) -> _Stream | None:
            if not idx or self.client is None:
                return None
            return _Stream(self.client, [(i, keys[i]) for i in idx], self.codec)

        stream = start([i for i in range(pos, n) if actions[i] == STREAM])
        last_at = 0.0

        def take(item: object) -> None:
            """Record one queue item; a sentinel or an error ends the current stream."""
            nonlocal stream, dead, last_at
            assert stream is not None
            last_at = self._take(item, stream, got, keys, tokens, res, last_at)
            if item is None or isinstance(item, BaseException):
                dead = dead or isinstance(item, BaseException)
                stream, last_at = None, 0.0

        while pos < n:
            while stream is not None:  # take in whatever has arrived
                try:
                    take(stream.q.get_nowait())
                except queue.Empty:
                    break
            if pos in got:
                end = pos
                while end in got:
                    end += 1
                run = {i: got.pop(i) for i in range(pos, end)}
                try:
                    self._sync({**frags, **run}, pos, end)
                except (IncompatibleFragment, EdgeKVError) as e:
                    res.fallback = f"streamed chunks refused by the engine: {e}"
                    log.warning("%s; computing them locally", res.fallback)
                    dead = True
                    if stream is not None:
                        stream.cancelled = True
                        stream = None
                    self._ensure_engine_holds(frags, pos)
                    continue
                frags.update(run)
                res.streamed_chunks += end - pos
                pos = end
                continue
            if not dead and stream is not None and actions[pos] == STREAM and pos in stream.pending:
                ahead = [i for i in stream.pending if i <= pos and i not in got]
                raw = len(ahead) * c * a.fingerprint.kv_bytes_per_token
                wait = self.cost.transfer_s(self.cost.wire_bytes(raw))
                assert self.client is not None
                since = waiting_since.setdefault(pos, time.perf_counter())
                # how long this chunk may keep the device idle: a trickling server never trips
                # the per-read timeout, so the wait itself has a deadline
                budget = (10 if patient else 2) * self.client.timeout_s + 2 * wait
                if time.perf_counter() - since > budget:
                    res.fallback = f"chunk {pos} not delivered within {budget:.1f}s"
                    log.warning("%s; computing the rest locally", res.fallback)
                    dead, stream.cancelled, stream = True, True, None
                elif patient or wait < self.cost.compute_s(pos):
                    try:
                        take(stream.q.get(timeout=max(0.05, min(2 * wait + 0.05, self.client.timeout_s))))
                    except queue.Empty:
                        pass
                    continue
            # compute chunk `pos` locally
            self._ensure_engine_holds(frags, pos)
            t = time.perf_counter()
            a.prefill(tokens[pos * c : (pos + 1) * c], align=c)
            self.cost.observe_prefill(pos, time.perf_counter() - t)
            res.computed_chunks += 1
            res.computed_tokens += c
            frags.pop(pos, None)
            pos += 1
            if (adaptive and stream is None and not dead and self.streaming
                    and res.replans < self.max_replans
                    and any(actions[i] == COMPUTE for i in range(pos + 1, n))):
                actions, stream = self._replan(actions, pos, n, start, res)
        if stream is not None:
            stream.cancelled = True
        self._ensure_engine_holds(frags, n)
        tail = tokens[n * c :]
        res.computed_tokens += len(tail)
        return a.prefill(tail, align=c)

    def _take(self, item: object, stream: _Stream, got: dict[int, KVFragment], keys: list[str],
              tokens: list[int], res: HybridResult, last_at: float) -> float:
        if isinstance(item, BaseException):
            res.fallback = f"{type(item).__name__}: {item}"
            self.cost.observe_failure(True)
            log.warning("KV stream failed (%s); computing the remaining chunks locally", item)
            return last_at
        if item is None:
            self.cost.observe_failure(False)
            return last_at
        i, rec = item  # type: ignore[misc]
        stream.pending = [k for k in stream.pending if k != i]
        res.wire_bytes += rec.wire_bytes
        res.stream_s += rec.at_s - (last_at if last_at else 0.0)
        if rec.fragment is None:
            return last_at
        try:
            self._verify(rec.fragment, keys[i], i, tokens)
        except (ChunkRejected, IncompatibleFragment) as e:
            res.fallback = f"chunk {i} rejected: {e}"
            log.warning("streamed chunk %d rejected (%s); computing it locally", i, e)
            return last_at
        # the first chunk's time includes the request's round trip (estimated from the small
        # calls); later chunks' inter-arrival times are pure transfer
        gap = rec.at_s - (last_at if last_at else self.cost.rtt_s)
        self.cost.observe_transfer(rec.wire_bytes, gap)
        self.cost.observe_wire_ratio(rec.wire_bytes, rec.fragment.nbytes)
        got[i] = rec.fragment
        return rec.at_s

    def _replan(self, actions: list[str], pos: int, n: int, start, res: HybridResult):  # type: ignore[no-untyped-def]
        """The stream is done and compute is still ahead: re-plan the rest from measurements."""
        rest = list(range(pos + 1, n))
        c = self.kv.config.chunk_size
        raw = c * self.kv.adapter.fingerprint.kv_bytes_per_token
        flags = [i <= pos for i in range(n)]  # chunk `pos` is being computed next: treat as held
        p = plan(n, flags, [True] * n, raw, self.cost, objective=self.objective)
        new = actions[: pos + 1] + [p.actions[i] for i in rest]
        stream = start([i for i in rest if new[i] == STREAM])
        if stream is not None:
            res.replans += 1
            log.info("re-planned at chunk %d: streaming %s", pos, [i for i in rest if new[i] == STREAM])
        return new, stream

    def _sync(self, frags: dict[int, KVFragment], held: int, end: int) -> None:
        """Make the engine hold chunks [0, end): extract what it computed, inject everything."""
        a = self.kv.adapter
        missing = [i for i in range(held) if i not in frags]
        if missing:
            from ..engines.base import FragmentSpec

            c = self.kv.config.chunk_size
            specs = [FragmentSpec(f"computed-{i}", i * c, (i + 1) * c) for i in missing]
            for i, f in zip(missing, a.extract_fragments(specs)):
                frags[i] = f
        a.inject_fragments([frags[i] for i in range(end)])

    def _ensure_engine_holds(self, frags: dict[int, KVFragment], upto: int) -> None:
        c = self.kv.config.chunk_size
        if self.kv.adapter.n_tokens != upto * c:
            self._sync(frags, self.kv.adapter.n_tokens // c, upto)
