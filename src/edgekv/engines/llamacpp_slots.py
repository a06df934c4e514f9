"""A server's slots: N sequences of one llama.cpp context, their tokens decoded together.

Why: one sequence at a time makes the fourth of four concurrent requests wait for three whole
generations before its first token, and leaves the CPU's vector units idle during decode (one
token's mat-vec streams every weight for a single row). llama-server's slots put every
request's tokens in one llama_batch under its own sequence id instead (continuous batching);
`SlotPool` does the same for EdgeKV.

How, and why it stays exact:
- One context with `n_seq_max = N` and one KV stream per sequence (llama.cpp
  `kv_unified=false`), `n_ctx` cells each. A sequence's cells start at 0 in its own stream, as
  when it runs alone, and attention reads only its own stream. That a token's numbers then do
  not depend on its batch mates is what the probe's multi-sequence schedule checks bit for bit
  (`probe_batch`); `parallel.open_slots` builds a pool only where it passed, where reuse is
  token-exact, and for models whose state one sequence can hold (no sliding window).
- Each `Slot` is a whole `KVAdapter` over its sequence id, so EdgeKV's one pipeline runs per
  request on its own thread (`EdgeKV.generate(..., sequence=slot)`): its own injection, its
  own extraction, its own token list. A slot's `prefill` hands its tokens to the pool and waits.
- The pool's thread gathers what the busy slots have handed in (a decode step's one token, a
  prompt's next piece), decodes it as one batch and hands each slot its logits. Decode tokens
  go first, then prompts' pieces in arrival order.
- Prefill never stalls decode (vLLM's chunked prefill, Sarathi-Serve's stall-free batching):
  while any generation runs, a step holds every decode token plus only as much prefill as
  fits a step budget (`step_budget_s`, `edgekv serve --step-budget-ms`), converted to tokens
  by `StepCost`, a line (fixed cost + cost per token) fitted to the steps measured so far, so
  the pieces follow the machine, the model and the load. The budget is the running streams'
  time from one token to the next: what they waited since the last step (sampling, the
  rendezvous, a slot's state read holding the context) comes off it, and a step beside the
  cache's own work on a slot's thread (`SlotPool.aside`: a lookup and injection, a store)
  is planned at the slowdown measured for such steps. With no generation running a prompt
  goes in pieces of `max_batch` (llama-server's n_batch), the fastest way to its first token.
  A piece of at least `MIN_PIECE` tokens goes in every step, so prompts progress however
  many generations run. Where a prompt is cut changes only which tokens share a batch, and
  that a token's numbers do not depend on its batch mates is what the probe checks (its
  split-prefill schedule: a prompt in pieces beside other sequences' decode steps).
- The rendezvous: a slot that just got logits samples its next token (about a millisecond) and
  hands it in. The pool waits for every such "stepping" slot, up to `gather_s` after it got
  its logits, so that their tokens share one batch rather than going out one at a time; up to
  `late_s` where the step holds a prompt's piece. A stream that misses such a step waits all
  of it (a budget's length) and then its own: on 2 cores a sampling thread waiting for the
  GIL or a core missed the 4 ms window before 4 of 644 steps of a hand run of the docs
  workload at 4 clients, and its gaps (183, 168 and 221 ms) were the run's longest. A slot
  doing anything else (a store lookup, an injection) is not waited for, nor one whose logits
  are older than the window (it went on to something else without saying).
- llama.cpp's context is not thread-safe: every call on it (decode, state read and write, cell
  removal) holds the pool's lock.
- Every computation of the pool runs on its one thread, so one OpenMP team does the work. Keep
  it the only one: a thread that computed earlier (the one that loaded the model and ran the
  probe) keeps its own idle team while it lives, libgomp then counts more threads than cores
  and cuts every barrier's spinning short: a one-sequence step took 51.62 ms instead of 10.47
  on 2 cores (docs/bench/slots-step.json, `scripts/slots_step_bench.py`). `edgekv serve`
  loads on a thread that ends with the load.
- What batching buys (SmolLM2 Q4_1, EdgeKV's batch-invariant build): a step of 1, 2, 4, 8
  sequences took 10.94, 20.23, 35.71, 59.51 ms (the same JSON). Q4_1 has no tinyBLAS, repack
  or tiled mat-mul in llama.cpp, so every weight row's dot product is computed per token, in
  stock llama.cpp as here. The gain is mostly in waiting: a request's prompt is computed
  beside the others' decoding instead of after their whole answers.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import EngineError, IncompatibleFragment, UnsupportedLayout
from ..fragment import KVFragment
from .base import EngineCounters, FragmentSpec, Generation, SharedCPU, TokenCallback
from .constraint import Constraint, Grammar
from .llamacpp_state import CellBlock, SeqState, parse_seq_state
from .shared import (
    SequenceAdapter,
    aligned_batches,
    append_length,
    build_fragments,
    check_prefill,
    injection_length,
    sample_loop,
)

if TYPE_CHECKING:
    from .llamacpp import BatchItem, LlamaCppAdapter, SequenceContext
    from .spec import Speculation

__all__ = ["Slot", "SlotPool"]

log = logging.getLogger(__name__)


MIN_PIECE = 16  # prefill tokens a step takes, whatever the budget (prompts progress); not
# where a state read or write held the context past the rendezvous and the step before fed
# the prompts: then it takes what the budget fits (a 47 ms wait beside a store, whose state
# read holds the context, and a 16-token piece made a 155 ms gap in a hand run of the docs
# workload at 4 clients)

# The piece beside running generations before any step was measured for the line (a step
# beside the cache's own work is not): the minimum. At 64, a server's first steps beside a
# stream took 232 and 249 ms on 2 AVX2 cores (SmolLM2, about 4 ms a token), a 460 ms gap.
FIRST_PIECE = MIN_PIECE


class StepCost:
    """A step's seconds as `fixed + per_token * tokens`, fitted by exponentially weighted
    least squares to the steps measured (recent ones count most: the machine's load and the
    context's length move the cost).

    Steps that share the CPU with the cache's own work (a slot looking up and injecting, or
    storing its answer's KV, on its own thread: `SlotPool.aside`) are not fitted to the line:
    they run slower by a factor of their own, `slowdown`, the weighted mean of such steps'
    measured over predicted seconds. On 2 cores a store's copies took 1.36x off the steps
    beside it (the median over a docs run at 4 clients), and budgeting those steps as if the
    cores were free made them the longest inter-token gaps of the run."""

    def __init__(self, decay: float = 0.95, slowdown_decay: float = 0.7) -> None:
        self.decay, self.slowdown_decay = decay, slowdown_decay
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self.steps = 0
        self.longest_s = 0.0
        self.slowdown = 1.0  # until a shared step was measured: none assumed

    def observe(self, tokens: int, seconds: float, *, shared: bool = False) -> None:
        self.steps += 1
        self.longest_s = max(self.longest_s, seconds)
        if shared:
            if (got := self.line()) is not None and (predicted := got[0] + got[1] * tokens) > 0:
                d = self.slowdown_decay
                self.slowdown = d * self.slowdown + (1 - d) * max(1.0, seconds / predicted)
            return
        d = self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + tokens
        self._t = d * self._t + seconds
        self._nn = d * self._nn + tokens * tokens
        self._nt = d * self._nt + tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """(fixed s, s per token) with the CPU to itself, or None before any such step."""
        if self._w == 0.0 or self._n == 0.0:
            return None
        var = self._w * self._nn - self._n * self._n
        slope = (self._w * self._nt - self._n * self._t) / var if var > 1e-9 * self._w ** 2 else 0.0
        if slope <= 0.0:  # one batch size seen so far (or noise): all of it per token
            return 0.0, self._t / self._n
        return max(0.0, (self._t - slope * self._n) / self._w), slope

    def predict(self, tokens: int, *, shared: bool = False) -> float | None:
        """A step of `tokens` tokens, in seconds (`shared`: at `slowdown`); None before any."""
        got = self.line()
        if got is None:
            return None
        return (got[0] + got[1] * tokens) * (self.slowdown if shared else 1.0)

    def tokens_within(self, budget_s: float, *, shared: bool = False) -> int | None:
        """How many tokens a step can hold in `budget_s` (`shared`: beside the cache's own
        work, at `slowdown`); None before any step."""
        got = self.line()
        if got is None:
            return None
        fixed, per_token = got
        slow = self.slowdown if shared else 1.0
        return int(max(0.0, budget_s / slow - fixed) / per_token)


@dataclass(eq=False)
class _Work:
    """Tokens one slot handed in: decoded over one or more steps, logits of the last."""

    seq: int
    tokens: list[int]
    pos: int  # the position of tokens[0]
    order: int  # arrival: prompts are served first come, first served
    sent: int = 0  # tokens already decoded
    every: bool = False  # the logits of every token (drafts to verify), not the last only
    logits: np.ndarray | None = None
    all_logits: list[np.ndarray] = field(default_factory=list)  # with `every`
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class SlotPool:
    """N slots over one llama.cpp context with a KV stream each; see the module doc."""

    def __init__(self, adapter: LlamaCppAdapter, n_seq: int, *, max_batch: int = 512,
                 gather_s: float = 0.004, late_s: float = 0.02,
                 step_budget_s: float | None = 0.1) -> None:
        if n_seq < 2:
            raise EngineError(f"a slot pool needs at least 2 sequences, got {n_seq}")
        if step_budget_s is not None and step_budget_s <= 0:
            raise EngineError(f"step_budget_s={step_budget_s} must be > 0 (None: no budget)")
        if adapter.window.swa_layers:
            raise UnsupportedLayout(
                "a sliding-window model's KV is read from the whole cache (one sequence per "
                "context), so its requests run one at a time")
        self.adapter, self.n_seq, self.max_batch = adapter, n_seq, max_batch
        self.gather_s, self.late_s = gather_s, max(gather_s, late_s)
        per_seq = -(-adapter.n_ctx // 256) * 256  # llama.cpp pads a stream to 256 cells
        self._ctx: SequenceContext = adapter.sequence_context(
            n_seq, n_seq * per_seq, unified=False, per_sequence=per_seq,
            n_batch=max(max_batch, 512))
        self._lock = threading.Lock()  # the llama.cpp context
        self._cond = threading.Condition()  # the hand-ins below
        self._pending: dict[int, _Work] = {}
        self._stepping: dict[int, float] = {}  # slots that got logits (when) and may hand in
        self._fed = False  # the last step held a prompt's piece
        self._arrivals = 0
        self._closed = False
        self._aside = 0  # slots doing the cache's own work (`aside`), CPU the steps share
        self._asides = 0  # how many such stretches began (one that began and ended inside
        # a step shared its CPU too)
        self._stepped = time.perf_counter()  # when the last step handed out its logits
        self.step_budget_s = step_budget_s
        self.cost = StepCost()
        # what batching did, for /metrics: steps decoded, tokens, the widest batch; steps
        # whose prefill the budget cut short
        self.steps = self.tokens = self.max_sequences = self.budgeted_steps = 0
        self.slots = [Slot(self, s) for s in range(n_seq)]
        self._thread = threading.Thread(target=self._loop, name="edgekv-slots", daemon=True)
        self._thread.start()

    # -- what a slot calls ---------------------------------------------------------------

    def decode(self, seq: int, tokens: Sequence[int], pos: int) -> np.ndarray:
        """Decode `tokens` of sequence `seq` from position `pos`, batched with the other
        slots' tokens; the last token's logits."""
        return self._hand_in(seq, tokens, pos, every=False).logits  # type: ignore[return-value]

    def decode_all(self, seq: int, tokens: Sequence[int], pos: int) -> list[np.ndarray]:
        """`decode`, with the logits of every token (a slot's drafts to verify, which ride in
        the same batch as the other slots' tokens)."""
        return self._hand_in(seq, tokens, pos, every=True).all_logits

    def _hand_in(self, seq: int, tokens: Sequence[int], pos: int, *, every: bool) -> _Work:
        with self._cond:
            if self._closed:
                raise EngineError("the slot pool is closed")
            work = _Work(seq, list(tokens), pos, self._arrivals, every=every)
            self._arrivals += 1
            self._pending[seq] = work
            self._stepping.pop(seq, None)
            self._cond.notify_all()
        work.done.wait()
        if work.error is not None:
            raise work.error
        assert work.logits is not None
        return work

    @contextmanager
    def aside(self) -> Iterator[None]:
        """A slot's thread does the cache's own CPU work meanwhile (a lookup and injection, a
        store): the steps beside it are planned at the slowdown measured for such steps."""
        with self._cond:
            self._aside += 1
            self._asides += 1
        try:
            yield
        finally:
            with self._cond:
                self._aside -= 1

    def leave(self, seq: int) -> None:
        """Slot `seq` does something else before its next hand-in: do not wait for it."""
        with self._cond:
            if self._stepping.pop(seq, None) is not None:
                self._cond.notify_all()

    def blob(self, seq: int) -> ctypes.Array[ctypes.c_uint8]:
        """Sequence `seq`'s state blob, a copy: the only copy made while the context is held
        (the other slots' steps wait for it)."""
        with self._lock:
            return self._ctx.read_state(seq)

    def state(self, seq: int) -> SeqState:
        fp = self.adapter.fingerprint
        return parse_seq_state(memoryview(self.blob(seq)), n_layer=fp.n_layer,
                               n_embd_k=fp.n_embd_k, n_embd_v=fp.n_embd_v)

    def write(self, seq: int, blob: bytearray | ctypes.Array[ctypes.c_uint8]) -> None:
        with self._lock:
            self._ctx.write_state(seq, blob)

    def remove(self, seq: int, start: int = 0) -> None:
        """Drop sequence `seq`'s cells from position `start` on (all of them by default)."""
        with self._lock:
            self._ctx.remove(seq, start)

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, float]:
        """Steps decoded, tokens decoded, the most sequences one step held; the step budget,
        the steps it cut, the fitted step cost and the longest step."""
        line = self.cost.line() or (0.0, 0.0)
        return {"steps": self.steps, "tokens": self.tokens,
                "max_sequences": self.max_sequences,
                "step_budget_seconds": self.step_budget_s or 0.0,
                "budgeted_steps": self.budgeted_steps,
                "step_fixed_seconds": line[0], "step_token_seconds": line[1],
                "step_longest_seconds": self.cost.longest_s,
                "step_shared_slowdown": self.cost.slowdown}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(30)
        with self._lock:
            self._ctx.close()

    # -- the batching thread -------------------------------------------------------------

    def _gather(self) -> tuple[list[_Work], bool] | None:
        """Wait for work, then for the stepping slots (each up to `gather_s` after its
        logits, `late_s` where a prompt's piece waits: the step will be long): the work,
        decode first, and whether a generation is running (a decode token in the work, or a
        slot that stepped and is still sampling); None once closed."""
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            while (late := self._late()) and (left := late - time.perf_counter()) > 0:
                self._cond.wait(left)
            work = sorted(self._pending.values(), key=lambda w: (not _decoding(w), w.order))
            running = (any(s not in self._pending for s in self._stepping)
                       or any(map(_decoding, work)))
            return work, running

    def _late(self) -> float:
        """Until when the rendezvous waits for the stepping slots that have not handed in
        (0: none to wait for); under `_cond`."""
        window = (self.late_s if any(not _decoding(w) for w in self._pending.values())
                  else self.gather_s)
        return max((t + window for s, t in self._stepping.items() if s not in self._pending),
                   default=0.0)

    def _room(self, running: bool, waited_s: float = 0.0, shared: bool = False) -> int:
        """The tokens one step may hold: `max_batch`, or with generations running what the
        step budget fits (`_plan` still adds up to `MIN_PIECE` of prefill). The budget is
        the running streams' time between two tokens, so what they already waited since the
        last step (sampling, the rendezvous, a slot's state read holding the context) comes
        off it; `shared`: the step runs beside the cache's own work (`aside`)."""
        if not running or self.step_budget_s is None:
            return self.max_batch
        fits = self.cost.tokens_within(max(0.0, self.step_budget_s - waited_s), shared=shared)
        return min(self.max_batch, FIRST_PIECE if fits is None else fits)

    def _plan(self, work: list[_Work], running: bool = False, waited_s: float = 0.0,
              shared: bool = False, held_s: float = 0.0
              ) -> tuple[list[BatchItem], list[tuple[_Work, int]]]:
        """One step's batch: every decode token, then prompts' next pieces in arrival order,
        up to `_room` tokens in all but at least `MIN_PIECE` of prefill (never over
        `max_batch`); (work, tokens taken) each. `held_s`: how long a state read or write
        held the context after the rendezvous."""
        items: list[BatchItem] = []
        taken: list[tuple[_Work, int]] = []
        budget = self._room(running, waited_s, shared)
        # the minimum piece, unless a state read or write held the streams up (longer than
        # the rendezvous waits) and the last step fed the prompts: they progress every
        # other step at least
        floor = 0 if self._fed and held_s > self.gather_s else MIN_PIECE
        prefill = 0
        for w in work:
            room = self.max_batch - len(items)
            if not _decoding(w):
                room = min(room, max(budget - len(items), floor - prefill))
            if room <= 0:
                break
            n = min(len(w.tokens) - w.sent, room)
            if not _decoding(w):
                prefill += n
                if w.sent + n < len(w.tokens) and budget < self.max_batch:
                    self.budgeted_steps += 1  # the budget, not max_batch, cut this prompt
            last = w.sent + n == len(w.tokens)
            items += [(t, w.pos + w.sent + i, w.seq, w.every or (last and i == n - 1))
                      for i, t in enumerate(w.tokens[w.sent : w.sent + n])]
            taken.append((w, n))
        return items, taken

    def _loop(self) -> None:
        while (got := self._gather()) is not None:
            work, running = got
            gathered = time.perf_counter()
            try:
                with self._lock:  # planned once it is held: a state read may have held it
                    t0 = time.perf_counter()
                    asides, shared = self._asides, self._aside > 0
                    waited = t0 - self._stepped
                    items, taken = self._plan(work, running, waited, shared, t0 - gathered)
                    predicted = (self.cost.predict(len(items), shared=shared)
                                 if log.isEnabledFor(logging.DEBUG) else None)
                    logits = self._ctx.decode(items)
                    took = time.perf_counter() - t0
                    self.cost.observe(len(items), took, shared=shared or self._asides != asides)
            except BaseException as e:  # noqa: BLE001 - handed to the slots that waited
                with self._cond:
                    for w, _ in taken:
                        self._pending.pop(w.seq, None)
                        w.error = e if isinstance(e, EngineError) else EngineError(
                            f"batched decode failed: {e}")
                        w.done.set()
                continue
            if log.isEnabledFor(logging.DEBUG):  # the budget's own account (`edgekv -vv`)
                _log_step(items, taken, running, waited, predicted, took, shared)
            self._stepped = time.perf_counter()
            self._fed = any(not _decoding(w) for w, _ in taken)
            self.steps += 1
            self.tokens += len(items)
            self.max_sequences = max(self.max_sequences, len(taken))
            out = iter(logits)
            with self._cond:
                for w, n in taken:
                    w.sent += n
                    if w.every:
                        w.all_logits += [next(out) for _ in range(n)]
                    if w.sent == len(w.tokens):
                        w.logits = w.all_logits[-1] if w.every else next(out)
                        self._pending.pop(w.seq, None)
                        self._stepping[w.seq] = self._stepped
                        w.done.set()
        with self._cond:  # closed: nobody waits forever
            for w in self._pending.values():
                w.error = EngineError("the slot pool closed")
                w.done.set()
            self._pending.clear()


def _log_step(items: list[BatchItem], taken: list[tuple[_Work, int]], running: bool,
              waited_s: float, predicted_s: float | None, took_s: float, shared: bool) -> None:
    """One step at DEBUG: its decode tokens and prefill pieces (with the context they attend
    to), the time the streams waited before it, what the cost line predicted and what it
    took, for a reader holding the step budget against the steps (the logger
    `edgekv.engines.llamacpp_slots` at DEBUG: `edgekv -vv serve`)."""
    pieces = [f"{n}@{w.pos + w.sent}" for w, n in taken if not _decoding(w)]
    decodes = sum(n for w, n in taken if _decoding(w))
    log.debug("step: %d tokens, %d decode, prefill %s, context <= %d, running %s, shared %s, "
              "waited %.1f ms, predicted %s ms, took %.1f ms", len(items), decodes,
              "+".join(pieces) or "none", max((i[1] for i in items), default=0) + 1, running,
              shared, waited_s * 1e3, "-" if predicted_s is None else f"{predicted_s * 1e3:.1f}",
              took_s * 1e3)


def _decoding(w: _Work) -> bool:
    """A generation's step (its next token, or drafts to verify), not a prompt's piece."""
    return w.every or len(w.tokens) == 1


class Slot(SequenceAdapter, SharedCPU):
    """One sequence of a `SlotPool`, as a `KVAdapter`: what `LlamaCppAdapter` does for its one
    sequence, on sequence `seq` of the pool's context. Tokenizing, templates and grammars are
    the model's, from the pool's adapter."""

    def __init__(self, pool: SlotPool, seq: int) -> None:
        base = pool.adapter
        self.pool, self.seq, self._base = pool, seq, base
        self.fingerprint, self.window = base.fingerprint, base.window
        self.weight_bytes, self.n_threads = base.weight_bytes, base.n_threads
        self.counters = EngineCounters()
        self._ids: list[int] = []  # SequenceAdapter's token list: n_tokens, token_ids
        self._n_ctx = base.n_ctx

    # -- the model's, shared ---------------------------------------------------------------

    @property
    def eos_token(self) -> int:
        return self._base.eos_token

    @property
    def n_vocab(self) -> int:
        return self._base.n_vocab

    def build_info(self) -> str:
        return f"{self._base.build_info()} slot={self.seq}/{self.pool.n_seq}"

    def chat_template(self) -> str | None:
        return self._base.chat_template()

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        return self._base.tokenize(text, add_bos=add_bos, special=special)

    def control_tokens(self) -> dict[str, int]:
        return self._base.control_tokens()

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._base.detokenize(tokens)

    def token_bytes(self, token: int) -> bytes:
        return self._base.token_bytes(token)

    def grammar_constraint(self, grammar: Grammar) -> Constraint:
        return self._base.grammar_constraint(grammar)

    # -- the sequence ----------------------------------------------------------------------

    def aside(self) -> AbstractContextManager[None]:
        """`base.SharedCPU`: the caller's cache work, beside the other slots' steps (not its
        next token: the rendezvous does not wait for it)."""
        self.pool.leave(self.seq)
        return self.pool.aside()

    def clear_kv_cache(self) -> None:
        self.pool.leave(self.seq)
        self.pool.remove(self.seq)
        self._ids = []

    def prefill(self, tokens: Sequence[int], *, align: int) -> np.ndarray:
        check_prefill(self.n_tokens, len(tokens), self.n_ctx)
        toks, base = list(tokens), self.n_tokens
        logits: np.ndarray | None = None
        for lo, hi in aligned_batches(base, len(toks), align):
            logits = self.pool.decode(self.seq, toks[lo - base : hi - base], lo)
            self._ids += toks[lo - base : hi - base]
            self.counters.add_batch(lo, hi)
        assert logits is not None
        return logits

    def verify(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """`base.DraftVerifier`: the tokens in one hand-in (batched with the other slots'),
        the logits of each."""
        check_prefill(self.n_tokens, len(tokens), self.n_ctx)
        base = self.n_tokens
        out = self.pool.decode_all(self.seq, tokens, base)
        self._ids += [int(t) for t in tokens]
        self.counters.add_batch(base, base + len(tokens))
        return out

    def truncate(self, n: int) -> None:
        """`base.DraftVerifier`: drop this sequence's cells from position n on."""
        if not 0 <= n <= self.n_tokens:
            raise EngineError(f"cannot keep {n} of {self.n_tokens} tokens")
        self.pool.remove(self.seq, n)
        del self._ids[n:]

    def generate(self, logits: np.ndarray, max_tokens: int, *, temperature: float = 0.0,
                 seed: int = 0, keep_logits: bool = False, top_p: float = 1.0,
                 on_token: TokenCallback | None = None,
                 constraint: Constraint | None = None,
                 speculation: Speculation | None = None) -> Generation:
        try:
            return sample_loop(self, logits, max_tokens, temperature=temperature, seed=seed,
                               keep_logits=keep_logits, top_p=top_p, on_token=on_token,
                               constraint=constraint, speculation=speculation)
        finally:
            self.pool.leave(self.seq)

    def read_state(self) -> SeqState:
        self.pool.leave(self.seq)
        state = self.pool.state(self.seq)
        if state.n_tokens != self.n_tokens:
            raise UnsupportedLayout(f"slot {self.seq} holds {state.n_tokens} cells for "
                                    f"{self.n_tokens} evaluated tokens")
        return state

    def extract_fragments(self, specs: Sequence[FragmentSpec]) -> list[KVFragment]:
        if not specs:
            return []
        return build_fragments(specs, self.fingerprint, self._ids, self.read_state().layer_kv)

    def inject_fragments(self, fragments: Sequence[KVFragment], limit: int | None = None) -> int:
        n = injection_length(fragments, self.fingerprint, limit, self.window)
        if n > self.n_ctx:
            raise IncompatibleFragment(f"prefix of {n} tokens exceeds the context ({self.n_ctx})")
        return self._restore(fragments, n)

    def append_fragments(self, fragments: Sequence[KVFragment]) -> int:
        held = self.n_tokens
        end = append_length(fragments, self.fingerprint, held, self.n_ctx)
        if not held:
            return self.inject_fragments(fragments)
        old, ids = self.pool.blob(self.seq), self.token_ids
        try:
            return self._restore(fragments, end, keep=self.read_state())
        except EngineError:  # refused: what the slot held is put back
            self.pool.write(self.seq, old)
            self._ids = ids
            raise

    def close(self) -> None:
        """The pool owns the context (`SlotPool.close`); a slot only lets its cells go."""
        if not self.pool.closed:
            self.clear_kv_cache()

    def _restore(self, blocks: Sequence[CellBlock], n: int, *,
                 keep: SeqState | None = None) -> int:
        """`LlamaCppAdapter.restore_cells` for this sequence: the blob is assembled by the
        model's adapter (it knows the V layout), written into this sequence's stream."""
        self.pool.leave(self.seq)
        blob, ids = self._base.assemble_cells(
            blocks, n, keep=keep, keep_ids=self._ids if keep is not None else None,
            seq_id=self.seq, n_stream=self.pool.n_seq)
        self._ids = []
        self.pool.write(self.seq, blob)  # refused: the sequence is left empty
        self._ids = [int(t) for t in ids]
        return n
