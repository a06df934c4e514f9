"""Per-chunk stream-or-compute planning with causal dependence.

Computing chunk i needs the KV of every chunk before it (local, streamed or computed), and
one connection delivers streamed chunks in order. `simulate` plays a plan on that timeline:
the device computes its chunks in order, waiting where an earlier chunk is still on the wire
(and injecting what arrived before computing on top of it); the stream runs alongside. The
planner evaluates all-local, all-stream, every "compute the first k chunks while the rest
stream" split, every "stream a middle run" plan, and (for up to 10 undecided chunks) every
assignment, and keeps the one with the lowest predicted TTFT (or lowest energy within a TTFT
bound). The all-local and all-stream plans are always candidates, so the chosen plan is never
predicted worse than either.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .costmodel import CostModel

__all__ = ["COMPUTE", "LOCAL", "STREAM", "ChunkAction", "Plan", "plan", "simulate"]


class ChunkAction(str, enum.Enum):
    """What happens to one whole chunk of a prompt before its last tokens are prefilled. A
    str enum: it compares, hashes and prints as its value ("local", "stream", "compute")."""

    LOCAL = "local"  # in the device's own cache: injected
    STREAM = "stream"  # fetched from the KV server while the device computes others
    COMPUTE = "compute"  # prefilled on the device

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


LOCAL, STREAM, COMPUTE = ChunkAction.LOCAL, ChunkAction.STREAM, ChunkAction.COMPUTE


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[ChunkAction, ...]  # per chunk
    ttft_s: float  # predicted, excluding the tail prefill (the same for every plan)
    energy_j: float
    all_local_s: float
    all_stream_s: float

    @property
    def streamed(self) -> list[int]:
        return [i for i, a in enumerate(self.actions) if a == STREAM]

    @property
    def computed(self) -> list[int]:
        return [i for i, a in enumerate(self.actions) if a == COMPUTE]


def simulate(actions: Sequence[str], raw_bytes: int, cost: CostModel, *,
             start_s: float = 0.0) -> tuple[float, float]:
    """Predicted (seconds until every chunk's KV is in the engine, energy in J)."""
    arrivals: dict[int, float] = {}
    t_net = start_s + cost.rtt_s
    wire = cost.wire_bytes(raw_bytes)
    for i, a in enumerate(actions):
        if a == STREAM:
            t_net += cost.transfer_s(wire)
            arrivals[i] = t_net
    n_local = sum(1 for a in actions if a == LOCAL)
    t = start_s + (cost.inject_s(n_local * raw_bytes) if n_local else 0.0)
    held = n_local  # chunks whose KV is in the engine
    energy = 0.0
    for i, a in enumerate(actions):
        if a != COMPUTE:
            continue
        waiting = [arrivals[k] for k in range(held, i) if k in arrivals]
        if waiting:  # streamed chunks before i must be injected first
            t = max(t, max(waiting)) + cost.inject_s(i * raw_bytes)
        t += cost.compute_s(i)
        energy += cost.compute_j(i)
        held = i + 1
    if any(k >= held for k in arrivals):
        t = max(t, max(arrivals.values())) + cost.inject_s(len(actions) * raw_bytes)
    energy += sum(cost.receive_j(wire) for _ in arrivals)
    return t - start_s, energy


def _candidates(fixed: Sequence[ChunkAction], free: list[int],
                exhaustive_up_to: int) -> Iterator[tuple[ChunkAction, ...]]:
    free_set = set(free)

    def build(stream: set[int]) -> tuple[ChunkAction, ...]:
        return tuple(a if i not in free_set else (STREAM if i in stream else COMPUTE)
                     for i, a in enumerate(fixed))

    if len(free) <= exhaustive_up_to:
        for bits in itertools.product((False, True), repeat=len(free)):
            yield build({i for i, b in zip(free, bits) if b})
        return
    for k in range(len(free) + 1):
        yield build(set(free[k:]))  # compute first k, stream the rest
        yield build(set(free[:k]))  # stream first k, compute the rest
        for m in range(k + 1, len(free) + 1):
            yield build(set(free[k:m]))  # stream a middle run


def plan(n_chunks: int, local: Sequence[bool], available: Sequence[bool], raw_bytes: int,
         cost: CostModel, *, objective: str = "ttft", ttft_slack: float = 0.1,
         exhaustive_up_to: int = 10) -> Plan:
    """Choose an action per chunk. `local[i]`: chunk i is in the device's cache (then it is
    loaded from there, as must every chunk before it be); `available[i]`: the server has it."""
    if objective not in ("ttft", "energy"):
        raise ValueError(f"objective must be 'ttft' or 'energy', not {objective!r}")
    j = 0
    while j < n_chunks and local[j]:
        j += 1
    fixed = [LOCAL] * j + [COMPUTE] * (n_chunks - j)
    free = [i for i in range(j, n_chunks) if available[i]]
    all_local = tuple(fixed)
    all_stream = tuple(STREAM if i in free else a for i, a in enumerate(fixed))
    scored = []
    candidates = _candidates(fixed, free, exhaustive_up_to)
    for actions in itertools.chain([all_local, all_stream], candidates):
        t, e = simulate(actions, raw_bytes, cost)
        scored.append((t, e, actions))
    best_t = min(s[0] for s in scored)
    if objective == "energy":
        ok = [s for s in scored if s[0] <= best_t * (1 + ttft_slack)]
        t, e, actions = min(ok, key=lambda s: (s[1], s[0]))
    else:
        t, e, actions = min(scored, key=lambda s: (s[0], s[1]))
    return Plan(actions, t, e, simulate(all_local, raw_bytes, cost)[0],
                simulate(all_stream, raw_bytes, cost)[0])
