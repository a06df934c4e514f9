"""Is this engine batch-invariant? The answer decides how far strict reuse may go.

Reused KV is exact only if the engine computes the same numbers for a token whatever batch it
sits in: a cached prefix was computed in one batch shape, the new tokens after it are computed
in another, and a plain cold run of the same prompt uses a third. Whether that holds is a
property of the engine build, the model's weight types, the CPU and settings such as flash
attention (measured: an AVX2 llama.cpp build was invariant with flash attention off and not
with it on; Gemma 3's Q4_K weights were not invariant on the same build), so it is measured,
never assumed: at first use of an (engine build, model, CPU, settings) the probe runs the
shapes that reuse creates and compares the last-token logits *and* the KV of every position
bit for bit with a one-batch run:

- a prefix then the rest, split inside a chunk (reuse that ends at any token);
- a stored prefix extracted, cleared and injected back, cut mid-fragment, then the rest
  (the real reuse path, through the adapter's own extract and inject);
- a lone last token (a prompt one token longer than a cached one);
- a split just before the KV cache's padding boundary (256 cells);
- decode steps, one token at a time (the KV of generated tokens, stored for the next turn);
- 128-token aligned batches (the schedule of whole-chunk reuse);
- on a prompt of 2,040 tokens (where the context holds it): a lone last token and decode steps
  (long KV takes other kernels: flash attention splits a lone row's KV across threads from 512
  cells on, and tiles change with the KV length);
- several sequences decoded in one batch, one KV stream each (llama.cpp sequence ids,
  `probe_batch.py`): what a server that batches concurrent requests computes, against each
  sequence alone. The same with one unified KV cache is measured and recorded (`notes`), but
  does not decide: EdgeKV runs one sequence per context, and a server that batches can choose
  per-sequence streams. And one sequence's prompt in uneven pieces beside the others' decode
  steps: what a server's step budget does (stall-free prefill, `llamacpp_slots`).
- drafts verified in one batch (the last token and 7 drafts, logits at every position, 3 of
  them rejected and their cells removed) against decode steps (`probe_spec`): recorded in
  `notes` as well; it decides whether speculative decoding may run, not the granularity.

Where every schedule matches, reuse may end at any token and prefill runs in one batch, like a
plain user of the engine, whose output EdgeKV then equals bit for bit. Where any differs, the
cache falls back to whole-chunk reuse with chunk-aligned prefill (exact against its own
aligned schedule) and says so. The answer is recorded beside the cache, keyed by what it
depends on, so the probe runs once.

In two stages, where a first answer should not wait for it (`edgekv generate`, `edgekv serve`,
`load_or_probe(staged=True)`): the short schedules (280 tokens, a few seconds) run first and
are recorded with the rest `pending`; the cache starts with whole-chunk reuse, and the long
and multi-sequence schedules (`finish_probe`, tens of seconds on 2 cores) run later, in the
background; only when they pass too does reuse become token-granular.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import EdgeKVError
from .base import DraftVerifier, FragmentSpec, KVAdapter, Twinned
from .probe_spec import DRAFTS, SPEC_SCHEDULE, draft_verify_diff

__all__ = ["ProbeFinisher", "ProbeResult", "ProbeStopped", "Schedule", "cpu_identity",
           "finish_later", "finish_probe", "load_or_probe", "measure_prefill",
           "probe_batch_invariance", "probe_key", "record", "recorded_probes", "speculation_check"]

log = logging.getLogger(__name__)


@runtime_checkable
class NativeEngine(Protocol):
    """An adapter over native libraries it can name (`LlamaCppAdapter.library_dir`)."""

    def library_dir(self) -> Path | None: ...


PROBE_TOKENS = 280  # crosses a 128-token chunk boundary twice and the 256-cell KV padding
# the long prompt: 2,000+ tokens (issue 20) inside the default 2,048-token context, so four
# ubatches of 512 and a KV far past the 512 cells where a lone row's attention is split
LONG_PROBE_TOKENS = 2040
PROBE_VERSION = 3  # bump when the schedules change: older records are then re-measured
# what a short probe (`stage="short"`) leaves for `finish_probe`
LATER_STAGES = ("long schedules", "multi-sequence batch")
# environment switches that change which kernels the engine runs (ggml CPU backend; the patch
# series in patches/llama.cpp adds the first two): part of the probe's key
KERNEL_ENV = ("GGML_CPU_BATCH_INVARIANT", "GGML_CPU_USE_REF", "GGML_CPU_TILED_MM",
              "GGML_CPU_TILED_MM_FORCE", "GGML_CPU_DISABLE_FUSION", "LLAMA_CPP_LIB_PATH")

# A schedule: how the probe's tokens are fed to the engine. Each item is a batch length, or
# ("inject", n, keep): extract positions [0, n) as a fragment, clear, inject its first `keep`.
Step = int | tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    steps: tuple[Step, ...]


def schedules(n: int) -> tuple[Schedule, ...]:
    """The batch shapes reuse creates, for a probe of `n` tokens (n > 256 + 4)."""
    return (
        Schedule("prefix 131 then the rest", (131, n - 131)),
        Schedule("inject 200, keep 193, then the rest", (200, ("inject", 200, 193), n - 193)),
        Schedule("lone last token", (n - 1, 1)),
        Schedule("split before the KV padding (250 + rest)", (250, n - 250)),
        Schedule("4 decode steps", (n - 4, 1, 1, 1, 1)),
        Schedule("128-aligned chunks", tuple(min(128, n - i) for i in range(0, n, 128))),
    )


def long_schedules(n: int) -> tuple[Schedule, ...]:
    """The schedules whose kernels change with a long KV, for a probe of `n` (2,000+) tokens."""
    return (
        Schedule(f"long {n}: lone last token", (n - 1, 1)),
        Schedule(f"long {n}: 4 decode steps", (n - 4, 1, 1, 1, 1)),
    )


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The probe's answer for one engine build + model + CPU + settings."""

    invariant: bool
    key: str  # what it was measured for (see `probe_key`)
    describe: str  # the same, readable
    tokens: int
    # per schedule: (name, max |logit diff| vs one batch, KV bit-identical)
    results: tuple[tuple[str, float, bool], ...]
    sensitivity: float  # max |logit diff| when one early token changes: the probe can see
    seconds: float
    measured_at: float
    version: int = PROBE_VERSION
    long_tokens: int = 0  # the long prompt's length; 0 where the context could not hold it
    sequences: int = 0  # sequences decoded in one batch; 0 where the engine has no such batch
    # measured, recorded, not deciding (name, max |logit diff|, identical): the unified-KV batch
    notes: tuple[tuple[str, float, bool], ...] = ()
    # stages not run yet (a short probe: `LATER_STAGES`); never invariant while any is pending
    pending: tuple[str, ...] = ()

    @property
    def granularity(self) -> str:
        return "token" if self.invariant else "chunk"

    @property
    def reason(self) -> str:
        """Why this granularity, in a line (`/health`, `edgekv generate`)."""
        if self.failed:
            return "batch-invariance probe failed: " + ", ".join(self.failed)
        if self.pending:
            return (f"short batch-invariance probe passed ({len(self.results)} schedules); "
                    f"{' and '.join(self.pending)} not run yet: whole chunks until they pass")
        if self.sensitivity <= 0:
            return "batch-invariance probe could not see a changed token"
        return "batch-invariance probe passed"

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(name for name, diff, same_kv in self.results if diff != 0.0 or not same_kv)

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["granularity"] = self.granularity
        return d

    @classmethod
    def from_json(cls, d: dict[str, object]) -> ProbeResult:
        return cls(invariant=bool(d["invariant"]), key=str(d["key"]),
                   describe=str(d["describe"]), tokens=int(d["tokens"]),  # type: ignore[call-overload]
                   results=tuple((str(a), float(b), bool(c))
                                 for a, b, c in d["results"]),  # type: ignore[attr-defined]
                   sensitivity=float(d["sensitivity"]),  # type: ignore[arg-type]
                   seconds=float(d["seconds"]), measured_at=float(d["measured_at"]),  # type: ignore[arg-type]
                   version=int(d.get("version", 0)),  # type: ignore[call-overload]
                   long_tokens=int(d.get("long_tokens", 0)),  # type: ignore[call-overload]
                   sequences=int(d.get("sequences", 0)),  # type: ignore[call-overload]
                   notes=tuple((str(a), float(b), bool(c))
                               for a, b, c in d.get("notes", ())),  # type: ignore[attr-defined]
                   pending=tuple(str(x) for x in d.get("pending", ())))  # type: ignore[attr-defined]


def cpu_identity() -> tuple[str, frozenset[str]]:
    """The CPU's model name and its instruction-set flags (x86 `flags`, ARM `Features`) from
    /proc/cpuinfo; ("", empty) where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "", frozenset()
    name, flags = "", ""
    for line in text.splitlines():
        if not name and line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        elif not flags and line.startswith(("flags", "Features")):
            flags = line.split(":", 1)[1]
    return name, frozenset(flags.split())


def _cpu_model() -> str:
    """The CPU's model name and instruction-set flags: kernels are chosen from them."""
    name, flags = cpu_identity()
    if not name and not flags:
        return platform.processor() or platform.machine()
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    return f"{platform.machine()} {name} [{digest}]"


def _kernel_env() -> dict[str, str]:
    return {k: os.environ[k] for k in KERNEL_ENV if k in os.environ}


def _engine_libraries(adapter: KVAdapter) -> str:
    """Which native libraries the engine loaded (name, size, mtime of each): two builds with
    the same feature line (a patched and a stock one) must not share an answer."""
    folder = os.environ.get("LLAMA_CPP_LIB_PATH")
    if not folder and isinstance(adapter, NativeEngine):
        found = adapter.library_dir()
        folder = str(found) if found is not None else None
    if not folder or not Path(folder).is_dir():
        return ""
    files = sorted(Path(folder).glob("lib*.so*"))
    return ";".join(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files)


def probe_key(adapter: KVAdapter) -> tuple[str, str]:
    """(digest, readable form) of everything the answer depends on."""
    env = _kernel_env()
    parts: dict[str, object] = {"model": adapter.fingerprint.digest,
                                "build": adapter.build_info(), "cpu": _cpu_model(),
                                "probe": PROBE_VERSION}
    parts.update({"env": env, "libs": _engine_libraries(adapter)})
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    shown = "".join(f" {k}={v}" for k, v in env.items())
    readable = f"{adapter.fingerprint.engine} {adapter.build_info()}{shown} on {parts['cpu']}"
    return digest, readable


def probe_tokens(adapter: KVAdapter, n: int = PROBE_TOKENS) -> list[int]:
    """A fixed, ordinary text (Python's own `heapq` module source, present wherever Python is):
    nothing tuned to a workload, long enough for every schedule."""
    import heapq

    text = Path(heapq.__file__).read_text(encoding="utf-8")
    ids = adapter.tokenize(text)
    if len(ids) < n:
        ids = (ids * (n // max(1, len(ids)) + 1))
    return ids[:n]


def _run(adapter: KVAdapter, tokens: Sequence[int],
         steps: Sequence[Step]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Feed `tokens` by `steps`; return the last logits and the KV of every position."""
    adapter.clear_kv_cache()
    pos, logits = 0, None
    big = adapter.n_ctx  # an alignment no batch reaches: each step is one batch
    for step in steps:
        if isinstance(step, tuple):
            _, n, keep = step
            frag = adapter.extract_fragments([FragmentSpec("probe", 0, n)])[0]
            adapter.clear_kv_cache()
            pos = adapter.inject_fragments([frag], limit=keep)
            continue
        logits = adapter.prefill(tokens[pos : pos + step], align=big)
        pos += step
    if pos != len(tokens) or logits is None:
        raise EdgeKVError(f"probe schedule fed {pos} of {len(tokens)} tokens")
    frag = adapter.extract_fragments([FragmentSpec("probe", 0, len(tokens))])[0]
    return logits, np.asarray(frag.keys), np.asarray(frag.values)


def _compare(adapter: KVAdapter, toks: Sequence[int], plan: Sequence[Schedule],
             check: Callable[[], None] = lambda: None) -> list[tuple[str, float, bool]]:
    """Each schedule of `plan` against `toks` in one batch: (name, max |logit diff|, same KV);
    `check` runs before each (it may raise to stop)."""
    check()
    ref_logits, ref_k, ref_v = _run(adapter, toks, (len(toks),))
    out = []
    for s in plan:
        check()
        logits, k, v = _run(adapter, toks, s.steps)
        same_kv = bool(np.array_equal(k, ref_k) and np.array_equal(v, ref_v))
        out.append((s.name, float(np.max(np.abs(logits - ref_logits))), same_kv))
    return out


def probe_batch_invariance(adapter: KVAdapter, n_tokens: int = PROBE_TOKENS,
                           long_tokens: int = LONG_PROBE_TOKENS, *,
                           stage: str = "full") -> ProbeResult:
    """Run every schedule against one batch; the engine's context is left empty. The long
    schedules run where the context holds `long_tokens` (+ its 4 decode steps' slack).
    `stage="short"`: the short schedules only, the rest left `pending` for `finish_probe`."""
    if stage not in ("full", "short"):
        raise ValueError(f"stage={stage!r}: 'full' or 'short'")
    t0 = time.perf_counter()
    toks = probe_tokens(adapter, n_tokens)
    if len(toks) < 261:
        raise EdgeKVError(f"the probe needs at least 261 tokens, got {len(toks)}")
    n = len(toks)
    try:
        ref_logits, ref_k, ref_v = _run(adapter, toks, (n,))
        # the probe can see a difference: one early token changed moves the logits (on a
        # short prefix, to keep the probe fast)
        short = toks[:64]
        base = _run(adapter, short, (64,))[0]
        other = list(short)
        other[5] = (other[5] + 1) % max(2, int(ref_logits.shape[0]))
        sensitivity = float(np.max(np.abs(_run(adapter, other, (64,))[0] - base)))
        results = []
        for s in schedules(n):
            logits, k, v = _run(adapter, toks, s.steps)
            diff = float(np.max(np.abs(logits - ref_logits)))
            same_kv = bool(np.array_equal(k, ref_k) and np.array_equal(v, ref_v))
            results.append((s.name, diff, same_kv))
        # drafts verified in one batch vs decode steps (speculative decoding, `probe_spec`):
        # recorded beside the schedules, deciding speculation only, never the granularity
        draft = draft_verify_diff(adapter, toks[: 256 + DRAFTS + 1])
    finally:
        adapter.clear_kv_cache()
    key, readable = probe_key(adapter)
    first = ProbeResult(False, key, readable, n, tuple(results), sensitivity,
                        time.perf_counter() - t0, time.time(), pending=LATER_STAGES,
                        notes=() if draft is None else (draft,))
    if stage == "short":  # a failure is final: the later stages could not make it pass
        return replace(first, pending=()) if first.failed else first
    return finish_probe(adapter, first, long_tokens)


class ProbeStopped(EdgeKVError):
    """`finish_probe` was asked to stop (a server shutting down)."""


def finish_probe(adapter: KVAdapter, first: ProbeResult, long_tokens: int = LONG_PROBE_TOKENS,
                 *, stop: threading.Event | None = None) -> ProbeResult:
    """The stages a short probe (`first`) left pending: the long prompt's schedules and the
    multi-sequence batch; the whole answer. The engine's context is left empty. `stop`, once
    set, raises `ProbeStopped` before the next schedule."""
    from .probe_batch import multi_sequence_diff, multi_sequence_prompts, split_prefill_diff

    def check() -> None:
        if stop is not None and stop.is_set():
            raise ProbeStopped("the batch-invariance probe was stopped")

    if not first.pending:
        return first
    t0 = time.perf_counter()
    n_long = long_tokens if 0 < long_tokens <= adapter.n_ctx - 8 else 0
    results = list(first.results)
    sequences = 0
    notes = list(first.notes)
    try:
        if n_long:
            long_toks = probe_tokens(adapter, n_long)
            if len(long_toks) == n_long:
                results += _compare(adapter, long_toks, long_schedules(n_long), check)
            else:
                n_long = 0
        check()
        toks = probe_tokens(adapter, first.tokens)
        if not any(name == SPEC_SCHEDULE for name, _, _ in notes):  # recorded before it was
            draft = draft_verify_diff(adapter, toks[: 256 + DRAFTS + 1])
            notes += [] if draft is None else [draft]
        multi = multi_sequence_diff(adapter, toks, unified=False)
        if multi is not None:
            results.append(multi)
            sequences = len(multi_sequence_prompts(toks))
            check()
            split = split_prefill_diff(adapter, toks)  # what a server's step budget does
            if split is not None:
                results.append(split)
            check()
            unified = multi_sequence_diff(adapter, toks, unified=True)
            if unified is not None:
                notes.append(unified)
    finally:
        adapter.clear_kv_cache()
    invariant = first.sensitivity > 0 and all(d == 0.0 and same for _, d, same in results)
    return replace(first, invariant=invariant, results=tuple(results),
                   seconds=first.seconds + time.perf_counter() - t0, measured_at=time.time(),
                   long_tokens=n_long, sequences=sequences, notes=tuple(notes), pending=())


_memo: dict[str, ProbeResult] = {}  # per process: several caches over one engine probe once


def probe_path(probe_dir: Path, key: str) -> Path:
    return Path(probe_dir) / f"{key[:32]}.json"


def load_or_probe(adapter: KVAdapter, probe_dir: Path,
                  run: Callable[[KVAdapter], ProbeResult] = probe_batch_invariance, *,
                  staged: bool = False) -> ProbeResult:
    """The recorded answer for this adapter, else run the probe once and record it.

    `staged`: where nothing whole is recorded, the short stage only (recorded too, so the next
    start does not repeat it): its `pending` stages are the caller's to finish
    (`finish_probe`, then `record`). Not staged, a recorded short answer is finished here."""
    key, _ = probe_key(adapter)
    path = probe_path(probe_dir, key)
    found = _memo.get(key) or _read(path, key)
    if found is not None and (not found.pending or staged):
        if not path.exists():  # probed in this process for another cache dir: record it too
            _record(path, found)
        _memo[key] = found
        return found
    if found is not None:
        result = finish_probe(adapter, found)
    elif staged:
        result = probe_batch_invariance(adapter, stage="short")
    else:
        result = run(adapter)
    log.info("batch-invariance probe (%s): %s in %.1fs", result.describe, result.reason,
             result.seconds)
    record(probe_dir, result)
    return result


class ProbeFinisher:
    """The stages a short probe left pending, running on a thread of their own in a second
    context of the adapter's model (`Twinned.twin`: the first keeps serving). The answer is
    recorded and handed to `on_done`. The thread ends with the probe, so its engine threads
    (OpenMP's team) go with it; `stop` ends it between two schedules."""

    def __init__(self, adapter: Twinned, first: ProbeResult, probe_dir: Path,
                 on_done: Callable[[ProbeResult], object]) -> None:
        self._stop = threading.Event()
        self.result: ProbeResult | None = None
        self.thread = threading.Thread(target=self._run, args=(adapter, first, probe_dir,
                                                               on_done),
                                       name="edgekv-probe", daemon=True)
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self.thread.join(timeout)

    def _run(self, adapter: Twinned, first: ProbeResult, probe_dir: Path,
             on_done: Callable[[ProbeResult], object]) -> None:
        try:
            twin = adapter.twin()
            try:
                result = finish_probe(twin, first, stop=self._stop)
            finally:
                twin.close()
        except ProbeStopped:
            return
        except Exception as e:  # noqa: BLE001 - reported; reuse stays whole chunks
            log.warning("the batch-invariance probe's later stages failed (%s); whole-chunk "
                        "reuse", e)
            return
        record(probe_dir, result)
        log.info("batch-invariance probe (%s): %s in %.1fs", result.describe, result.reason,
                 result.seconds)
        self.result = result
        on_done(result)


def finish_later(adapter: KVAdapter, first: ProbeResult, probe_dir: Path,
                 on_done: Callable[[ProbeResult], object]) -> ProbeFinisher | None:
    """`ProbeFinisher` over `adapter`; None where it cannot open a second context (the caller
    finishes in line)."""
    return ProbeFinisher(adapter, first, probe_dir, on_done) if isinstance(adapter, Twinned) \
        else None


def record(probe_dir: Path, result: ProbeResult) -> None:
    """Keep `result` as this process's and the cache dir's answer for its key."""
    _memo[result.key] = result
    _record(probe_path(probe_dir, result.key), result)


def _read(path: Path, key: str) -> ProbeResult | None:
    try:
        found = ProbeResult.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged: measure again
    return found if found.key == key and found.version == PROBE_VERSION else None


def _record(path: Path, result: ProbeResult) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result.to_json(), indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache dir: the answer still holds for this process
        log.warning("could not record the probe result in %s (%s)", path, e)


def measure_prefill(adapter: KVAdapter, n_tokens: int = 512, runs: int = 3) -> float:
    """Median cold prefill speed (tokens/s) of `n_tokens` probe tokens in one batch."""
    toks = probe_tokens(adapter, n_tokens)
    times = []
    for _ in range(max(1, runs)):
        adapter.clear_kv_cache()
        t0 = time.perf_counter()
        adapter.prefill(toks, align=adapter.n_ctx)
        times.append(time.perf_counter() - t0)
    adapter.clear_kv_cache()
    return len(toks) / sorted(times)[len(times) // 2]


def recorded_probes(probe_dir: Path) -> list[ProbeResult]:
    """Every probe answer recorded in `probe_dir` (for `edgekv cache stats`)."""
    out = []
    for p in sorted(Path(probe_dir).glob("*.json")):
        try:
            out.append(ProbeResult.from_json(json.loads(p.read_text(encoding="utf-8"))))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


# -- may speculative decoding run? (the draft schedule's row, `probe_spec`) ----------------

_checked: dict[str, tuple[bool, str]] = {}  # per probe key, where the record lacks the row
_lock = threading.Lock()


def speculation_check(adapter: KVAdapter, probe: ProbeResult | None) -> tuple[bool, str]:
    """(whether drafts may be verified in one batch on this engine, why): from the probe's
    record (`ProbeResult`: reuse must be token-exact, and its draft row identical); where the
    record has no such row (measured before it existed), the schedule runs once now."""
    if not isinstance(adapter, DraftVerifier):
        return False, f"the {type(adapter).__name__} engine cannot verify drafts in a batch"
    if not isinstance(probe, ProbeResult):
        return False, "the batch-invariance probe did not run (reuse_granularity=chunk)"
    if probe.pending:  # a staged probe: its last stages still run
        return False, "the probe's remaining stages have not run yet"
    if not probe.invariant:
        return False, ("the engine is not batch-invariant (" + ", ".join(probe.failed)
                       + "): verified drafts would change the output")
    row = next((r for r in probe.notes if r[0] == SPEC_SCHEDULE), None)
    if row is None:
        with _lock:
            if probe.key not in _checked:
                measured = draft_verify_diff(adapter, probe_tokens(adapter))
                _checked[probe.key] = _verdict(measured)
            return _checked[probe.key]
    return _verdict(row)


def _verdict(row: tuple[str, float, bool] | None) -> tuple[bool, str]:
    if row is None:
        return False, "the engine cannot verify drafts in a batch"
    _, diff, same = row
    if same:
        return True, "probe: drafts verified in one batch equal decode steps bit for bit"
    return False, (f"probe: drafts verified in one batch differ from decode steps (max |logit "
                   f"diff| {diff:.3g}, or their KV): decoding stays plain")
