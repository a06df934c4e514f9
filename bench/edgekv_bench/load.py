"""How requests reach a server in `edgekv bench serve`, and the serving field's figures per run.

Two ways to offer load, as vLLM's `bench serve` and SGLang's `bench_serving` do:

- closed loop, `concurrency` c: c clients, each sending its next request when its last one
  has answered (the requests taken in order from one queue);
- open loop, `rate` R: requests sent at Poisson arrival times (exponential gaps of mean 1/R,
  seeded), each on its own client thread, however many are still waiting for an answer.

A request may belong to a session (`Prompt.after`: the multi-round workload's user, whose
next round is asked once their last one is answered, as LMCache's multi-round QA does): it is
not sent before that request has answered, in either loop (in the open loop at its arrival
time or then, whichever is later).

The figures (`figures`) are vLLM's: TTFT (to the first text chunk), TPOT (per request, the
time after the first token over the tokens after it), ITL (between successive text chunks,
pooled over the run's requests), E2EL (send to last byte); output tokens/s and requests/s over
the run's wall time; goodput, the requests/s whose TTFT and TPOT meet the SLO (`Slo`).
Percentiles are nearest-rank.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from edgekv.errors import ConfigError

from .clients import Reply, percentile, stream_one

__all__ = ["DEFAULT_SLO", "Slo", "arrival_times", "figures", "run_closed", "run_open"]


@dataclass(frozen=True, slots=True)
class Slo:
    """A latency target a request meets or misses: TTFT and TPOT at most these."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft_ms=2000,tpot_ms=100` (either may be left out: its default)."""
        fields: dict[str, float] = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            key, _, value = part.partition("=")
            if key.strip() not in ("ttft_ms", "tpot_ms"):
                raise ConfigError(f"--slo {text!r}: {key.strip()!r} is not ttft_ms or tpot_ms "
                                  "(give e.g. ttft_ms=2000,tpot_ms=100)")
            try:
                fields[key.strip()] = float(value)
            except ValueError:
                raise ConfigError(f"--slo {text!r}: {value!r} is not a number of "
                                  "milliseconds") from None
            if fields[key.strip()] <= 0:
                raise ConfigError(f"--slo {text!r}: {key.strip()} must be > 0")
        return cls(**fields)

    def met(self, r: Reply) -> bool:
        tpot = _tpot_ms(r)
        return (r.error is None and r.ttft_s * 1000 <= self.ttft_ms
                and (tpot is None or tpot <= self.tpot_ms))

    def as_dict(self) -> dict[str, float]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms}

    def __str__(self) -> str:
        return f"ttft_ms={self.ttft_ms:g},tpot_ms={self.tpot_ms:g}"


DEFAULT_SLO = Slo()


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """`n` Poisson arrival times at `rate` per second from 0 (the first at 0)."""
    if rate <= 0:
        raise ConfigError(f"--rate {rate}: give requests per second > 0")
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class _Sessions:
    """Which requests have answered: a session's next request waits for its last."""

    def __init__(self, after: Sequence[int | None]) -> None:
        self.after = list(after)
        self.done = [False] * len(after)
        self.cond = threading.Condition()

    def ready(self, i: int) -> bool:
        j = self.after[i]
        return j is None or self.done[j]

    def wait_ready(self, i: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.ready(i))

    def finish(self, i: int) -> None:
        with self.cond:
            self.done[i] = True
            self.cond.notify_all()


def _ask(client: Any, system: str, prompt: str, max_tokens: int) -> Reply:
    t = time.perf_counter()
    try:
        return stream_one(client, system, prompt, max_tokens)
    except Exception as e:  # noqa: BLE001 - recorded as the request's failure
        return Reply("", 0.0, (), 0, 0, 0, time.perf_counter() - t,
                     f"{type(e).__name__}: {e}"[:300])


def run_closed(make_client: Callable[[], Any], system: str, prompts: Sequence[str],
               concurrency: int, max_tokens: int,
               after: Sequence[int | None] | None = None) -> tuple[list[Reply], float]:
    """`concurrency` clients, each taking the first request not taken whose session's last
    request has answered; the replies in prompt order and the wall time from the moment every
    client is ready to the last reply."""
    sessions = _Sessions(after or [None] * len(prompts))
    taken = [False] * len(prompts)
    replies: list[Reply | None] = [None] * len(prompts)
    n = max(1, min(concurrency, len(prompts)))
    start = threading.Barrier(n + 1)

    def take() -> int | None:
        with sessions.cond:
            while True:
                left = [i for i, t in enumerate(taken) if not t]
                if not left:
                    return None
                ready = next((i for i in left if sessions.ready(i)), None)
                if ready is not None:
                    taken[ready] = True
                    return ready
                sessions.cond.wait()

    def worker() -> None:
        client = make_client()
        start.wait()
        while (i := take()) is not None:
            replies[i] = _ask(client, system, prompts[i], max_tokens)
            sessions.finish(i)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
    for th in threads:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    return [r for r in replies if r is not None], time.perf_counter() - t0


def run_open(make_client: Callable[[], Any], system: str, prompts: Sequence[str], rate: float,
             max_tokens: int, after: Sequence[int | None] | None = None, seed: int = 0
             ) -> tuple[list[Reply], float]:
    """Request i sent at its Poisson arrival time (`arrival_times`), or once its session's
    last request has answered if that is later, each on a thread of its own; the replies in
    prompt order and the wall time from the first arrival to the last reply."""
    sessions = _Sessions(after or [None] * len(prompts))
    times = arrival_times(len(prompts), rate, seed)
    replies: list[Reply | None] = [None] * len(prompts)
    clients: list[Any] = []
    pool = threading.Lock()

    def client() -> Any:
        with pool:
            return clients.pop() if clients else None

    def run(i: int) -> None:
        sessions.wait_ready(i)
        c = client() or make_client()
        replies[i] = _ask(c, system, prompts[i], max_tokens)
        with pool:
            clients.append(c)
        sessions.finish(i)

    clients += [make_client() for _ in range(min(len(prompts), 8))]
    threads = []
    t0 = time.perf_counter()
    for i, at in enumerate(times):
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        th = threading.Thread(target=run, args=(i,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return [r for r in replies if r is not None], time.perf_counter() - t0


def _tpot_ms(r: Reply) -> float | None:
    """Time per output token after the first (vLLM's TPOT); None for a one-token answer."""
    if r.error is not None or r.completion_tokens < 2:
        return None
    return (r.total_s - r.ttft_s) * 1000 / (r.completion_tokens - 1)


def _stats(xs: list[float], digits: int = 1) -> tuple[float | None, float | None, float | None]:
    if not xs:
        return None, None, None
    return (round(statistics.fmean(xs), digits), round(percentile(xs, 0.5), digits),
            round(percentile(xs, 0.99), digits))


def figures(rows: Sequence[Reply], wall_s: float, slo: Slo = DEFAULT_SLO) -> dict[str, Any]:
    """One run's figures (module doc) over its requests that did not fail; `goodput_rps`
    counts a failed request as missing the SLO."""
    ok = [r for r in rows if r.error is None]
    ttft = [r.ttft_s * 1000 for r in ok]
    tpot = [t for r in ok if (t := _tpot_ms(r)) is not None]
    itl = [x * 1000 for r in ok for x in r.itl_s]
    e2el = [r.total_s * 1000 for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    out: dict[str, Any] = {"requests": len(rows), "failed": len(rows) - len(ok)}
    for name, xs, digits in (("ttft", ttft, 1), ("tpot", tpot, 2), ("itl", itl, 2),
                             ("e2el", e2el, 1)):
        mean, p50, p99 = _stats(xs, digits)
        out |= {f"{name}_ms_mean": mean, f"{name}_ms_p50": p50, f"{name}_ms_p99": p99}
    out["itl_ms_max"] = round(max(itl), 2) if itl else None
    tokens = sum(r.completion_tokens for r in ok)
    out |= {
        "output_tok_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 4) if wall_s > 0 else None,
        "goodput_rps": round(sum(slo.met(r) for r in rows) / wall_s, 4) if wall_s > 0 else None,
        "slo": str(slo), "slo_met": round(sum(slo.met(r) for r in rows) / len(rows), 4)
        if rows else None,
        "reused_prompt_share": round(sum(r.cached_tokens for r in ok) / prompt, 4)
        if prompt else None,
        "wall_s": round(wall_s, 3), "completion_tokens": tokens, "prompt_tokens": prompt,
        "errors": sorted({r.error for r in rows if r.error is not None})[:5],
    }
    return out
