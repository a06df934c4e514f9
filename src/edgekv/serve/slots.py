"""Several requests at once, where the engine keeps every answer exact: a server's slots.

`open_slots(kv, n)` gives `n` engine sequences that one EdgeKV serves concurrently
(`EdgeKV.generate(..., sequence=slot)`, one thread per slot), their prefill and decode tokens
batched in one llama.cpp context (`engines.llamacpp_slots`), or says why the requests must run
one at a time on `kv.adapter`. Batching is exact only where a token's numbers do not depend
on the other sequences in its batch, and where the cached KV a slot reuses is what a one-batch
run computes; both are what the batch-invariance probe measures, so slots are used only where:

- the probe passed (reuse is token-exact), its multi-sequence schedule included: several
  sequences in one batch, a KV stream each, equal bit for bit to each sequence alone;
- the engine has sequence ids (llama.cpp) and the model's state fits one sequence (no
  sliding-window layers, whose KV is read from the whole cache);
- the fill step is local prefill (passage placement and SparKV loading work on one sequence
  per context).

Where any fails, `Slots.sequences` is empty, `reason` says which, and the server runs one
request at a time and says so in `/health` and `/metrics`. A first start that serves after
the probe's short stage (its multi-sequence schedule then runs in the background) runs one at
a time until that schedule passes, then opens the slots (`serve.app`).

Speed: build the EdgeKV (model load and probe) on a thread that has ended before the slots
compute, as `edgekv serve` does (see `engines.llamacpp_slots`: OpenMP teams).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.fill import LocalPrefill
from ..core.pipeline import EdgeKV
from ..engines.base import KVAdapter
from ..errors import EdgeKVError

if TYPE_CHECKING:
    from ..engines.llamacpp_slots import SlotPool

__all__ = ["PENDING", "Slots", "open_slots"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Slots:
    """What `--parallel N` got: `sequences` to run requests on (empty: one at a time on the
    EdgeKV's own adapter), and why."""

    requested: int
    sequences: tuple[KVAdapter, ...]
    reason: str
    pool: SlotPool | None = None  # behind `sequences`; closed by `close`

    @property
    def count(self) -> int:
        """Requests that run at once."""
        return len(self.sequences) or 1

    def as_dict(self) -> dict[str, object]:
        """The `parallel` object of `/health`: slots, why, how the context is shared (a KV
        stream of its own per slot, each holding a whole `--n-ctx`) and the step budget."""
        out: dict[str, object] = {"requested": self.requested, "slots": self.count,
                                  "batched": bool(self.sequences), "reason": self.reason}
        if self.pool is not None:
            budget = self.pool.step_budget_s
            out |= {"kv": "a stream per slot", "slot_tokens": self.pool.adapter.n_ctx,
                    "step_budget_ms": None if budget is None else round(budget * 1000, 3)}
        return out

    def stats(self) -> dict[str, float]:
        """For /metrics: slots, and the pool's batching counters (0 without a pool)."""
        batched = (self.pool.stats() if self.pool is not None
                   else dict.fromkeys(("steps", "tokens", "max_sequences", "budgeted_steps",
                                       "step_budget_seconds", "step_fixed_seconds",
                                       "step_token_seconds", "step_longest_seconds",
                                       "step_shared_slowdown"), 0.0))
        slot_tokens = self.pool.adapter.n_ctx if self.pool is not None else 0
        return {"slots": float(self.count), "requested": float(self.requested),
                "slot_tokens": float(slot_tokens), **{k: float(v) for k, v in batched.items()}}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


PENDING = ("one request at a time until the probe's multi-sequence schedule, running in "
           "the background, passes")


def open_slots(kv: EdgeKV, requested: int, *, step_budget_s: float | None = 0.1) -> Slots:
    """`requested` sequences over `kv`'s engine where batching them is exact (module doc),
    else none, with the reason. `step_budget_s`: the longest a step holding decode tokens
    may take, prefill pieces cut to fit (`SlotPool`; None: pieces of its `max_batch`).

    A staged first start (the probe's later stages still pending) gets none, with
    `PENDING` as the reason: open them again once the probe is whole."""
    if requested < 1:
        raise EdgeKVError(f"--parallel {requested}: give 1 or more")
    if requested == 1:
        return Slots(1, (), "one request at a time (--parallel 1)")
    if kv.probe_pending and _refusal(kv, pending_ok=True) is None:
        return Slots(requested, (), PENDING)
    why = _refusal(kv)
    if why is None:
        from ..engines.llamacpp import LlamaCppAdapter
        from ..engines.llamacpp_slots import SlotPool

        assert isinstance(kv.adapter, LlamaCppAdapter)
        try:
            pool = SlotPool(kv.adapter, requested, step_budget_s=step_budget_s)
        except EdgeKVError as e:
            why = f"the slots could not be made: {e}"
        else:
            probe = kv.probe
            told = (f"; probe: {probe.sequences} sequences in one batch, a KV stream each, "
                    "identical to each alone" if probe is not None and probe.sequences else "")
            return Slots(requested, tuple(pool.slots),
                         f"{requested} slots, prefill and decode batched{told}", pool)
    log.warning("--parallel %d: requests run one at a time (%s)", requested, why)
    return Slots(requested, (), f"one request at a time: {why}")


def _refusal(kv: EdgeKV, *, pending_ok: bool = False) -> str | None:
    """Why `kv`'s requests cannot be batched exactly; None where they can. `pending_ok`:
    leave out what the probe's pending stages decide (whether they may, once it is whole)."""
    from ..engines.llamacpp import LlamaCppAdapter

    if not isinstance(kv.adapter, LlamaCppAdapter):
        return (f"the {type(kv.adapter).__name__} engine has no sequence ids to batch "
                "requests under")
    if not isinstance(kv.fill, LocalPrefill):
        return (f"the fill step ({type(kv.fill).__name__}: passage reuse or --kv-server) "
                "works on one sequence per context")
    if pending_ok:
        pass
    elif not kv.token_exact:
        return ("reuse is whole chunks (" + kv.granularity_reason + "), so a token's numbers "
                "depend on its batch and batching would change the answers")
    elif kv.probe is None or not kv.probe.sequences:
        return "the probe did not measure several sequences in one batch on this engine"
    if kv.adapter.window.swa_layers:
        return ("the model has sliding-window layers, whose KV is read from the whole cache "
                "(one sequence per context)")
    return None
