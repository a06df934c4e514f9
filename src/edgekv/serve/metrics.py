"""`/metrics` in the Prometheus text format, named after vLLM's metrics under `edgekv_`.

Why vLLM's names: dashboards and alerts written for vLLM (prefix-cache hit rate =
hits / queries, TTFT and end-to-end latency histograms, running / waiting gauges) then work
with a `vllm:` -> `edgekv_` rename. Each server owns its registry, so two apps in one process
(tests) never share counters. Store figures are read from the store when scraped, so they are
never stale and cost nothing between scrapes.

EdgeKV's own, beside them: `edgekv_route_tier_total{tier}` (requests by the semantic router's
tier: exact, partial, miss; only with a router), `edgekv_streamed_tokens_total` (prompt tokens
whose KV a fill step streamed in), `edgekv_computed_tokens_total` (prompt tokens computed
here), `edgekv_passage_reused_tokens_total` (document tokens placed from the passage cache),
`edgekv_approximate_requests_total` (answers labelled approximate), and with a prefetcher
`edgekv_prefetch_requests_total`, `edgekv_prefetch_predicted_total`, `edgekv_prefetch_hits_total`,
`edgekv_prefetch_warmed_fragments_total` and `edgekv_prefetch_hit_rate` (hits / predicted); with
--kv-server `edgekv_kv_server_up`, `edgekv_kv_published_total`, `edgekv_kv_publish_failures_total`;
once loaded `edgekv_batch_slots` (requests generating at once: 1 where `--parallel` fell back
to one at a time, and `/health`'s `parallel.reason` says why), `edgekv_batch_requested`,
`edgekv_batch_steps_total`, `edgekv_batch_tokens_total`, `edgekv_batch_max_sequences`,
`edgekv_batch_prefix_waits_total` and `edgekv_batch_prefix_wait_seconds_total` (requests that
waited for another slot's prompt chunks, and for how long: `EdgeKV.generate`),
`edgekv_batch_slot_tokens` (what a slot's own KV stream holds), and the step budget's
`edgekv_batch_budgeted_steps_total`, `edgekv_batch_step_budget_seconds`, the fitted
`edgekv_batch_step_fixed_seconds` and `edgekv_batch_step_token_seconds`, and
`edgekv_batch_step_longest_seconds`, and `edgekv_batch_step_shared_slowdown` (steps beside
the cache's own work).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..store.base import StoreStats

__all__ = ["CONTENT_TYPE", "CountResponses", "ServeMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST  # what generate_latest writes
TIERS = ("exact", "partial", "miss")  # the semantic router's (semantic.router.Tier)

# vLLM's buckets (vllm/engine/metrics.py), so histograms compare bucket for bucket
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/edgekv/stats",
             "/health", "/metrics", "/")
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServeMetrics:
    """The server's counters; `render()` is the body of GET /metrics."""

    def __init__(self, *, waiting: Callable[[], int], running: Callable[[], int],
                 store_stats: Callable[[], Sequence[StoreStats]],
                 prefetch_stats: Callable[[], Mapping[str, float] | None] = lambda: None,
                 kv_server_stats: Callable[[], Mapping[str, float] | None] = lambda: None,
                 parallel_stats: Callable[[], Mapping[str, float] | None] = lambda: None,
                 spec_stats: Callable[[], Mapping[str, float] | None] = lambda: None
                 ) -> None:
        r = self.registry = CollectorRegistry()
        self.prefix_queries = Counter(
            "edgekv_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
            "(tokens, not requests)", registry=r)
        self.prefix_hits = Counter(
            "edgekv_prefix_cache_hits", "Prompt tokens restored from the prefix cache "
            "(tokens; hit rate = hits / queries)", registry=r)
        self.prompt_tokens = Counter("edgekv_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("edgekv_generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram(
            "edgekv_time_to_first_token_seconds", "Arrival to first token (queueing "
            "included)", buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("edgekv_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=E2E_BUCKETS, registry=r)
        Gauge("edgekv_num_requests_running", "Requests generating now",
              registry=r).set_function(running)
        Gauge("edgekv_num_requests_waiting", "Requests queued for the worker",
              registry=r).set_function(waiting)
        self.requests = Counter("edgekv_requests", "HTTP responses by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.cancelled = Counter("edgekv_requests_cancelled", "Requests whose client went "
                                 "away, by where they were (waiting or running)", ["stage"],
                                 registry=r)
        self.tiers = Counter("edgekv_route_tier", "Requests by the semantic router's tier "
                             "(exact, partial, miss)", ["tier"], registry=r)
        self.streamed_tokens = Counter(
            "edgekv_streamed_tokens", "Prompt tokens whose KV a fill step streamed in (from a "
            "KV server), neither cached here nor computed", registry=r)
        self.computed_tokens = Counter(
            "edgekv_computed_tokens", "Prompt tokens computed here (not cached, streamed or "
            "placed from the passage cache)", registry=r)
        self.passage_reused = Counter(
            "edgekv_passage_reused_tokens", "Document tokens whose KV was placed from the "
            "passage cache", registry=r)
        self.approximate = Counter("edgekv_approximate_requests", "Answers labelled "
                                   "approximate (reused KV differs from a cold run's)",
                                   registry=r)
        self._refused = 0  # requests during which an injection was refused
        self._lock = threading.Lock()
        r.register(_StoreCollector(store_stats, self.refused))
        r.register(_prefetch_collector(prefetch_stats))
        r.register(_kv_server_collector(kv_server_stats))
        r.register(_parallel_collector(parallel_stats))
        r.register(_spec_collector(spec_stats))

    def routing(self) -> None:
        """A semantic router is on: every tier is shown from the start (as 0)."""
        for t in TIERS:
            self.tiers.labels(t)

    def observe(self, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                ttft_s: float, e2e_s: float, refused_injection: bool,
                streamed_tokens: int = 0, computed_tokens: int = 0, tier: str | None = None,
                approximate: bool = False, passage_reused_tokens: int = 0) -> None:
        """Record one finished generation."""
        if tier is not None:
            self.tiers.labels(tier).inc()
        self.streamed_tokens.inc(streamed_tokens)
        self.computed_tokens.inc(computed_tokens)
        self.passage_reused.inc(passage_reused_tokens)
        if approximate:
            self.approximate.inc()
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        if refused_injection:
            with self._lock:
                self._refused += 1

    def refused(self) -> int:
        with self._lock:
            return self._refused

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector(Collector):
    """Store gauges and fault counters, read from the tiers at scrape time."""

    def __init__(self, stats: Callable[[], Sequence[StoreStats]],
                 refused: Callable[[], int]) -> None:
        self._stats, self._refused = stats, refused

    def collect(self) -> Iterator[Metric]:
        tiers = list(self._stats())
        size = GaugeMetricFamily("edgekv_store_bytes", "Bytes held by each store tier",
                                 labels=["tier"])
        entries = GaugeMetricFamily("edgekv_store_entries", "Fragments held by each store tier",
                                    labels=["tier"])
        evictions = CounterMetricFamily("edgekv_store_evictions", "Fragments evicted for "
                                        "capacity, by tier", labels=["tier"])
        queued = GaugeMetricFamily("edgekv_store_queued_bytes", "Bytes accepted by a tier "
                                   "written behind (serve's --write-behind), not yet written",
                                   labels=["tier"])
        for s in tiers:
            size.add_metric([s.tier], s.bytes)
            entries.add_metric([s.tier], s.entries)
            evictions.add_metric([s.tier], s.evictions)
            queued.add_metric([s.tier], s.queued_bytes)
        faults = CounterMetricFamily(
            "edgekv_faults", "Faults met and survived: corrupt_entry = stored entries that "
            "failed verification (read as misses); refused_injection = requests where a "
            "fragment was refused and the prompt recomputed; store_error = store calls that "
            "failed (disk full, read-only, no permission, backend down), answered by local "
            "compute", labels=["kind"])
        faults.add_metric(["corrupt_entry"], sum(s.corrupt for s in tiers))
        faults.add_metric(["store_error"], sum(s.errors for s in tiers))
        faults.add_metric(["refused_injection"], self._refused())
        yield from (size, entries, evictions, queued, faults)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families are only known at scrape time; nothing to pre-register


class _StatsCollector(Collector):
    """A part's own counters (`stats()` -> name: value, or None without that part), read at
    scrape time: `counters` and `gauges` name the families, `name: help`."""

    def __init__(self, stats: Callable[[], Mapping[str, float] | None], prefix: str,
                 counters: Mapping[str, str], gauges: Mapping[str, str]) -> None:
        self._stats, self._prefix = stats, prefix
        self._counters, self._gauges = counters, gauges

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:
            return
        for name, what in self._counters.items():
            c = CounterMetricFamily(self._prefix + name, what)
            c.add_metric([], float(s[name]))
            yield c
        for name, what in self._gauges.items():
            yield GaugeMetricFamily(self._prefix + name, what, value=float(s[name]))

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _prefetch_collector(stats: Callable[[], Mapping[str, float] | None]) -> _StatsCollector:
    """The prefetcher's (`prefetch.Prefetcher.stats`)."""
    return _StatsCollector(stats, "edgekv_prefetch_", {
        "requests": "Requests the prefetcher saw (with a signature)",
        "predicted": "Requests for which a next context was predicted",
        "hits": "Predicted requests whose context was among the predicted",
        "warmed_fragments": "Fragments the prefetcher loaded ahead"},
        {"hit_rate": "Prefetch hits / predicted (0 before any prediction)"})


def _kv_server_collector(stats: Callable[[], Mapping[str, float] | None]) -> _StatsCollector:
    """SparKV's link (`stream.hybrid.HybridLoader.stats`), with --kv-server."""
    return _StatsCollector(stats, "edgekv_kv_", {
        "published": "Prompts the KV server was asked to precompute",
        "publish_failures": "Precompute requests that failed"},
        {"server_up": "1 while chunks may stream from the KV server (its check passed), "
         "else 0: every chunk is computed here"})


def _parallel_collector(stats: Callable[[], Mapping[str, float] | None]) -> _StatsCollector:
    """--parallel (`parallel.Slots.stats`): slots in use and what batching did."""
    return _StatsCollector(stats, "edgekv_batch_", {
        "steps": "Batched decodes of the slots' tokens (llama_decode calls)",
        "tokens": "Tokens decoded in batched steps (prompt and generated)",
        "prefix_waits": "Requests that waited for another slot to store the prompt chunk "
                        "it was computing, instead of computing it too",
        "prefix_wait_seconds": "Time those requests waited",
        "budgeted_steps": "Steps whose prefill the step budget cut short (stall-free "
                          "prefill beside running generations)"},
        {"slots": "Requests that generate at once (1: one at a time; /health says why)",
         "requested": "Slots asked for with --parallel",
         "max_sequences": "The most sequences one batched step held",
         "slot_tokens": "Context tokens each slot holds (a KV stream of its own per slot; 0: "
                        "no slots)",
         "step_budget_seconds": "--step-budget-ms: the longest a step beside running "
                                "generations may take (0: off)",
         "step_fixed_seconds": "The fitted cost of a step, fixed part",
         "step_token_seconds": "The fitted cost of a step, per token",
         "step_longest_seconds": "The longest batched step so far",
         "step_shared_slowdown": "How much slower a step runs beside the cache's own work "
                                 "on a slot's thread (measured; the budget plans for it)"})


def _spec_collector(stats: Callable[[], Mapping[str, float] | None]) -> _StatsCollector:
    """Speculative decoding (`engines.spec.Speculation.stats`), where it runs."""
    return _StatsCollector(stats, "edgekv_spec_", {
        "drafted_tokens": "Drafted tokens verified in a batch",
        "accepted_tokens": "Drafted tokens the answers took (output unchanged: each a decode "
                           "step saved)"},
        {"acceptance_rate": "accepted / drafted tokens since start (0 before any draft)"})


class CountResponses:
    """ASGI middleware: count every response by endpoint and status, streams included (a pure
    ASGI wrapper, unlike BaseHTTPMiddleware, leaves streaming and disconnects alone)."""

    def __init__(self, app: Any, metrics: ServeMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else (  # unknown paths share one label
            "/v1/models" if path.startswith("/v1/models/") else
            "/ui" if path.startswith("/ui/") else "other")

        async def counting(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting)
