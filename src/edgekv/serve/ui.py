"""The page at `/`: a chat pane and a cache pane that show what reuse did, from static files.

Why a page: EdgeKV's value is in numbers (prompt tokens from the cache, streamed, computed; the
hit rate; what each tier holds) that an operator otherwise reads only with curl. The page is
three files shipped in the wheel (`static/`), no build step, no CDN, no framework: it works
with no network beyond this server.

What is open and what is not: `/` and `/ui/<file>` hold no data and need no key; the page asks
for the key and sends it as `Authorization: Bearer` to every route it reads, which keep
requiring it (`guard.authenticate`). Files are served from a fixed list (no path from the
request reaches the file system), with a Content-Security-Policy that allows only this
origin's script and style and no inline script, so a model answer or a message that holds
markup can do nothing even if it were rendered as HTML (the page renders it as text).

`GET /v1/edgekv/stats`: the cache pane's numbers as JSON, read from the same registry, in the
same collection, as `/metrics` (`stats`), so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources
from typing import Any

from fastapi import FastAPI
from prometheus_client.core import Metric
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import APIError
from .guard import authenticate
from .metrics import ServeMetrics

__all__ = ["CSP", "FILES", "mount", "stats"]

# name under /ui/ -> content type; nothing else is ever served from static/
FILES = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8",
         "favicon.svg": "image/svg+xml"}
PAGE = "index.html"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


def mount(app: FastAPI, metrics: ServeMetrics, api_keys: tuple[str, ...], *,
          page: bool = True) -> None:
    """Add `GET /v1/edgekv/stats`, and with `page` (`--no-ui` turns it off) `GET /` and
    `GET /ui/<file>`."""
    ui = _UI(metrics, api_keys, page)
    if page:
        app.add_api_route("/", ui.page, methods=["GET"])
        app.add_api_route("/ui/{name}", ui.asset, methods=["GET"])
    app.add_api_route("/v1/edgekv/stats", ui.stats_json, methods=["GET"])


class _UI:
    """The page's routes; the files are read once, when the app is built (a wheel without
    them fails at start, not at the first visit)."""

    def __init__(self, metrics: ServeMetrics, api_keys: tuple[str, ...], page: bool) -> None:
        static = resources.files(__package__).joinpath("static")
        self._files = ({name: static.joinpath(name).read_bytes() for name in (PAGE, *FILES)}
                       if page else {})
        self._metrics, self._keys = metrics, api_keys

    async def page(self, request: Request) -> Response:
        return Response(self._files[PAGE], media_type="text/html; charset=utf-8",
                        headers=HEADERS)

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in FILES:
            raise APIError(404, f"no file {name!r} here; the page is at /",
                           code="not_found")
        return Response(self._files[name], media_type=FILES[name], headers=HEADERS)

    async def stats_json(self, request: Request) -> JSONResponse:
        authenticate(request, self._keys)  # the same numbers as /metrics, the same key
        return JSONResponse(stats(self._metrics.registry.collect()))


def stats(families: Iterable[Metric]) -> dict[str, Any]:
    """The cache pane's numbers from one collection of the metrics registry (what /metrics
    renders): token counters, the hit rate (hits / queries, None before any query), each
    store tier's bytes, entries and evictions, requests running and waiting, the slots, TTFT's
    count and sum (seconds), and the router's tiers where there is a router."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in families:
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))

    def one(name: str) -> float | None:
        found = samples.get(name)
        return found[0][1] if found else None

    def by(name: str, label: str) -> dict[str, float]:
        return {labels[label]: v for labels, v in samples.get(name, [])}

    queries = one("edgekv_prefix_cache_queries_total") or 0.0
    hits = one("edgekv_prefix_cache_hits_total") or 0.0
    size, entries = by("edgekv_store_bytes", "tier"), by("edgekv_store_entries", "tier")
    evictions = by("edgekv_store_evictions_total", "tier")
    return {
        "prefix_cache": {"queries": queries, "hits": hits,
                         "hit_rate": hits / queries if queries else None},
        "tokens": {"prompt": one("edgekv_prompt_tokens_total"),
                   "generated": one("edgekv_generation_tokens_total"),
                   "streamed": one("edgekv_streamed_tokens_total"),
                   "computed": one("edgekv_computed_tokens_total"),
                   "passage_reused": one("edgekv_passage_reused_tokens_total")},
        "store": [{"tier": t, "bytes": b, "entries": entries.get(t),
                   "evictions": evictions.get(t)} for t, b in size.items()],
        "requests": {"running": one("edgekv_num_requests_running"),
                     "waiting": one("edgekv_num_requests_waiting"),
                     "slots": one("edgekv_batch_slots")},  # None until the model is loaded
        "ttft_seconds": {"count": one("edgekv_time_to_first_token_seconds_count"),
                         "sum": one("edgekv_time_to_first_token_seconds_sum")},
        "route_tiers": by("edgekv_route_tier_total", "tier") or None,
        "faults": by("edgekv_faults_total", "kind"),
    }
