"""Exact speculative decoding: n-gram drafts from the request's own tokens, verified in one batch.

Answers copy text from their context (a RAG answer quotes a passage, a code edit repeats the
function, a tool call repeats its arguments). Where the last few tokens occurred before in the
prompt or the answer, the tokens that followed them then are a good guess for what comes next
(prompt-lookup decoding). A step feeds the last sampled token and k such drafted tokens in one
batch, with logits at every position, and keeps what the model would have produced anyway:

- every position is sampled in order, exactly as plain decoding samples it: the same masked
  logits (a grammar, a logprob recorder: `constraint`), the same random stream (one draw per
  emitted token, from the request's own seeded generator; greedy draws nothing), the same
  `on_token`, end-of-sequence and `max_tokens` checks;
- a draft is accepted only where it equals the token sampled at its position; the first that
  does not is replaced by the sampled token, and the logits after it are dropped (they were
  conditioned on a token the answer does not hold);
- the KV cells of the dropped drafts are removed (`DraftVerifier.truncate`), so the engine then
  holds the prompt and the answer less its last token, as after plain decoding.

The output equals plain decoding token for token exactly where a position's logits do not
depend on the batch it is computed in, nor on how many of its batch's positions ask for
logits: what EdgeKV's batch-invariant kernels give, and what the probe's draft schedule checks
bit for bit (`probe_spec`); `EdgeKV` speculates only where it passed. A grammar's state is
advanced only by emitted tokens, each after it was sampled under the state before it, so a
rejected draft never reaches it and there is nothing to roll back.

Drafting costs nothing where it finds nothing (no batch, a plain step). Where drafts are found
but keep failing (chat without repeats), the draft length falls to 0, and drafting is tried
again after a pause that doubles each time it fails again (`DraftPolicy`). The length is chosen
from the measured acceptance and the measured cost of a batch of each size (`StepCosts`,
shared by every request on one engine): k drafts are sent only where the expected tokens per
second beat a plain step's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError

__all__ = ["DraftPolicy", "NGramDrafter", "SpecConfig", "Speculation", "StepCosts"]


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """The draft source's bounds. n-grams of `n_max` down to `n_min` tokens are matched
    (longest first); at most `k_max` drafts a step; the index holds the last `window` tokens
    of a sequence. A drafting that failed `fail_limit` steps in a row pauses for
    `pause_steps` plain steps (doubled after each further failure, up to `max_pause`)."""

    n_max: int = 4
    n_min: int = 2
    k_max: int = 10
    window: int = 8192
    fail_limit: int = 3
    pause_steps: int = 8
    max_pause: int = 128

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise ConfigError(f"n-gram sizes {self.n_min}..{self.n_max}: need 1 <= min <= max")
        if self.k_max < 1 or self.window < self.n_max + 1:
            raise ConfigError(f"k_max={self.k_max} must be >= 1 and window={self.window} "
                              f"> n_max={self.n_max}")
        if self.fail_limit < 1 or not 1 <= self.pause_steps <= self.max_pause:
            raise ConfigError("fail_limit >= 1 and 1 <= pause_steps <= max_pause")


class NGramDrafter:
    """A bounded n-gram index over one sequence's tokens (prompt, then the answer as it
    grows): for each n-gram, where its latest occurrence ended. `propose(k)` matches the last
    n tokens (n from `n_max` down to `n_min`) and proposes the k tokens that followed their
    latest earlier occurrence."""

    def __init__(self, tokens: Sequence[int], config: SpecConfig | None = None) -> None:
        self.config = config or SpecConfig()
        self.tokens: list[int] = []
        # per n: n-gram -> the index of the token that followed its latest occurrence
        self._next: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(self.config.n_min, self.config.n_max + 1)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the sequence (and the n-grams they end to the index)."""
        toks, nexts = self.tokens, self._next
        for t in tokens:
            j = len(toks)  # the new token's index: it follows the n-grams ending at j - 1
            for n, index in nexts.items():
                if j >= n:
                    index[tuple(toks[j - n : j])] = j
            toks.append(int(t))
        limit = self.config.window
        if len(toks) > 2 * limit:  # bounded: forget what lies before the last `window`
            self._rebuild(toks[-limit:])

    def _rebuild(self, tokens: list[int]) -> None:
        self.tokens = []
        for index in self._next.values():
            index.clear()
        self.extend(tokens)

    def propose(self, k: int) -> list[int]:
        """Up to `k` drafted tokens continuing the sequence; [] where no n-gram matches."""
        toks = self.tokens
        if k < 1:
            return []
        for n in range(self.config.n_max, self.config.n_min - 1, -1):
            if len(toks) < n + 1:
                continue
            j = self._next[n].get(tuple(toks[-n:]))
            if j is not None:
                return toks[j : j + k]
        return []


class StepCosts:
    """Measured seconds of a batch of n tokens of one sequence (n = 1: a plain decode step;
    n = k + 1: a verification of k drafts), a moving average per n; shared by the requests of
    one engine (thread-safe: the counters are plain floats updated under a lock)."""

    def __init__(self, n_max: int, *, decay: float = 0.8) -> None:
        self.decay = decay
        self._t = [0.0] * (n_max + 2)
        self._seen = [0] * (n_max + 2)
        self._lock = threading.Lock()

    def observe(self, n: int, seconds: float) -> None:
        if not 0 < n < len(self._t) or seconds <= 0:
            return
        with self._lock:
            if self._seen[n]:
                self._t[n] = self.decay * self._t[n] + (1 - self.decay) * seconds
            else:
                self._t[n] = seconds
            self._seen[n] += 1

    def ratio(self, n: int) -> float:
        """The cost of a batch of n tokens over a plain step's: measured where seen; else
        interpolated between the nearest sizes measured; else, before any batch was timed,
        1 + 0.5 (n - 1) (each extra token half a step: pessimistic for a memory-bound engine,
        and it is measured at the first batch)."""
        with self._lock:
            t, seen = list(self._t), list(self._seen)
        if n <= 1:
            return 1.0
        base = t[1] if seen[1] else None
        known = [m for m in range(2, len(t)) if seen[m]]
        if base is None or not known:
            return 1.0 + 0.5 * (n - 1)
        if n in known:
            return t[n] / base
        lo = max((m for m in known if m < n), default=1)
        hi = min((m for m in known if m > n), default=None)
        t_lo = t[lo] if lo > 1 else base
        if hi is None:  # past the largest measured: extend the slope from one step to it
            m = max(known)
            slope = (t[m] - base) / (m - 1)
            return (t[m] + slope * (n - m)) / base
        return (t_lo + (t[hi] - t_lo) * (n - lo) / (hi - lo)) / base

    def snapshot(self) -> dict[int, float]:
        """Measured seconds per batch size (for reports)."""
        with self._lock:
            return {n: self._t[n] for n in range(1, len(self._t)) if self._seen[n]}


class DraftPolicy:
    """How many drafts one request sends a step: from its measured acceptance and the
    measured step costs (module doc). Chooses nothing about which tokens come out."""

    PRIOR = 0.6  # a draft token's acceptance before any was measured

    def __init__(self, config: SpecConfig, costs: StepCosts) -> None:
        self.config, self.costs = config, costs
        self.limit = max(2, config.k_max // 2)  # grows while whole drafts are accepted
        # acceptance of a draft token given the one before it was accepted, smoothed
        self.accept_rate = self.PRIOR
        self.fails = 0  # verification steps in a row that accepted nothing
        self.pause = 0  # plain steps left before drafting again
        self.next_pause = config.pause_steps

    def length(self, room: int) -> int:
        """Drafts to ask for now; `room`: at most this many (the tokens still to generate,
        less the one the model always adds)."""
        if self.pause > 0:
            self.pause -= 1
            if not self.pause:  # over after this step: try again as a new request would
                self.accept_rate = max(self.accept_rate, self.PRIOR)
                self.limit = max(self.limit, 2)
            return 0
        best_k, best = 0, 1.0
        p, expected = self.accept_rate, 1.0
        for k in range(1, min(self.limit, room) + 1):
            expected += p**k  # tokens a step emits: 1 + p + ... + p^k
            gain = expected / self.costs.ratio(k + 1)
            if gain > best:
                best_k, best = k, gain
        return best_k

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification step: `drafted` sent, the first `accepted` of them kept."""
        if drafted <= 0:
            return
        # each accepted token is one success; the first rejection (if any) one failure
        trials = accepted + (1 if accepted < drafted else 0)
        w = 0.15 * trials
        self.accept_rate = (1 - w) * self.accept_rate + w * (accepted / trials) if w < 1 \
            else accepted / trials
        self.accept_rate = min(0.98, max(0.02, self.accept_rate))
        if accepted == drafted:
            self.limit = min(self.config.k_max, self.limit + 2)
        else:
            self.limit = max(1, min(self.limit, accepted + 1))
        if accepted:
            self.fails, self.next_pause = 0, self.config.pause_steps
        else:
            self.fails += 1
            if self.fails >= self.config.fail_limit:
                self.pause, self.fails = self.next_pause, 0
                self.next_pause = min(self.config.max_pause, 2 * self.next_pause)


@dataclass(slots=True)
class Speculation:
    """Speculative decoding for the requests of one engine: the drafts' bounds and the step
    costs measured so far; counters of every generation it ran (for /metrics)."""

    config: SpecConfig = field(default_factory=SpecConfig)
    costs: StepCosts | None = None
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verification batches (a step with drafts)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.costs is None:
            self.costs = StepCosts(self.config.k_max + 1)

    def policy(self) -> DraftPolicy:
        assert self.costs is not None
        return DraftPolicy(self.config, self.costs)

    def count(self, drafted: int, accepted: int, steps: int) -> None:
        with self._lock:
            self.drafted += drafted
            self.accepted += accepted
            self.steps += steps

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"drafted": self.drafted, "accepted": self.accepted, "steps": self.steps,
                    "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0}
