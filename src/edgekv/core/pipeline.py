"""The orchestrator: find reusable KV, inject it, prefill the rest, generate, store.

Strict by default: KV is injected only where the model fingerprint, the chain of prefix keys
and the token ids all match the request (see `lookup`), so a warm request produces the same
logits as a cold one. How far reuse may go depends on the engine, measured once by the
batch-invariance probe (`engines.probe`): where the engine computes the same numbers whatever
the batch shape, reuse ends at any token (the longest verified common prefix with anything
stored), prefill runs in one batch like a plain user of the engine, and the KV of trailing
partial chunks and of generated tokens is stored for the next turn; the output then equals a
plain cold run of the engine bit for bit. Where it does not, reuse is whole chunks and prefill
runs in chunk-aligned batches, so a chunk's KV comes from the same batch shape warm or cold
(the output equals EdgeKV's own aligned cold run). Approximate reuse (the
EdgeSync seed's "inject on similarity") must be asked for, is labelled in every result, and
never writes fragments: KV computed on top of another prompt's KV is not this prompt's KV.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import CacheConfig
from ..engines.base import Generation, KVAdapter, SharedCPU, TokenCallback, WindowedKV
from ..engines.probe import (
    ProbeFinisher,
    ProbeResult,
    finish_later,
    load_or_probe,
    speculation_check,
)
from ..engines.probe import finish_probe as finish_pending
from ..engines.probe import record as record_probe
from ..engines.spec import Speculation
from ..errors import (
    Cancelled,
    ChunkRejected,
    ConfigError,
    EdgeKVError,
    EngineError,
    IncompatibleFragment,
)
from ..fragment import KVFragment
from ..keys import KV_SERVER_TENANTS, ChunkKey, chunk_keys, tenant_root
from ..store.base import FragmentStore
from .fill import LocalPrefill, PassagePlacement
from .match import Chunk, ChunkReader, PrefixMatch, PrefixMatcher, Router
from .passages import PassageReuse
from .prefix_index import PrefixIndex
from .request import (
    Filled,
    FillRequest,
    FillStep,
    GenerationResult,
    PrefetchHook,
    Request,
    RequestOptions,
    Sampling,
    prepare_tokens,
)
from .writeback import Writeback

__all__ = ["EdgeKV", "GenerationResult", "PrefetchHook", "PrefixMatch", "Request"]

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..semantic.router import Route

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Times:
    """When each step of one generation ended (`time.perf_counter`); `looked_up` is the end
    of the lookup less the time spent waiting for another generation's chunks (`waited`)."""

    start: float
    looked_up: float
    waited: float
    injected: float
    prefilled: float
    first: float
    generated: float
    stored: float


INFLIGHT_TIMEOUT_S = 30.0  # the longest a generation waits for another's prompt chunks
WAIT_POLL_S = 0.05  # how often a waiting generation looks whether it was cancelled


@dataclass(eq=False)
class _Claim:
    """Prompt chunks one generation computes (`EdgeKV._claim`): `done` once they are stored
    or the generation ended; `waiters`, the generations that wait for it."""

    done: threading.Event = field(default_factory=threading.Event)
    waiters: int = 0


class EdgeKV:
    """Prefix KV reuse over one engine adapter, one (tiered) store and an optional router."""

    inflight_timeout_s = INFLIGHT_TIMEOUT_S  # the longest a wait for another's chunks lasts

    def __init__(self, adapter: KVAdapter, store: FragmentStore,
                 config: CacheConfig | None = None, *, router: Router | None = None,
                 prefetcher: PrefetchHook | None = None, prefetch: bool = False,
                 fill: FillStep | None = None, staged_probe: bool = False) -> None:
        """`router`: semantic routing (`semantic.SemanticRouter`); `prefetch`: the n-gram
        prefetcher (`prefetch.Prefetcher`, or your own `prefetcher`); `fill`: the step between
        injection and prefill, e.g. SparKV's `stream.hybrid.HybridLoader` (default: local
        prefill, or passage placement with `config.passage_reuse`); `staged_probe`: where no
        whole probe answer is recorded, run its short stage only and start with whole-chunk
        reuse; `probe_pending` then says so, and `adopt_probe` takes the finished answer."""
        self.adapter, self.store = adapter, store
        self.config = config or CacheConfig()
        self.router = router
        if prefetch and prefetcher is None:
            from .prefetch import Prefetcher

            prefetcher = Prefetcher(self.warm_chain)
        self.prefetcher = prefetcher
        self.fingerprint = adapter.fingerprint.digest
        # sliding-window models (`LlamaCppAdapter.window`): a hit reads the local layers of
        # the last window's chunks only
        win = adapter.window if isinstance(adapter, WindowedKV) else None
        self.reader = ChunkReader.for_model(
            store, adapter.fingerprint, self.config.layers_per_fragment,
            local_layers=win.swa_layers if win else (), window=win.n_swa if win else 0)
        self.probe, self.granularity_reason = self._probe(staged_probe)
        # reuse ends at any token, prefill runs in one batch, tails and answers are stored
        self.token_exact = self.probe is not None and self.probe.invariant
        if not self.token_exact:
            log.info("reuse is whole %d-token chunks (%s)", self.config.chunk_size,
                     self.granularity_reason)
        # the chains' shape: matched, inserted and evicted (leaves first) in one place
        self.index = PrefixIndex(store, self.fingerprint, self.reader.layouts,
                                 chunk_size=self.config.chunk_size, policy=self.config.eviction)
        self.matcher = PrefixMatcher(
            self.reader, self.index, self.config.chunk_size, token_exact=self.token_exact,
            partial_reuse=self.config.partial_reuse,
            min_reuse_tokens=self.config.min_reuse_tokens, router=router)
        self.writeback = Writeback(adapter, self.reader, self.index, self.config,
                                   router=router, token_exact=self.token_exact)
        if router is not None:
            store.add_remove_listener(self.writeback.on_store_remove)
        # opt-in; refused here, with the reason, on engines/models that cannot shift KV
        self.passages = (PassageReuse(adapter, store, self.config)
                         if self.config.passage_reuse else None)
        self.fill: FillStep = self._fill_step(fill)
        # generations on several sequences at once (`generate(sequence=...)`) take turns in
        # the steps that read and write the cache, store, index and router
        self._steps = threading.RLock()
        # prompt chunks a generation on a sequence is computing, by chain key: another that
        # needs one waits for it instead of computing it too (`_claim`)
        self._computing: dict[str, _Claim] = {}
        self.inflight_waits = 0  # generations that waited for another's prompt chunks
        self.inflight_wait_s, self.inflight_timeouts = 0.0, 0  # how long; waits given up
        # speculative decoding, decided now (the engine is idle) and again when a staged
        # probe's answer is adopted: `speculation`, and why it is on or off
        self.speculation: Speculation | None = None
        self.speculation_reason = ""
        self._decide_speculation()

    def _fill_step(self, fill: FillStep | None) -> FillStep:
        """The fill step, chosen once (see `request.FillStep`): the one given, else passage
        placement where passage reuse is on, else local prefill."""
        if fill is not None and self.passages is not None:
            raise ConfigError("passage reuse and a fill step (SparKV loading from a KV server, "
                              "--kv-server) do not combine yet; use one of them")
        step = fill or (PassagePlacement(self.passages) if self.passages else LocalPrefill())
        step.attach(self.adapter, self.config)
        return step

    def _probe(self, staged: bool) -> tuple[ProbeResult | None, str]:
        """The batch-invariance probe's recorded answer (or a new one), and why the reuse
        granularity is what it is."""
        if self.config.reuse_granularity != "auto":
            return None, "configured: reuse_granularity=chunk"
        try:
            probe = load_or_probe(self.adapter, self.config.cache_dir / "probes", staged=staged)
        except EdgeKVError as e:  # e.g. a state layout the probe cannot read
            log.warning("batch-invariance probe could not run (%s); whole-chunk reuse", e)
            return None, f"batch-invariance probe could not run: {e}"
        return probe, probe.reason

    # -- public API ----------------------------------------------------------------------

    @property
    def granularity(self) -> str:
        """"token": reuse ends at any token; "chunk": whole chunks only (see the module doc)."""
        return "token" if self.token_exact else "chunk"

    @property
    def probe_pending(self) -> tuple[str, ...]:
        """The probe's stages still to run (a staged start); () once it is whole."""
        return self.probe.pending if self.probe is not None else ()

    def adopt_probe(self, result: ProbeResult) -> bool:
        """Take the finished probe answer of a staged start (`engines.probe.finish_probe`):
        where it passed, reuse ends at any token from the next request on; whether it did.
        Chunks stored meanwhile stay valid: where the kernels are batch-invariant, a chunk
        prefilled in chunk-aligned batches holds the KV a one-batch prefill computes."""
        if self.probe is None or result.key != self.probe.key or result.pending:
            raise ValueError("adopt_probe takes the finished probe of this cache's engine")
        with self._steps:
            self.probe, self.granularity_reason = result, result.reason
            self.token_exact = result.invariant
            self.matcher.token_exact = self.writeback.token_exact = result.invariant
            self._decide_speculation()
        log.info("batch-invariance probe finished: %s", result.reason)
        return result.invariant

    def finish_probe(self, *, background: bool = True,
                     then: Callable[[ProbeResult], object] | None = None
                     ) -> ProbeFinisher | None:
        """Run the probe stages a staged start left pending, record the answer and adopt it,
        then hand it to `then` (a server opens its slots there): in the background where the
        engine can open a second context (`Twinned`; the finisher returned), else here. None
        where nothing is pending or it ran here."""
        if self.probe is None or not self.probe.pending:
            return None
        probe_dir = self.config.cache_dir / "probes"

        def adopt(result: ProbeResult) -> None:
            self.adopt_probe(result)
            if then is not None:
                then(result)

        if background:
            finisher = finish_later(self.adapter, self.probe, probe_dir, adopt)
            if finisher is not None:
                return finisher
        result = finish_pending(self.adapter, self.probe)
        record_probe(probe_dir, result)
        adopt(result)
        return None

    def _decide_speculation(self) -> None:
        """`config.speculative` "ngram" turns speculative decoding on where the probe allows
        it (`engines.probe.speculation_check`); one `Speculation` (its measured step
        costs) is kept across decisions."""
        if self.config.speculative == "none":
            self.speculation, self.speculation_reason = None, "off (speculative=none)"
            return
        ok, why = speculation_check(self.adapter, self.probe)
        if ok:
            self.speculation = self.speculation or Speculation()
            self.speculation_reason = f"ngram drafts verified in one batch ({why})"
        else:
            log.warning("speculative decoding is off: %s", why)
            self.speculation, self.speculation_reason = None, f"off: {why}"

    @property
    def prefill_align(self) -> int:
        """Batch boundaries for prefill: one batch where the engine is batch-invariant (as a
        plain user runs it), else multiples of the chunk size."""
        return self.adapter.n_ctx if self.token_exact else self.config.chunk_size

    def chunk_keys(self, tokens: Sequence[int], salt: str = "",
                   namespace: str = KV_SERVER_TENANTS) -> list[ChunkKey]:
        """Chained keys of the full chunks of `tokens`, in the tenant `salt`'s own chain (of
        `namespace`, see `keys.tenant_root`)."""
        return self._keys(tokens, tenant_root(self.fingerprint, salt, namespace))

    def cached_chunks(self, keys: Sequence[str], now: float | None = None,
                      rejections: list[str] | None = None) -> list[Chunk]:
        """The exact chain walk (see `ChunkReader.walk`)."""
        return self.reader.walk(keys, time.time() if now is None else now,
                                [] if rejections is None else rejections)

    def prepare(self, prompt: str | Sequence[int],
                **options: Unpack[RequestOptions]) -> Request:
        """The only place a prompt is tokenized and validated: a `Request` for `generate`
        (or a KV server's precompute). Refused (`errors.PromptError`, by the context rule
        `limits.fit`) if it is empty, or if it and `max_tokens` more do not fit the context
        window; unknown options are a TypeError. Options: see `generate`."""
        unknown = set(options) - set(RequestOptions.__annotations__)
        if unknown:
            raise TypeError(f"unknown request option(s): {', '.join(sorted(unknown))}")
        o: dict[str, Any] = dict(options)
        sampling = Sampling(**{k: o[k] for k in Sampling.__dataclass_fields__ if k in o})
        use_cache = o.get("use_cache", True)
        root = tenant_root(self.fingerprint, o.get("salt", ""),
                           o.get("namespace", KV_SERVER_TENANTS))
        if o.get("passages") is not None:
            layout = self._passage_reuse().layout(prompt, o["passages"], sampling.max_tokens,
                                                  root)
            tokens = layout.tokens
        else:
            layout, tokens = None, prepare_tokens(self.adapter, prompt, sampling.max_tokens)
        text = prompt if isinstance(prompt, str) else None
        if text is None and self.router is not None and use_cache:
            text = self.adapter.detokenize(tokens)
        approximate = o.get("approximate")
        return Request(tuple(tokens), root, tuple(self._keys(tokens, root)), sampling, text,
                       use_cache, o.get("store", True),
                       self.config.approximate if approximate is None else approximate,
                       layout, o.get("passage_policy"), o.get("speculative"))

    def lookup(self, tokens: Sequence[int], text: str | None = None, *,
               approximate: bool | None = None, now: float | None = None,
               keys: Sequence[str] | None = None, salt: str = "",
               whole_chunks: bool = False,
               namespace: str = KV_SERVER_TENANTS) -> PrefixMatch:
        """What to restore for `tokens` (`PrefixMatcher.match_prefix`); `keys`: the tokens'
        chunk keys under `salt`, if already computed."""
        keys = self.chunk_keys(tokens, salt, namespace) if keys is None else keys
        return self.matcher.match_prefix(
            tokens, keys, tenant_root(self.fingerprint, salt, namespace), text=text, now=now,
            approximate=self.config.approximate if approximate is None else approximate,
            whole_chunks=whole_chunks)

    def generate(self, prompt: str | Sequence[int] | Request, *,
                 on_token: TokenCallback | None = None, sequence: KVAdapter | None = None,
                 cancelled: threading.Event | None = None,
                 **options: Unpack[RequestOptions]) -> GenerationResult:
        """Answer `prompt` (text, token ids, or a `Request` from `prepare`), reusing what the
        cache holds for it.

        Options (`request.RequestOptions`): sampling (`max_tokens`, `temperature`, `top_p`,
        `seed`, `keep_logits`, `constraint`: a grammar or logprob recorder that masks each
        step, never the KV); `use_cache=False` for a cold run, `store=False` to store nothing;
        `approximate` (default `config.approximate`: the seed's similarity injection,
        labelled); `salt`, a tenant whose prefixes sit in a chain of their own, named by
        `namespace` (`keys.tenant_root`); `passages` (with `config.passage_reuse`): texts
        placed before `prompt`, their cached KV reused wherever they sit (approximate,
        labelled). `on_token` sees each token as it comes; returning False stops.

        `sequence`: one of a server's engine slots (`parallel.Slots`) to run on instead of
        `adapter`: generations then run at once, batched; the cache's own steps take turns,
        and one whose prompt's next chunk another is computing waits for it, then reuses it
        ("prompt chunks in flight" below). `cancelled`, once set, ends such a wait with
        `Cancelled` (the client went away)."""
        t0 = time.perf_counter()
        req = self._request(prompt, options)
        a = sequence or self.adapter
        # decided before the engine holds the request (a probe row measured now clears it)
        spec = self.speculation if req.speculative is not False else None
        claimed = _Claim()  # this generation's prompt chunks, while it computes them
        match: PrefixMatch | None = None
        try:
            match, cached, t_lookup, waited = self._match_inject(
                req, a, claimed if sequence else None, cancelled)
            t_inject = time.perf_counter()
            before = a.counters.snapshot()
            filled = self._fill(req, cached, a)
            logits = a.prefill(req.tokens[filled.held:], align=self.prefill_align)
            traffic = a.counters.since(before).traffic_bytes(a.weight_bytes,
                                                             a.fingerprint.kv_bytes_per_token)
            t_logits = time.perf_counter()
            commit_prompt, early, routed = self._early_commit(req, match, filled, cached, a,
                                                              claimed)
            gen, t_first = self._sample(logits, req.sampling, on_token, a,
                                        after_first=commit_prompt if sequence else None,
                                        speculation=spec)
            t_gen = time.perf_counter()
            if routed:  # the early commit routed it: the same route, not a second embedding
                match = routed[0]
            with self._cache_step(a):
                match, stored, written = self._commit(req, match, filled, cached, a)
        except BaseException:
            if match is not None:
                match.release()  # its pins: nothing reads the matched path any more
            raise
        finally:
            self._unclaim(claimed)
        times = _Times(t0, t_lookup - waited, waited, t_inject, t_logits, t_first, t_gen,
                       time.perf_counter() + early[2])
        return self._result(req, a, gen, match, cached, filled, logits, traffic,
                            stored + int(early[0]), written + int(early[1]), times)

    @contextmanager
    def _cache_step(self, a: KVAdapter) -> Iterator[None]:
        """One of the cache's own steps (a lookup and injection, a store): they take turns,
        and on a server's slot they are CPU work beside the other slots' steps, which plan
        for it (`SharedCPU.aside`)."""
        with self._steps, (a.aside() if isinstance(a, SharedCPU) else nullcontext()):
            yield

    def _request(self, prompt: str | Sequence[int] | Request,
                 options: RequestOptions) -> Request:
        if not isinstance(prompt, Request):
            return self.prepare(prompt, **options)
        if options:
            raise TypeError("a prepared Request carries its options; give none here")
        return prompt

    def _early_commit(self, req: Request, match: PrefixMatch, filled: Filled, cached: int,
                      a: KVAdapter, claimed: _Claim
                      ) -> tuple[Callable[[], None], list[float], list[PrefixMatch]]:
        """What runs after the first token of a generation on a slot: where others wait for
        this prompt's chunks, they are stored now, not after the answer, with the route
        semantic routing gives the prompt (as `_commit` stores its chunks). The first list
        counts what it stored: fragments, bytes, seconds; the second holds the match with
        its route, once routed."""
        early = [0.0, 0.0, 0.0]
        routed: list[PrefixMatch] = []

        def commit_prompt() -> None:
            with self._cache_step(a):
                if claimed.waiters and not claimed.done.is_set():
                    t = time.perf_counter()
                    got = self._route(req, match)
                    routed.append(got)
                    early[:2] = self._commit_prompt(req, got, filled, cached, a)
                    early[2] = time.perf_counter() - t
                self._unclaim(claimed)

        return commit_prompt, early, routed

    def _route(self, req: Request, match: PrefixMatch) -> PrefixMatch:
        """`match` with the route semantic routing gives the request (for reporting and for
        the stored chunks' index entries), where a router runs and it has none yet."""
        if (self.router is not None and req.use_cache and req.text is not None
                and match.route is None):
            return match.with_route(self.router.route(req.text))
        return match

    @staticmethod
    def _result(req: Request, a: KVAdapter, gen: Generation, match: PrefixMatch, cached: int,
                filled: Filled, logits: np.ndarray, traffic: int, stored: int, written: int,
                t: _Times) -> GenerationResult:
        return GenerationResult(
            text=a.detokenize(gen.tokens), tokens=gen.tokens, prompt_tokens=len(req.tokens),
            cached_tokens=cached,
            computed_tokens=len(req.tokens) - cached - filled.streamed - filled.placed,
            ttft_s=t.first - t.start, total_s=t.generated - t.start,
            lookup_s=t.looked_up - t.start, inject_s=t.injected - t.looked_up - t.waited,
            prefill_s=t.prefilled - t.injected, store_s=t.stored - t.generated,
            stored_fragments=stored,
            kv_bytes_read=sum(f.nbytes for f in match.fragments) if cached else 0,
            kv_bytes_written=written, prefill_traffic_bytes=traffic, first_logits=logits,
            match=match, step_logits=gen.logits, finish_reason=gen.finish_reason,
            streamed_tokens=filled.streamed, passages=filled.passages,
            fill_report=filled.report, wait_s=t.waited, drafted_tokens=gen.drafted,
            accepted_tokens=gen.accepted)

    def warm_passages(self, passages: Sequence[str], scores: bool | None = None) -> int:
        """Cache passages ahead of the requests that cite them (RAG indexing time)."""
        return self._passage_reuse().warm(passages, scores)

    def _passage_reuse(self) -> PassageReuse:
        if self.passages is None:
            raise EdgeKVError("passages were given but passage reuse is off: set "
                              "CacheConfig(passage_reuse=True) / --passage-reuse")
        return self.passages

    def clear(self) -> int:
        n = self.store.clear()
        if self.router is not None:
            self.router.index.clear()
        self.writeback.save_index()
        return n

    def sweep(self, now: float | None = None) -> int:
        """Drop expired fragments (their index entries go with them)."""
        n = self.store.sweep(now)
        self.writeback.save_index()
        return n

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.fill.close()
        self.writeback.save_index()
        self.store.close()

    # -- the pipeline's steps (see `request`) ---------------------------------------------

    def _match(self, req: Request) -> PrefixMatch:
        """What to restore: the strict chain walk (and radix step, or approximate search);
        for a fill step that continues whole chunks, the whole chunks alone unless the match
        already covers every whole chunk of the prompt (nothing is left to stream); cut to a
        passage boundary where passages are placed (they are placed whole)."""
        if not req.use_cache:
            return PrefixMatch(0)

        def walk(whole_chunks: bool) -> PrefixMatch:
            return self.matcher.match_prefix(req.tokens, req.keys, req.root, text=req.text,
                                             approximate=req.approximate,
                                             whole_chunks=whole_chunks)

        match, c = walk(False), self.config.chunk_size
        if (self.fill.whole_chunks and match.n_tokens % c
                and match.n_tokens // c < (len(req.tokens) - 1) // c):
            match.release()
            match = walk(True)
        cut = req.layout.cut(match.n_tokens) if req.layout is not None else match.n_tokens
        if cut == match.n_tokens:
            return match
        if cut:
            return replace(match, n_tokens=cut)
        match.release()
        return PrefixMatch(0, rejections=match.rejections, token_exact=self.token_exact)

    def _match_inject(self, req: Request, a: KVAdapter, claimed: _Claim | None,
                      cancelled: threading.Event | None = None
                      ) -> tuple[PrefixMatch, int, float, float]:
        """Match and inject; with `claimed` (a generation on a sequence), first wait for any
        other generation computing the prompt's next chunk, and claim the chunks this one
        will compute. Returns the match, the tokens injected, when the match was made and
        how long the generation waited. A wait that brought nothing (the producer failed,
        or was slower than `inflight_timeout_s`) is not repeated: the generation computes
        the rest itself rather than queue behind another claim."""
        waited = 0.0
        waiting = claimed is not None and req.use_cache
        reached = -1  # what the match reached before the last wait
        while True:
            with self._cache_step(a):
                match = self._match(req)
                t_lookup = time.perf_counter()
                if waiting and reached >= 0 and match.n_tokens <= reached:
                    waiting = False  # the wait brought no chunk: compute it here
                busy = (self._computing.get(self._next_key(req, match.n_tokens))
                        if waiting else None)
                if busy is None:
                    cached = self._inject(match, a)
                    if cached != match.n_tokens:  # refused: the whole prompt is computed
                        match.release()
                        match = PrefixMatch(0, rejections=match.rejections,
                                            token_exact=self.token_exact)
                    if (claimed is not None and self._stores(req)
                            and match.batch_exact(self.config.chunk_size)):
                        self._claim(req, cached, claimed)
                    return match, cached, t_lookup, waited
                reached = match.n_tokens
                match.release()
                busy.waiters += 1
                self.inflight_waits += not waited  # a generation is counted once
            t_wait = time.perf_counter()
            try:
                self._wait(busy, cancelled)
            finally:
                with self._steps:
                    busy.waiters -= 1
                    waited += time.perf_counter() - t_wait
                    self.inflight_wait_s += time.perf_counter() - t_wait

    def _wait(self, busy: _Claim, cancelled: threading.Event | None) -> None:
        """Until `busy` ends, `inflight_timeout_s` passes (then the waiter computes for
        itself), or `cancelled` is set (raises `Cancelled`)."""
        deadline = time.perf_counter() + self.inflight_timeout_s
        while not busy.done.is_set():
            if cancelled is not None and cancelled.is_set():
                raise Cancelled("the request was cancelled while it waited for another "
                                "generation's prompt chunks")
            left = deadline - time.perf_counter()
            if left <= 0:
                self.inflight_timeouts += 1
                return
            busy.done.wait(min(left, WAIT_POLL_S))

    def _fill(self, req: Request, cached: int, a: KVAdapter) -> Filled:
        """The fill step chosen at construction; one that continues whole chunks runs only
        where the injected prefix ends on a chunk boundary."""
        c = self.config.chunk_size
        if self.fill.whole_chunks and cached % c:
            return Filled(cached)
        return self.fill.fill(FillRequest(a, req, c, cached, self._chunk_check(req)))

    def _sample(self, logits: np.ndarray, s: Sampling, on_token: TokenCallback | None,
                a: KVAdapter, *, after_first: Callable[[], None] | None = None,
                speculation: Speculation | None = None) -> tuple[Generation, float]:
        """Sample the answer; also the time of the first token. TTFT stops where a streaming
        client's clock stops: at the first sampled token, as text (what llama-cpp-python's
        and llama-server's first streamed chunk carries). `after_first` runs once the first
        token has been handed on. `speculation`: verify n-gram drafts in one batch (the same
        tokens: `engines.spec`)."""
        first = list[float]()

        def timed(tok: int) -> bool:
            if first:
                return True if on_token is None else on_token(tok)
            a.detokenize([tok])
            first.append(time.perf_counter())
            go = True if on_token is None else on_token(tok)
            if after_first is not None:
                after_first()
            return go

        extra: dict[str, Any] = {} if s.constraint is None else {"constraint": s.constraint}
        if speculation is not None:
            extra["speculation"] = speculation
        gen = a.generate(logits, s.max_tokens, temperature=s.temperature, seed=s.seed,
                         keep_logits=s.keep_logits, top_p=s.top_p, on_token=timed, **extra)
        return gen, first[0] if first else time.perf_counter()  # EOS alone: its end

    # -- prompt chunks in flight (generations on several sequences at once) ---------------
    #
    # Requests that arrive together often share a prefix (a deployment's system prompt) that
    # no one has stored yet. Each would compute it, beside the others, in one batch. Instead
    # the first claims the prompt chunks it computes, and a request whose next chunk is
    # claimed waits. Once the first token is out the claim ends: where someone waits, the
    # prompt's chunks are stored first (`_commit_prompt`), and the waiting match again and
    # reuse them. Where no one waits, nothing is stored before the last token, which would
    # only delay the second token. Chain keys name a chunk and everything before it, so a
    # waiting request computes only what differs. Waiting costs it nothing a batch would
    # have given it: the slots take prompt pieces in arrival order, so its own would have
    # waited for the first prompt anyway. A claim is dropped whatever happens to the
    # generation (`finally`), so a failed one leaves its waiters to compute for themselves.

    def _next_key(self, req: Request, matched: int) -> str:
        """The chain key of the first prompt chunk past `matched` tokens ("" where none:
        never claimed)."""
        i = matched // self.config.chunk_size
        return str(req.keys[i]) if i < len(req.keys) else ""

    def _stores(self, req: Request) -> bool:
        return req.store and req.use_cache and req.layout is None

    def _claim(self, req: Request, cached: int, claimed: _Claim) -> None:
        for key in req.keys[cached // self.config.chunk_size:]:
            self._computing.setdefault(str(key), claimed)

    def _unclaim(self, claimed: _Claim) -> None:
        if claimed.done.is_set():
            return
        with self._steps:
            for key in [k for k, c in self._computing.items() if c is claimed]:
                del self._computing[key]
        claimed.done.set()

    def _commit_prompt(self, req: Request, match: PrefixMatch, filled: Filled, cached: int,
                       a: KVAdapter) -> tuple[int, int]:
        """Store the prompt's whole chunks past the reuse, as `_commit` would (the rest of
        its commit, the trailing tokens and the answer, waits for the last token). Returns
        (fragments, bytes)."""
        if not (match.batch_exact(self.config.chunk_size) and filled.exact):
            return 0, 0
        n = len(req.keys) * self.config.chunk_size
        return self.writeback.store_new(req.tokens[:n], cached, req.keys, match.route,
                                        root=req.root, engine=a)

    def _commit(self, req: Request, match: PrefixMatch, filled: Filled, cached: int,
                a: KVAdapter) -> tuple[PrefixMatch, int, int]:
        """After the last token: route (for reporting and indexing), store what is new and
        exact, cache passages seen for the first time, record hits, unpin, tell the
        prefetcher. Returns the match (with its route) and (fragments, bytes) stored."""
        match = self._route(req, match)
        stored = written = 0
        # KV computed on top of reuse that was not batch-exact is not what a cold run would
        # hold, so it is never stored (it would spread the difference to later requests)
        if (req.store and req.use_cache and match.batch_exact(self.config.chunk_size)
                and filled.exact and req.layout is None):
            seq, keys = list(req.tokens), list(req.keys)
            if self.token_exact:  # the answer's KV too: the next turn's prompt holds it
                held = a.token_ids  # prompt + answer, less the last sampled token
                if len(held) > len(seq) and held[: len(seq)] == seq:
                    seq, keys = held, self._keys(held, req.root)
            stored, written = self.writeback.store_new(seq, cached, keys, match.route,
                                                       req.root, engine=a)
        if req.layout is not None and req.store and req.use_cache and self.passages:
            self.passages.store_missing(req.layout)  # passages seen first here, computed alone
        self.writeback.record_hits(match)
        match.release()  # its answer is stored: the matched path may be evicted again
        if self.prefetcher is not None and req.use_cache:
            # a request's signature: its deepest full chunk, which names its context
            self.prefetcher.observe(req.keys[-1] if req.keys else None)
        return match, stored, written

    # -- private helpers -----------------------------------------------------------------

    def _keys(self, tokens: Sequence[int], root: str) -> list[ChunkKey]:
        return chunk_keys(self.fingerprint, tokens, self.config.chunk_size, root)

    def _chunk_check(self, req: Request) -> Callable[[KVFragment, int], None]:
        """`FillRequest.check`: a fragment from elsewhere (a KV server) must be chunk i of
        this request, whole: chain key and its hash, model, every layer, KV widths and dtype,
        token range and ids."""
        c, fp = self.config.chunk_size, self.adapter.fingerprint
        tokens, keys = req.tokens, req.keys

        def check(frag: KVFragment, i: int) -> None:
            self.reader.verify(frag, keys[i], 0, fp.n_layer, None)
            widths = (frag.keys.shape[2], frag.values.shape[2], frag.kv_dtype)
            if widths != (fp.n_embd_k, fp.n_embd_v, fp.kv_dtype):
                raise ChunkRejected(f"chunk {i} has KV widths/dtype {widths[0]}/{widths[1]}/"
                                    f"{widths[2]}, the engine {fp.n_embd_k}/{fp.n_embd_v}/"
                                    f"{fp.kv_dtype}")
            if (frag.token_start != i * c
                    or not np.array_equal(frag.token_ids, tokens[i * c : (i + 1) * c])):
                raise ChunkRejected(f"chunk {i} does not hold the request's tokens")

        return check

    def _inject(self, match: PrefixMatch, a: KVAdapter) -> int:
        a.clear_kv_cache()
        if not match.chunks:
            return 0
        try:
            return a.inject_fragments(match.fragments, limit=match.n_tokens)
        except (IncompatibleFragment, EngineError) as e:
            log.warning("injection refused (%s); recomputing the whole prompt", e)
            a.clear_kv_cache()
            return 0

    def store_new(self, tokens: Sequence[int], cached: int, keys: Sequence[str],
                  route: Route | None = None, root: str = "") -> tuple[int, int]:
        """Store the chunks of `tokens` from `cached` on (the engine holds their KV); see
        `Writeback.store_new`. Returns (fragments, bytes)."""
        return self.writeback.store_new(tokens, cached, keys, route, root)

    def warm_chain(self, chain_key: str) -> int:
        """Bring the chunks of a chain (back to its start) into the RAM tier; return how many
        fragments were read. Used by the prefetcher's background thread."""
        return self.writeback.warm_chain(chain_key)

    def compact(self) -> object:
        from ..store.compactor import compact

        fp = self.adapter.fingerprint
        report = compact(self.store, n_layer=fp.n_layer, n_head_kv=fp.n_head_kv)
        self.writeback.save_index()
        return report

