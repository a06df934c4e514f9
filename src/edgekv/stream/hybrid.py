"""SparKV as the fill step of the one request path: stream some chunks, compute others,
overlap.

An `EdgeKV` built with `fill=HybridLoader(client)` runs it on every request (`request.FillStep`):
the device's own whole chunks are injected, the step brings the engine to the prompt's last
whole chunk, the rest is prefilled, answered and stored as for any request; the step's account
of what it did is `GenerationResult.fill_report` (a `HybridResult`). Chunks are taken in
order: a streamed run that has arrived is appended to what the engine holds
(`KVAdapter.append_fragments`: computed KV never leaves it); else the device waits for the
next chunk if it should land before computing it would end, or computes it. A stream that
ends early re-plans the rest from measurements; a timeout, dropped connection, rejected chunk
or wrong model turns what is left into local compute. Streamed chunks are verified (chain
key, tokens, layers) and, at the default f16 level, bit-identical to computed ones.

Nothing on the network is on the critical path of a request that computes everything: the
server check (`/v1/info`, whose round trip is the measured RTT the planner uses) and the
session run on a background thread from the moment the loader is attached, the plan is made
from the cost model's current estimates (the prior until something is measured) before
anything waits on the network, and an all-compute plan hands the chunks back to the cache's
own prefill (exactly a request without streaming). A stream waits for the check on its own
thread. A chunk that is overdue (waited on longer than predicted plus half its compute time:
the link slowed down) is computed instead; the stream is dropped, the link estimate lowered to
what the wait proves, and the rest re-planned.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

from ..config import StreamConfig
from ..core.request import Filled, FillRequest
from ..errors import ChunkRejected, ConfigError, EdgeKVError, IncompatibleFragment, TransportError
from ..fragment import KVFragment
from ..keys import KV_SERVER_TENANTS, tenant_root
from .client import BackgroundStream, KVClient, Received
from .costmodel import CostModel
from .planner import COMPUTE, LOCAL, STREAM, ChunkAction, Plan, plan

if TYPE_CHECKING:
    from ..config import CacheConfig
    from ..engines.base import KVAdapter

__all__ = ["HybridLoader", "HybridResult"]

log = logging.getLogger(__name__)
STRATEGIES = ("hybrid", "local", "stream")
PUBLISH_TIMEOUT_S = 600.0  # the server runs the whole prompt for a precompute (off the path)


@dataclass
class HybridResult:
    """What the SparKV step did for one request (`GenerationResult.fill_report`)."""

    strategy: str = "hybrid"
    plan: Plan | None = None
    local_chunks: int = 0
    streamed_chunks: int = 0
    computed_chunks: int = 0
    wire_bytes: int = 0
    replans: int = 0
    fallback: str | None = None  # why streaming stopped early, if it did
    stream_s: float = 0.0  # seconds the radio was receiving (request sent -> last chunk)
    # what happened to each whole chunk: L (device cache), S (streamed), C (computed here)
    executed: str = ""
    switched: int = 0  # chunks planned to stream that were computed because they were overdue
    plan_s: float = 0.0  # seconds spent planning and re-planning (on the critical path)
    handed_back: bool = False  # all-compute plan: the cache's own prefill did the chunks


@dataclass(slots=True)
class _Run:
    """One request's executor state: the engine holds chunks [0, pos); `actions` is the plan
    for every chunk (revised as it runs); `got` holds streamed chunks not yet appended."""

    req: FillRequest
    actions: list[ChunkAction]
    res: HybridResult
    patient: bool  # wait for every streamed chunk (the all-stream baseline)
    adaptive: bool  # re-plan when the stream ends while compute is still ahead (hybrid)
    pos: int
    stream: BackgroundStream | None = None
    dead: bool = False  # streaming given up for this request
    got: dict[int, KVFragment] = field(default_factory=dict)
    last_at: float = 0.0  # arrival of the last streamed chunk, seconds since its request
    waiting_since: dict[int, float] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)  # per chunk, in order: "L", "S" or "C"

    @property
    def n(self) -> int:
        return self.req.n_chunks

    @property
    def chunk_bytes(self) -> int:
        return self.req.chunk_size * self.req.adapter.fingerprint.kv_bytes_per_token


class HybridLoader:
    """SparKV's fill step. `strategy`: "hybrid" (planned, re-planned), "stream" (every chunk
    the device lacks is streamed: the all-stream baseline) or "local" (every such chunk
    computed); benchmarks may switch it between requests. `client` None: no KV server, every
    chunk is computed here."""

    whole_chunks = True  # it continues the exact chain walk's whole chunks

    def __init__(self, client: KVClient | None, cost: CostModel | None = None, *,
                 strategy: str = "hybrid", codec: str = "f16", objective: str = "ttft",
                 max_replans: int | None = None, publish: bool = False,
                 settings: StreamConfig | None = None) -> None:
        """`settings`: the client's timeouts and re-plans (default `StreamConfig.from_env()`);
        `max_replans` overrides its `max_replans`. `publish`: after a request
        that computed chunks here, ask the server (in the background, off the request path)
        to precompute its prompt, so that the next device that sends it streams them."""
        if strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be hybrid, local or stream, not {strategy!r}")
        self.client, self.strategy, self.publish = client, strategy, publish
        self.published = self.publish_failures = 0
        self._published_keys: set[str] = set()
        self._publishing: list[threading.Thread] = []
        self.cost = cost or CostModel()
        self.codec, self.objective = codec, objective
        self.settings = settings or StreamConfig.from_env()
        self.max_replans = self.settings.max_replans if max_replans is None else max_replans
        self.fingerprint = ""
        self.server_ok: str | None = None  # reason streaming is off, if it is
        self.rtt_measured_s: float | None = None  # the /v1/info round trip, once measured
        self.setup_s: float | None = None  # how long the background check + session took
        self._ready = threading.Event()
        self._attached = False

    @classmethod
    def connect(cls, url: str, secret: bytes, *, tenant: str = "", fingerprint: str | None = None,
                link: tuple[float, float] | None = None, timeout_s: float | None = None,
                publish: bool = True) -> HybridLoader:
        """A loader for the `edgekv kv-server` at `url` (`secret`: its secret file's, or the
        tenant's where the server has tenants). `link` = (Mbit/s, RTT ms): shape the link in
        this process (`netem.Shaper`), to measure a slower network over loopback."""
        from .shaper import Shaper

        kw: dict[str, object] = {} if timeout_s is None else {"timeout_s": timeout_s}
        shaper = None if link is None else Shaper(bandwidth_mbps=link[0], rtt_ms=link[1])
        return cls(KVClient(url, secret, tenant=tenant, fingerprint=fingerprint, shaper=shaper,
                            **kw),  # type: ignore[arg-type]
                   publish=publish)

    def attach(self, adapter: KVAdapter, config: CacheConfig) -> None:
        """Bind to the `EdgeKV` it serves (once): its model and chunk size are what the server
        is checked against, on a background thread that starts now."""
        if self._attached:
            raise ConfigError("a HybridLoader serves one EdgeKV; build one per cache")
        self._attached = True
        self.config, self.fingerprint = config, adapter.fingerprint.digest
        # the chain the server's tenant owns: only requests keyed in it can stream (and
        # publish); another tenant's request computes here, as with no server
        self.root = tenant_root(self.fingerprint, self.client.tenant if self.client else "",
                                KV_SERVER_TENANTS)
        if self.client is None:
            self._ready.set()
        else:
            threading.Thread(target=self._setup, args=(self.client,), daemon=True,
                             name="edgekv-kv-setup").start()

    def _setup(self, client: KVClient) -> None:
        """Off the request path: check the server (model, chunk size), measure the round trip
        (the planner's RTT) and open the session the first stream will use."""
        t0 = time.perf_counter()
        try:
            info = client.info()
            self.rtt_measured_s = time.perf_counter() - t0
            self.cost.observe_rtt(self.rtt_measured_s)
            if info.get("fingerprint") != self.fingerprint:
                self.server_ok = (f"server model {str(info.get('fingerprint'))[:12]} "
                                  f"differs from this device's {self.fingerprint[:12]}")
                log.warning("KV server refused: %s; computing locally", self.server_ok)
            elif info.get("chunk_size") != self.config.chunk_size:
                self.server_ok = (f"server chunks are {info.get('chunk_size')} tokens, this "
                                  f"device uses {self.config.chunk_size}")
                log.warning("KV server refused: %s; computing locally", self.server_ok)
            else:
                client.open_session()
        except TransportError as e:
            self.server_ok = self.server_ok or f"server unreachable: {e}"
            log.warning("KV server unreachable (%s); computing locally", e)
        finally:
            self.setup_s = time.perf_counter() - t0
            self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the background server check (a caller that wants measured estimates before
        its first request, e.g. a benchmark). True once it has finished."""
        return self._ready.wait(timeout)

    def await_setup(self) -> None:
        """On a stream's thread: wait for the server check; raise if streaming is off."""
        assert self.client is not None
        if not self._ready.wait(2 * self.client.timeout_s + 1.0):
            raise TransportError("KV server check did not finish; computing locally")
        if self.server_ok:
            raise TransportError(self.server_ok)

    def stats(self) -> dict[str, float]:
        """For /metrics: whether streaming is on (the server check passed; 0 while it runs or
        after it failed), and the prompts published to the server (and failed)."""
        return {"server_up": float(self._ready.is_set() and self.streaming),
                "published": float(self.published),
                "publish_failures": float(self.publish_failures)}

    @property
    def streaming(self) -> bool:
        return self.client is not None and self.server_ok is None

    def fill(self, request: FillRequest) -> Filled:
        """`request.FillStep`: plan the chunks after what the engine holds, then run the plan;
        the `HybridResult` is the `Filled.report`."""
        res = HybridResult(strategy=self.strategy)
        if request.request.root != self.root:  # nothing of its chain is on the server
            res.fallback = "the request's tenant chain is not the KV server tenant's"
            res.handed_back, res.local_chunks = True, request.held // request.chunk_size
            res.computed_chunks = request.n_chunks - res.local_chunks
            return Filled(request.held, report=res)
        filled = self._fill(request, res.strategy, res)
        if self.publish and self.streaming and res.computed_chunks:
            self._publish(request)
        return replace(filled, report=res)

    def _publish(self, req: FillRequest) -> None:
        """Ask the server to hold this prompt's chunks (once per prompt, unless it holds them
        already), on a thread."""
        last = req.keys[req.n_chunks - 1] if req.n_chunks else None
        if last is None or last in self._published_keys or self.client is None:
            return
        self._published_keys.add(last)
        client, tokens = self.client, list(req.tokens)
        keys = list(req.keys[: req.n_chunks])

        def run() -> None:
            try:
                if all(client.has(keys)):  # it holds them (computed here by the plan's choice)
                    return
                client.precompute(tokens, timeout_s=PUBLISH_TIMEOUT_S)
                self.published += 1
            except TransportError as e:
                self.publish_failures += 1
                self._published_keys.discard(last)
                log.warning("KV server precompute failed (%s); the next device computes", e)

        t = threading.Thread(target=run, daemon=True, name="edgekv-kv-publish")
        self._publishing = [p for p in self._publishing if p.is_alive()] + [t]
        t.start()

    def close(self) -> None:
        """Wait (up to `PUBLISH_TIMEOUT_S` in all) for publishes still running, so that a
        one-shot `edgekv generate --kv-server` leaves its prompt on the server."""
        deadline = time.monotonic() + PUBLISH_TIMEOUT_S
        for t in self._publishing:
            t.join(max(0.0, deadline - time.monotonic()))

    # -- execution -----------------------------------------------------------------------

    def _fill(self, req: FillRequest, strategy: str, res: HybridResult) -> Filled:
        """Plan the chunks after what the engine holds, then run the plan."""
        n, held = req.n_chunks, req.held // req.chunk_size
        res.local_chunks = held
        flags = [i < held for i in range(n)]
        stream_ok = self.streaming and strategy != "local"
        if not stream_ok or strategy == "stream":
            rest = STREAM if stream_ok else COMPUTE
            actions = [LOCAL if f else rest for f in flags]
        else:
            t = time.perf_counter()
            res.plan = plan(n, flags, [True] * n, req.chunk_size
                            * req.adapter.fingerprint.kv_bytes_per_token, self.cost,
                            objective=self.objective)
            res.plan_s += time.perf_counter() - t
            actions = list(res.plan.actions)
        if not stream_ok and self.server_ok and strategy != "local":
            res.fallback = self.server_ok
        if strategy == "hybrid" and STREAM not in actions:
            # all-compute: nothing to overlap, so the cache prefills the rest as it would with
            # no streaming at all (one call, its own batch schedule): no cost over local
            res.handed_back, res.computed_chunks = True, n - held
            res.executed = "L" * held + "C" * (n - held)
            return Filled(req.held)
        run = _Run(req, actions, res, patient=strategy == "stream",
                   adaptive=strategy == "hybrid", pos=held, trace=["L"] * held)
        self._start(run, [i for i in range(held, n) if actions[i] == STREAM])
        while run.pos < n:
            self._drain(run)
            if run.pos in run.got:
                self._append_arrived(run)
            elif not self._wait(run):
                self._compute(run)
        if run.stream is not None:
            run.stream.cancelled = True
        res.executed = "".join(run.trace)
        # quantized chunks are not this request's exact KV: nothing computed on them is stored
        return Filled(n * req.chunk_size, res.streamed_chunks * req.chunk_size,
                      exact=self.codec == "f16" or res.streamed_chunks == 0)

    def _start(self, run: _Run, idx: list[int]) -> None:
        run.stream = (_CheckedStream(self, self.client, [(i, run.req.keys[i]) for i in idx],
                                     self.codec)
                      if idx and self.client is not None else None)

    def _give_up(self, run: _Run) -> None:
        """Stop streaming for this request: every chunk still ahead is computed."""
        run.dead = True
        if run.stream is not None:
            run.stream.cancelled = True
            run.stream = None

    def _drain(self, run: _Run) -> None:
        """Take in whatever has arrived."""
        while run.stream is not None:
            try:
                item = run.stream.q.get_nowait()
            except queue.Empty:
                return
            self._take(run, item)

    def _take(self, run: _Run, item: object) -> None:
        """Record one queue item; a sentinel or an error ends the current stream."""
        res, stream = run.res, run.stream
        assert stream is not None
        if isinstance(item, BaseException) or item is None:
            if item is not None:
                res.fallback = f"{type(item).__name__}: {item}"
                log.warning("KV stream failed (%s); computing the remaining chunks locally",
                            item)
            self.cost.observe_failure(item is not None)
            run.dead = run.dead or item is not None
            run.stream, run.last_at = None, 0.0
            return
        i, rec = cast("tuple[int, Received]", item)
        stream.pending = [k for k in stream.pending if k != i]
        res.wire_bytes += rec.wire_bytes
        res.stream_s += rec.at_s - (run.last_at if run.last_at else 0.0)
        if rec.fragment is None:
            return
        try:
            run.req.check(rec.fragment, i)
        except (ChunkRejected, IncompatibleFragment) as e:
            res.fallback = f"chunk {i} rejected: {e}"
            log.warning("streamed chunk %d rejected (%s); computing it locally", i, e)
            return
        # the first chunk's time includes the request's round trip (estimated from the small
        # calls); later chunks' inter-arrival times are pure transfer
        gap = rec.at_s - (run.last_at if run.last_at else self.cost.rtt_s)
        if gap <= 1e-4 and not run.last_at:
            # it came sooner than the round-trip estimate (which includes connection setup):
            # its whole arrival time bounds the transfer, so the link is at least that fast
            gap = rec.at_s
        self.cost.observe_transfer(rec.wire_bytes, gap)
        self.cost.observe_wire_ratio(rec.wire_bytes, rec.fragment.nbytes)
        run.got[i] = rec.fragment
        run.last_at = rec.at_s

    def _append_arrived(self, run: _Run) -> None:
        """Append the run of arrived chunks that starts at `pos` to what the engine holds."""
        end = run.pos
        while end in run.got:
            end += 1
        frags = [run.got.pop(i) for i in range(run.pos, end)]
        try:
            run.req.adapter.append_fragments(frags)
        except (IncompatibleFragment, EdgeKVError) as e:
            run.res.fallback = f"streamed chunks refused by the engine: {e}"
            log.warning("%s; computing them locally", run.res.fallback)
            self._give_up(run)
            self._recover(run)
            return
        run.res.streamed_chunks += end - run.pos
        run.trace += ["S"] * (end - run.pos)
        run.pos = end

    def _recover(self, run: _Run) -> None:
        """An append is refused without touching the context; should an engine lose it all
        the same, its chunks [0, pos) are computed again (chunk-aligned, as they were)."""
        a, c = run.req.adapter, run.req.chunk_size
        if a.n_tokens != run.pos * c:
            log.warning("the engine lost its context; recomputing %d chunks", run.pos)
            a.clear_kv_cache()
            if run.pos:
                a.prefill(run.req.tokens[: run.pos * c], align=c)

    def _wait(self, run: _Run) -> bool:
        """Wait a little for chunk `pos` if it is on the wire and predicted to land before
        computing it would end (always, when patient). False: compute it now."""
        s, pos = run.stream, run.pos
        if run.dead or s is None or run.actions[pos] != STREAM or pos not in s.pending:
            return False
        assert self.client is not None
        ahead = [i for i in s.pending if i <= pos and i not in run.got]
        wait = self.cost.transfer_s(self.cost.wire_bytes(len(ahead) * run.chunk_bytes))
        since = run.waiting_since.setdefault(pos, time.perf_counter())
        # how long this chunk may keep the device idle: a trickling server never trips the
        # per-read timeout, so the wait itself has a deadline
        timeouts = (self.settings.patient_wait_timeouts if run.patient
                    else self.settings.wait_timeouts)
        budget = timeouts * self.client.timeout_s + 2 * wait
        if time.perf_counter() - since > budget:
            run.res.fallback = f"chunk {pos} not delivered within {budget:.1f}s"
            log.warning("%s; computing the rest locally", run.res.fallback)
            self._give_up(run)
            return False
        if not (run.patient or wait < self.cost.compute_s(pos)):
            return False
        if not run.patient and self._overdue(run, pos, wait):
            return False
        try:
            self._take(run, s.q.get(timeout=max(0.05, min(2 * wait + 0.05,
                                                           self.client.timeout_s))))
        except queue.Empty:
            pass
        return True

    def _compute(self, run: _Run) -> None:
        """Prefill chunk `pos` on the device (chunk-aligned), then re-plan if that helps."""
        a, c, pos = run.req.adapter, run.req.chunk_size, run.pos
        t = time.perf_counter()
        a.prefill(run.req.tokens[pos * c : (pos + 1) * c], align=c)
        self.cost.observe_prefill(pos, time.perf_counter() - t)
        run.res.computed_chunks += 1
        run.trace.append("C")
        run.pos += 1
        if (run.adaptive and run.stream is None and not run.dead and self.streaming
                and run.res.replans < self.max_replans
                and any(run.actions[i] == COMPUTE for i in range(run.pos + 1, run.n))):
            self._replan(run)

    def _replan(self, run: _Run) -> None:
        """The stream is done and compute is still ahead: re-plan the rest from measurements."""
        pos, n = run.pos, run.n
        rest = list(range(pos + 1, n))
        flags = [i <= pos for i in range(n)]  # chunk `pos` is being computed next: treat as held
        t = time.perf_counter()
        p = plan(n, flags, [True] * n, run.chunk_bytes, self.cost, objective=self.objective)
        run.res.plan_s += time.perf_counter() - t
        run.actions = run.actions[: pos + 1] + [p.actions[i] for i in rest]
        streamed = [i for i in rest if run.actions[i] == STREAM]
        self._start(run, streamed)
        if run.stream is not None:
            run.res.replans += 1
            log.info("re-planned at chunk %d: streaming %s", pos, streamed)

    def _overdue(self, run: _Run, pos: int, wait: float) -> bool:
        """Chunk `pos` was expected (its transfer, plus the round trip if nothing has arrived
        on this stream yet) and has been waited on for half a compute time longer: the link
        is slower than estimated. Lower the estimate to what the wait proves, drop the stream,
        compute this chunk and re-plan the rest (it may stream again, at the new estimate)."""
        s = run.stream
        assert s is not None
        expected = wait + (0.0 if run.last_at else self.cost.rtt_s)
        waited = time.perf_counter() - run.waiting_since[pos]
        if waited <= expected + 0.5 * self.cost.compute_s(pos):
            return False
        # since the last arrival (or the request) at least one chunk's bytes have not come
        since = time.perf_counter() - s.t0 - (run.last_at or self.cost.rtt_s)
        self.cost.observe_transfer(self.cost.wire_bytes(run.chunk_bytes), max(since, 1e-3))
        log.info("chunk %d overdue after %.3fs (expected %.3fs): computing it, re-planning",
                 pos, waited, expected)
        s.cancelled = True
        run.stream, run.last_at = None, 0.0
        run.res.switched += 1
        for i in range(pos, run.n):  # what has not arrived is now computed, until re-planned
            if run.actions[i] == STREAM and i not in run.got:
                run.actions[i] = COMPUTE
        return True


class _CheckedStream(BackgroundStream):
    """A `BackgroundStream` that first waits, on its own thread, for the loader's server check
    (so a stream planned before the check finished never delays the device)."""

    def __init__(self, loader: HybridLoader, client: KVClient,
                 keys: Sequence[tuple[int, str]], codec: str) -> None:
        self._loader = loader  # set before the thread starts
        super().__init__(client, keys, codec)

    def _run(self, client: KVClient, keys: Sequence[tuple[int, str]], codec: str) -> None:
        try:
            self._loader.await_setup()
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            self.q.put(e)
            return
        super()._run(client, keys, codec)
