"""The benches' client of one server and its figures: every request streamed and timed chunk
by chunk (time to the first text chunk, the times between text chunks); a run's figures
(percentiles, throughput) and its agreement with another run, request by request. How many
clients at once, or at what rate: `load`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .servers import greedy_extra

__all__ = ["Reply", "agreement", "percentile", "stream_one", "summarize"]


@dataclass(frozen=True, slots=True)
class Reply:
    """What one streamed request measured; `error` set where it failed (no figures then)."""

    text: str
    ttft_s: float  # to the first text chunk (the total where no text came)
    itl_s: tuple[float, ...]  # between successive text chunks
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    total_s: float
    error: str | None = None


def stream_one(client: Any, system: str, prompt: str, max_tokens: int) -> Reply:
    """One greedy streamed completion, timed chunk by chunk."""
    t0 = time.perf_counter()
    marks: list[float] = []
    parts: list[str] = []
    usage = None
    stream = client.completions.create(
        model="default" if system == "edgekv" else "model", prompt=prompt,
        max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=greedy_extra(system))
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            marks.append(time.perf_counter())
            parts.append(chunk.choices[0].text)
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return Reply("".join(parts), (marks[0] - t0) if marks else total,
                 tuple(b - a for a, b in zip(marks, marks[1:])),
                 int(usage.completion_tokens) if usage else 0,
                 int(usage.prompt_tokens) if usage else 0,
                 int(getattr(details, "cached_tokens", 0) or 0) if details else 0, total)


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (as `bench serve`'s figures); 0 for no values."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else 0.0


def agreement(rows: Sequence[Reply], own: Sequence[Reply]) -> float | None:
    """The share of requests answered as `own` answered them, request by request (a failed
    request agrees with nothing); None where there is nothing to compare."""
    if not rows or len(rows) != len(own):
        return None
    same = sum(a.error is None and b.error is None and a.text == b.text
               for a, b in zip(rows, own))
    return round(same / len(rows), 4)


def summarize(rows: Sequence[Reply], wall_s: float) -> dict[str, Any]:
    """One run's figures over its requests that did not fail (ITLs pooled over requests)."""
    ok = [r for r in rows if r.error is None]
    ttft = [r.ttft_s * 1000 for r in ok]
    itl = [x * 1000 for r in ok for x in r.itl_s]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(rows), "failed": len(rows) - len(ok),
        "ttft_ms_mean": round(statistics.fmean(ttft), 1) if ttft else None,
        "ttft_ms_p50": round(percentile(ttft, 0.5), 1) if ttft else None,
        "ttft_ms_p95": round(percentile(ttft, 0.95), 1) if ttft else None,
        "itl_ms_mean": round(statistics.fmean(itl), 2) if itl else None,
        "itl_ms_p95": round(percentile(itl, 0.95), 2) if itl else None,
        # the longest gap: a decode held up while another request's prefill ran
        "itl_ms_max": round(max(itl), 2) if itl else None,
        "throughput_tok_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "e2e_ms_mean": round(statistics.fmean(r.total_s * 1000 for r in ok), 1) if ok else None,
        "wall_s": round(wall_s, 3), "completion_tokens": tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "errors": sorted({r.error for r in rows if r.error is not None})[:5],
    }
