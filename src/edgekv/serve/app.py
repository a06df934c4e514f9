"""The ASGI app: OpenAI's chat and text completions over the one request path, `EdgeKV.generate`.

`create_app` takes an EdgeKV that is already built (tests pass one over the fake engine) or a
function that builds it; the function runs on the worker thread after the socket is up, so
`GET /health` answers 503 while the model loads and 200 once it can serve. Requests are checked
(key, size, fields, model, context) before they are queued; what is left is the worker's.
With API keys, every route but `/health` and the page (`/`, `/ui/*`: no data; ui.py) needs one,
`/metrics` too: its prefix-cache counters move when other tenants' requests hit, a timing
channel that `cache_salt` exists to close.

EdgeKV's extensions (schemas.py, responses.py): `documents` (RAG passages, with
`--passage-reuse` only), `approximate: true` (with `ServeOptions.allow_approximate` only), the
`edgekv` object beside `usage`, and the `X-EdgeKV-Tier` header.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ..core.pipeline import EdgeKV
from ..core.prefetch import Prefetcher
from ..core.request import LinkStats, Sampling
from ..engines.base import KernelSettings, ModelFile
from ..engines.constraint import Grammar
from ..engines.probe import ProbeFinisher
from ..errors import ConfigError
from ..store.base import StoreStats
from ..store.tiered import TieredStore
from .errors import (
    CLIENT_GONE,
    APIError,
    api_error_response,
    bad_request,
    client_gone_response,
    http_error_response,
)
from .generation import Delta, Finished, ServedModel
from .guard import Tenant, authenticate, read_body, wait_disconnect
from .metrics import CONTENT_TYPE, CountResponses, ServeMetrics
from .responses import DONE, TIER_HEADER, CompletionShape, EventStream, sse
from .scheduler import Job, Scheduler
from .schemas import ChatRequest, CompletionRequest, parse_request
from .slots import PENDING, Slots, open_slots
from .structured import response_grammar
from .tools import ToolPlan, chat_prompt, plan_tools
from .ui import mount

__all__ = ["ServeOptions", "create_app"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    api_keys: tuple[str, ...] = ()  # empty: no authentication (loopback use); guard.api_keys
    max_queue: int = 16  # waiting requests per tenant before 429
    max_waiting: int | None = None  # waiting requests in all (default 4 x max_queue)
    max_body_bytes: int = 1 << 20  # a 2k-token context is ~10 KB of text; 1 MiB is generous
    use_cache: bool = True  # False: every request runs cold (the reference in benchmarks)
    allow_approximate: bool = False  # --approximate: a request may ask `"approximate": true`
    kv_tenant: str | None = None  # --kv-server: untenanted requests use this tenant's chain
    parallel: int = 1  # --parallel: requests generating at once, where batching is exact
    step_budget_s: float | None = 0.1  # --step-budget-ms: a batched step's prefill cut to fit
    ui: bool = True  # the page at / (ui.py); --no-ui: 404 there

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise ConfigError(f"parallel={self.parallel} must be >= 1")
        if self.step_budget_s is not None and self.step_budget_s <= 0:
            raise ConfigError(f"step_budget_s={self.step_budget_s} must be > 0 (None: off)")
        if self.max_queue < 1 or (self.max_waiting is not None and self.max_waiting < 1):
            raise ConfigError(f"max_queue={self.max_queue} (and max_waiting) must be >= 1")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes={self.max_body_bytes} is too small; use >= 1024")
        if any(not k.strip() for k in self.api_keys):
            raise ConfigError("an --api-key is empty; give non-empty keys")


def create_app(kv: EdgeKV | Callable[[], EdgeKV], *, model_id: str | None = None,
               options: ServeOptions = ServeOptions(),
               on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The app; `kv` is an EdgeKV or a loader. `model_id` (the name clients send) defaults to
    the model file's stem (`ModelFile`); a loader needs it, since /v1/models answers before
    loading ends."""
    if model_id is None:
        if not isinstance(kv, EdgeKV):
            raise ValueError("create_app with a loader needs model_id")
        model_id = kv.adapter.model_path.stem if isinstance(kv.adapter, ModelFile) else "edgekv"
    server = _Server(kv, model_id, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start(server.load, on_load_error)
        yield
        await asyncio.to_thread(server.close)

    app = FastAPI(title="edgekv serve", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.server = server
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/models/{name}", server.model, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_text, methods=["GET"])
    mount(app, server.metrics, options.api_keys, page=options.ui)  # /, /ui/*, /v1/edgekv/stats
    app.add_exception_handler(APIError, api_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, http_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, client_gone_response)
    app.add_middleware(CountResponses, metrics=server.metrics)
    return app


class _Server:
    """The app's state and handlers: one scheduler, one served model, one metrics registry."""

    def __init__(self, kv: EdgeKV | Callable[[], EdgeKV], model_id: str,
                 options: ServeOptions) -> None:
        self.options, self.model_id = options, model_id
        self.served: ServedModel | None = None
        self.slots: Slots | None = None  # what --parallel got (parallel.open_slots)
        self._probing: ProbeFinisher | None = None  # the probe's later stages (_serve)
        self._loader = None if isinstance(kv, EdgeKV) else kv
        self.scheduler = Scheduler(max_queue=options.max_queue,
                                   max_waiting=options.max_waiting,
                                   on_cancel=lambda stage: self.metrics.cancelled.labels(
                                       stage).inc())
        self.metrics = ServeMetrics(waiting=lambda: self.scheduler.waiting,
                                    running=lambda: self.scheduler.running,
                                    store_stats=self._store_stats,
                                    prefetch_stats=self._prefetch_stats,
                                    kv_server_stats=self._kv_server_stats,
                                    parallel_stats=self._parallel_stats,
                                    spec_stats=self._spec_stats)
        self.created = int(time.time())
        if isinstance(kv, EdgeKV):
            self._serve(kv)

    # -- lifecycle (worker thread / shutdown) --------------------------------------------

    def load(self) -> int:
        """Load the model (for the first worker), on a thread of its own that ends with the
        load; how many workers to run.

        Why a thread of its own: llama.cpp's OpenMP threads belong to the OS thread that ran
        the computation (here: the probe), and live as long as it does. With a second team
        computing (the slots' batching thread), libgomp counts more threads than cores and
        cuts the spinning of every barrier short: a decode step took 51.62 ms instead of
        10.47 on 2 cores until the loading thread was gone (docs/bench/slots-step.json)."""
        if self._loader is not None:
            loaded: list[EdgeKV] = []
            failed: list[BaseException] = []

            def run(loader: Callable[[], EdgeKV]) -> None:
                try:
                    loaded.append(loader())
                except BaseException as e:  # noqa: BLE001 - raised again on the worker
                    failed.append(e)

            thread = threading.Thread(target=run, args=(self._loader,),
                                      name="edgekv-serve-load")
            thread.start()
            thread.join()
            if failed:
                raise failed[0]
            self._serve(loaded[0])
        return 1 if self.slots is None else self.slots.count

    def _serve(self, kv: EdgeKV) -> None:
        self.slots = open_slots(kv, self.options.parallel,
                                step_budget_s=self.options.step_budget_s)
        self.served = ServedModel(kv, self.model_id, use_cache=self.options.use_cache,
                                  kv_tenant=self.options.kv_tenant,
                                  sequences=self.slots.sequences)
        if kv.router is not None:
            self.metrics.routing()
        if kv.probe_pending:  # a staged first start (runner.py): the rest in the background
            self._probing = kv.finish_probe(then=self._open_slots)

    def _open_slots(self, _probe: object) -> None:
        """The probe became whole (on its own thread): open the slots a staged start could
        not, and a worker for each; a job running now finishes where it started."""
        if self.slots is None or self.slots.reason != PENDING or self.served is None:
            return
        slots = open_slots(self.served.kv, self.options.parallel,
                           step_budget_s=self.options.step_budget_s)
        log.warning("the probe is whole: %s", slots.reason)
        if slots.sequences:
            self.served.sequences = slots.sequences
            self.scheduler.add_workers(slots.count)
        self.slots = slots

    def close(self) -> None:
        if self._probing is not None:  # ends between two of its schedules
            self._probing.stop()
        self.scheduler.stop()
        if self.slots is not None:
            self.slots.close()
        if self._loader is not None and self.served is not None:  # we built it: we close it
            self.served.kv.close()
            self.served.kv.adapter.close()

    def _store_stats(self) -> list[StoreStats]:
        if self.served is None:
            return []
        store = self.served.kv.store
        return store.tier_stats() if isinstance(store, TieredStore) else [store.stats()]

    def _prefetch_stats(self) -> dict[str, float] | None:
        p = None if self.served is None else self.served.kv.prefetcher
        return p.stats() if isinstance(p, Prefetcher) else None

    def _parallel_stats(self) -> dict[str, float] | None:
        if self.slots is None or self.served is None:
            return None
        kv = self.served.kv
        return {**self.slots.stats(), "prefix_waits": float(kv.inflight_waits),
                "prefix_wait_seconds": kv.inflight_wait_s}

    def _spec_stats(self) -> dict[str, float] | None:
        spec = None if self.served is None else self.served.kv.speculation
        if spec is None:
            return None
        s = spec.stats()
        return {"drafted_tokens": s["drafted"], "accepted_tokens": s["accepted"],
                "acceptance_rate": s["acceptance_rate"]}

    def _kv_server_stats(self) -> dict[str, float] | None:
        fill = None if self.served is None else self.served.kv.fill
        return fill.stats() if isinstance(fill, LinkStats) else None

    # -- handlers --------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        tenant = authenticate(request, self.options.api_keys)
        req = parse_request(await read_body(request, self.options.max_body_bytes), ChatRequest)
        served = self._model(req.model)
        limit = req.limit()
        served.check_limit(limit, "max_completion_tokens" if req.max_completion_tokens
                           is not None else "max_tokens")
        served.check_chat()
        tools = plan_tools(req)
        grammar = response_grammar(req.response_format)
        if tools is not None and tools.forced:
            if grammar is not None:
                raise bad_request("tool_choice forces a tool call and response_format asks "
                                  "for JSON of its own; send one of the two",
                                  param="response_format")
            grammar = tools.grammar()
        msgs = chat_prompt(req.messages, tools)
        passages = self._check_extensions(served, req)
        return await self._run(request, served, req,
                               lambda: served.prepare_chat(msgs, limit, passages),
                               tenant, chat=True, grammar=grammar, tools=tools)

    async def completions(self, request: Request) -> Response:
        tenant = authenticate(request, self.options.api_keys)
        req = parse_request(await read_body(request, self.options.max_body_bytes),
                            CompletionRequest)
        served = self._model(req.model)
        served.check_limit(req.max_tokens, "max_tokens")
        one = req.single_prompt()
        prompt = one if isinstance(one, str) else tuple(one)
        passages = self._check_extensions(served, req)
        return await self._run(request, served, req,
                               lambda: served.prepare(prompt, req.max_tokens, "prompt",
                                                      passages),
                               tenant, chat=False, grammar=response_grammar(req.response_format))

    async def models(self, request: Request) -> JSONResponse:
        authenticate(request, self.options.api_keys)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> JSONResponse:
        authenticate(request, self.options.api_keys)
        self._check_name(request.path_params["name"])
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> JSONResponse:
        if self.served is not None and self.scheduler.ready.is_set():
            parallel = self.slots.as_dict() if self.slots is not None else None
            return JSONResponse({"status": "ok", "model": self.model_id, "parallel": parallel,
                                 "engine": self._engine_card()})
        err = self.scheduler.load_error
        body = ({"status": "failed", "error": str(err)} if err is not None
                else {"status": "loading", "model": self.model_id})
        return JSONResponse(body, status_code=503)

    async def metrics_text(self, request: Request) -> Response:
        authenticate(request, self.options.api_keys)  # with keys, a key (see the module doc)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # -- private helpers -------------------------------------------------------------------

    def _engine_card(self) -> dict[str, Any]:
        """What the engine runs: its build line, the batch-invariant kernels and flash attention
        (llama.cpp), the reuse granularity the probe decided, with why, and whether
        speculative decoding runs, with why."""
        assert self.served is not None
        kv = self.served.kv
        a = kv.adapter
        kernels = a if isinstance(a, KernelSettings) else None
        return {"build": a.build_info(),
                "batch_invariant": None if kernels is None else kernels.batch_invariant,
                "flash_attn": None if kernels is None else kernels.flash_attn,
                "reuse_granularity": kv.granularity, "why": kv.granularity_reason,
                "chunk_tokens": kv.config.chunk_size,
                "probe_pending": list(kv.probe_pending),
                "speculative": kv.speculation_reason}

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "edgekv"}

    def _check_name(self, name: str) -> None:
        if name not in (self.model_id, "default"):
            raise APIError(404, f"the model {name!r} does not exist here; this server serves "
                           f"{self.model_id!r} (or say 'default'); see GET /v1/models",
                           code="model_not_found", param="model")

    def _check_extensions(self, served: ServedModel,
                          req: ChatRequest | CompletionRequest) -> tuple[str, ...] | None:
        """EdgeKV's request fields, refused where the server is not set up for them; the
        documents' passage texts."""
        if req.approximate and not self.options.allow_approximate:
            raise APIError(400, "approximate reuse is off on this server (answers stay exactly "
                           "what a cold run gives); start it with --approximate to allow "
                           "\"approximate\": true, or leave the field out",
                           code="approximate_not_allowed", param="approximate")
        passages = req.passages()
        if passages is not None and served.kv.passages is None:
            raise APIError(400, "documents need passage reuse, which is off on this server; "
                           "start it with --passage-reuse, or put the documents' text in the "
                           "prompt", code="passage_reuse_off", param="documents")
        return passages

    def _model(self, name: str) -> ServedModel:
        self._check_name(name)
        if self.served is None or not self.scheduler.ready.is_set():
            err = self.scheduler.load_error
            raise APIError(503, f"the model could not be loaded ({err}); see the server log"
                           if err else "the model is still loading; retry when GET /health "
                           "answers 200", type="server_error",
                           code="model_load_failed" if err else "model_loading",
                           # a load on the edge takes about a second (a restart reuses the
                           # recorded probe); a failed one is not worth a retry here
                           headers={} if err else {"Retry-After": "1"})
        return self.served

    async def _run(self, request: Request, served: ServedModel,
                   req: ChatRequest | CompletionRequest,
                   prepare: Callable[[], tuple[tuple[int, ...], int]], tenant: Tenant, *,
                   chat: bool, grammar: Grammar | None = None,
                   tools: ToolPlan | None = None) -> Response:
        """`prepare` (tokens and max_tokens, or a 400) and the grammar's state over the
        vocabulary run beside the worker, then the job is queued."""
        tokens, max_tokens = await asyncio.to_thread(prepare)
        passages = req.passages()
        param = "tool_choice" if tools is not None and tools.forced else "response_format"
        constraint = await asyncio.to_thread(served.constraint, grammar, param)
        seed = secrets.randbits(32) if req.seed is None else req.seed % 2**63
        sampling = Sampling(max_tokens=max_tokens, temperature=req.temperature,
                            top_p=req.top_p, seed=seed)
        gen = await asyncio.to_thread(
            lambda: served.prepared(tokens, sampling, salt=tenant.salt(req.cache_salt),
                                    approximate=bool(req.approximate), passages=passages,
                                    stop=req.stops(), constraint=constraint,
                                    top_logprobs=req.top_k(), tools=tools))
        shape = CompletionShape(chat, self.model_id, "fp_" + served.kv.fingerprint[:12])
        job = Job(tenant.queue(req.cache_salt), lambda j: served.run(gen, j, self.metrics),
                  asyncio.get_running_loop(), request_id=shape.id)
        self.scheduler.submit(job)
        gone = asyncio.ensure_future(wait_disconnect(request.receive))
        handed_over = False
        try:
            event = await job.next_event(gone)
            if isinstance(event, APIError):
                raise event
            if event is not None and req.stream:
                usage = bool(req.stream_options and req.stream_options.include_usage)
                handed_over = True
                return EventStream(self._frames(job, gone, shape, usage),
                                   on_close=lambda: self._release(job, gone))
            while event is not None and not isinstance(event, Finished):
                event = await job.next_event(gone)
                if isinstance(event, APIError):
                    raise event
            if event is None:
                return Response(status_code=CLIENT_GONE)
            headers = {TIER_HEADER: event.tier} if event.tier is not None else None
            return JSONResponse(shape.whole(event), headers=headers)
        finally:
            if not handed_over:
                self._release(job, gone)

    async def _frames(self, job: Job, gone: asyncio.Future[None], shape: CompletionShape,
                      usage: bool) -> AsyncIterator[bytes]:
        if shape.chat:
            yield sse(shape.chunk("", role=True, with_usage=usage))
        while (event := await job.next_event(gone)) is not None:
            if isinstance(event, Delta):
                lps = event.logprobs if event.logprobs else None
                yield sse(shape.chunk(event.text, with_usage=usage, logprobs=lps))
            elif isinstance(event, Finished):
                late = (event.logprobs[event.sent_logprobs:] if event.logprobs is not None
                        else ())
                if event.tool_calls:  # one chunk per call (the first carries late logprobs)
                    for i, call in enumerate(event.tool_calls):
                        chunk = shape.chunk(None, with_usage=usage,
                                            logprobs=late if i == 0 and late else None,
                                            tool_calls=[call])
                        chunk["choices"][0]["delta"]["tool_calls"][0]["index"] = i
                        yield sse(chunk)
                elif late:
                    yield sse(shape.chunk("", with_usage=usage, logprobs=late))
                yield sse(shape.chunk(None, finish_reason=event.finish_reason, with_usage=usage,
                                      finished=event))
                if usage:
                    yield sse(shape.usage_chunk(event))
                yield DONE
                return
            elif isinstance(event, APIError):
                yield sse(event.body())
                yield DONE
                return

    def _release(self, job: Job, gone: asyncio.Future[None]) -> None:
        gone.cancel()
        self.scheduler.cancel(job)  # a no-op once the job has finished
