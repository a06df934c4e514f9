"""The fault matrix's shared half (`faults.py` is the matrix and its worker): prompts, cold
outputs, cache directories, worker processes and their events, store checks and rows. The
fault modules (`faults_local`, `faults_load`, `faults_redis`) build their rows with these, and
`faults` runs them: none of them imports `faults`, so the harness has no import cycle.

`engine="fake"` runs the workers and cold outputs on the fake engine (the tests' harness
checks); the matrix runs on llama.cpp.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from edgekv_bench.texts import MANUAL, QUESTIONS, SYSTEM_PROMPT

__all__ = [
    "DEFAULTS", "Fault", "HarnessError", "RemovalLog", "Watched", "acked", "answers",
    "check_store", "child_env", "cold_outputs", "cold_texts", "count_wrong", "drop_dac_override",
    "edgekv_cmd", "entry_counts", "failed_row", "fault_prompts", "first_answer_s",
    "fragment_files", "in_flight", "make_row", "new_cache_dir", "open_engine", "read_events",
    "readable_entries", "removed", "run_worker", "start_worker", "template_dir", "unseen",
    "write_prompts",
]

log = logging.getLogger(__name__)

# `harness/`, the folder holding this package (children import `edgekv_harness` from it)
HARNESS_ROOT = Path(__file__).resolve().parent.parent

Fault = Callable[[Path, dict[str, Any]], dict[str, Any]]

DEFAULTS: dict[str, Any] = {"model": None, "duration": 120.0, "kills": 50, "seed": 0,
                            "requests": 12, "max_tokens": 12, "n_ctx": 2048,
                            "engine": "llamacpp"}


class HarnessError(RuntimeError):
    """The harness could not measure its fault (a helper thread raised, a child it needs died):
    the row is failed, its counts None, never zero."""


class Watched(threading.Thread):
    """A daemon thread that keeps what it raised (`error`): a harness thread that dies must
    fail its row (`check`), not leave it with fewer requests that all look right."""

    def __init__(self, target: Callable[..., Any], *args: Any, name: str | None = None) -> None:
        super().__init__(target=target, args=args, name=name or getattr(target, "__name__", None),
                         daemon=True)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as e:  # noqa: BLE001 - kept, and raised by `check`
            self.error = e

    @staticmethod
    def check(threads: Iterable[Watched]) -> None:
        """Raise `HarnessError` for the first of `threads` that raised."""
        for t in threads:
            if t.error is not None:
                raise HarnessError(f"harness thread {t.name} died: {reason(t.error)}") \
                    from t.error


def reason(e: BaseException) -> str:
    """An exception as a short line: its type and the first line of its message."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200]}" if msg else type(e).__name__


# -- shared helpers (public: faults_redis uses them) -------------------------------------------

def fault_prompts(n: int = 12, seed: int = 0) -> list[str]:
    """`n` prompts of 150-420 tokens that share prefixes (a system prompt and a manual cut at a
    few lengths, then a question), so that warm requests reuse whole and partial chains."""
    rng = random.Random(seed)
    cuts = (600, 1100, 1500)
    out = []
    for i in range(n):
        cut = cuts[i % len(cuts)]
        q = QUESTIONS[(i // len(cuts) + rng.randrange(len(QUESTIONS))) % len(QUESTIONS)]
        out.append(f"{SYSTEM_PROMPT}\n\n{MANUAL[:cut]}\n\nQuestion: {q}\nAnswer:")
    return list(dict.fromkeys(out))  # distinct, in order


def edgekv_cmd(*args: str) -> list[str]:
    """The command line of an `edgekv` child process (this interpreter, `-m edgekv`)."""
    return [sys.executable, "-m", "edgekv", *args]


def child_env(cache_dir: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a child: offline, the cache directory, plus `EDGEKV_*` overrides."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    # the worker is `python -m edgekv_harness.faults`: the harness folder goes on its path
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HARNESS_ROOT), env.get("PYTHONPATH")) if p)
    if cache_dir is not None:
        env["EDGEKV_CACHE_DIR"] = str(cache_dir)
    env.update(extra)
    return env


_TEMPLATE_PARTS = ("fingerprints", "probes", "models")


def template_dir() -> Path:
    """Where the per-engine records (model fingerprint memo, batch-invariance probe, exported
    MiniLM) are computed once and copied into every fault's cache directory: without it each
    fresh directory would spend ~50 s probing the engine before its first request."""
    env = os.environ.get("EDGEKV_FAULTS_TEMPLATE")
    d = Path(env) if env else Path(tempfile.gettempdir()) / f"edgekv-faults-template-{os.getuid()}"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def new_cache_dir(path: Path, *, semantic: bool = False) -> Path:
    """A fresh cache directory at `path` holding copies of the template's engine records."""
    path.mkdir(parents=True, exist_ok=True)
    tpl = template_dir()
    if semantic and not (tpl / "models").is_dir():
        # MiniLM is exported to ONNX into the template once, in a child: importing usearch
        # (the semantic index) before llama.cpp loads a model breaks the model's vocabulary
        # load (std::bad_cast), and this process loads models after this call
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                        "from edgekv.semantic import MiniLMEmbedder; "
                        "MiniLMEmbedder(Path(sys.argv[1]))", str(tpl)],
                       check=True, env=child_env(), capture_output=True)
    for part in _TEMPLATE_PARTS:
        if part == "models" and not semantic:
            continue
        if (tpl / part).is_dir() and not (path / part).exists():
            shutil.copytree(tpl / part, path / part)
    return path


_REFS: dict[tuple[Any, ...], Any] = {}
_COLD: dict[tuple[Any, ...], list[int]] = {}


def open_engine(engine: str, model: str | None, cfg: Any, n_ctx: int, semantic: bool) -> Any:
    """An EdgeKV on llama.cpp (the matrix) or on the fake engine (the harness's tests) over
    the default RAM + disk store of `cfg`."""
    if engine == "fake":
        from edgekv.core.pipeline import EdgeKV
        from edgekv.engines.fake import FakeAdapter
        from edgekv.store import open_store

        return EdgeKV(FakeAdapter(n_ctx=max(n_ctx, 4096)), open_store(cfg), cfg)
    from edgekv import open_llamacpp

    return open_llamacpp(model, cfg, n_ctx=n_ctx, semantic=semantic)


def _reference(model: str | None, n_ctx: int, engine: str = "llamacpp") -> Any:
    """The in-process engine that computes cold outputs (one per engine, model, context)."""
    from edgekv.config import CacheConfig

    key = (engine, model, n_ctx)
    if key not in _REFS:
        cfg = CacheConfig.from_env(cache_dir=template_dir())
        _REFS[key] = open_engine(engine, model, cfg, n_ctx, semantic=False)
    return _REFS[key]


def cold_outputs(prompts: Sequence[str], opts: dict[str, Any]) -> list[list[int]]:
    """Each prompt's cold answer (token ids): the real engine, no lookup, nothing stored,
    greedy, `opts["max_tokens"]` tokens. Memoised per (engine, model, context, prompt,
    length)."""
    o = {**DEFAULTS, **opts}
    kv = _reference(o["model"], o["n_ctx"], o["engine"])
    out = []
    for p in prompts:
        key = (o["engine"], o["model"], o["n_ctx"], p, o["max_tokens"])
        if key not in _COLD:
            r = kv.generate(p, max_tokens=o["max_tokens"], use_cache=False, store=False)
            _COLD[key] = list(r.tokens)
        out.append(_COLD[key])
    return out


def cold_texts(prompts: Sequence[str], opts: dict[str, Any]) -> list[str]:
    """The cold answers as text (what `edgekv serve` returns)."""
    o = {**DEFAULTS, **opts}
    kv = _reference(o["model"], o["n_ctx"], o["engine"])
    return [kv.adapter.detokenize(t) for t in cold_outputs(prompts, opts)]


def write_prompts(path: Path, prompts: Sequence[str]) -> Path:
    path.write_text(json.dumps(list(prompts)))
    return path


def drop_dac_override() -> None:
    """`preexec_fn` for a root harness: the child loses CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH (dropped from the bounding set, so the exec'd root process does not
    get them back), so file modes bind it as they bind any user. A no-op when not root."""
    if os.getuid() != 0:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def start_worker(cache_dir: Path, prompts_file: Path, opts: dict[str, Any], *,
                 order: str = "seq", count: int = 0, until: float = 0.0, seed: int = 0,
                 semantic: bool = False, env: dict[str, str] | None = None,
                 preexec: Callable[[], None] | None = None, verbose: bool = False,
                 stderr: IO[bytes] | int | None = None) -> subprocess.Popen[bytes]:
    """Start this module's `worker`: an `edgekv` benchmark-like loop over the public API on
    `cache_dir`, answering the prompts in `prompts_file` (a JSON list) in `order` ("seq" or
    "random"), `count` of them (0: until the epoch time `until`, or forever). It prints one JSON
    event a line: `open` (seconds to open the cache), `ask` (a request starts: a kill before
    its `answer` kills it in flight), `answer` (prompt index, token ids, seconds since start,
    store errors counted so far, the store's fragment files, and the keys its disk tier removed
    since the last answer: `evicted` by capacity or TTL, `damaged`), `done`. `opts["engine"]
    = "fake"` runs it on the fake engine, each request taking at least `opts["fake_delay_s"]`."""
    o = {**DEFAULTS, **opts}
    cmd = [sys.executable, "-m", "edgekv_harness.faults", "worker", "--cache-dir", str(cache_dir),
           "--prompts", str(prompts_file), "--order", order, "--count", str(count),
           "--until", str(until), "--seed", str(seed), "--max-tokens", str(o["max_tokens"]),
           "--n-ctx", str(o["n_ctx"]), "--engine", str(o["engine"]),
           "--fake-delay", str(float(o.get("fake_delay_s", 0.0)))]
    if o["model"]:
        cmd += ["--model", str(o["model"])]
    if semantic:
        cmd.append("--semantic")
    if verbose:
        cmd.append("--verbose")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr,
                            env=env or child_env(cache_dir), preexec_fn=preexec)


def read_events(stream: Iterable[bytes], sink: list[dict[str, Any]] | None = None,
                ) -> list[dict[str, Any]]:
    """The worker's JSON events from its stdout, in order (lines that are not JSON, e.g. a
    line cut by kill -9, are skipped)."""
    out = sink if sink is not None else []
    for line in stream:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict):
            out.append(ev)
    return out


def fragment_files(store_dir: Path) -> dict[str, Path]:
    """The store's fragment files by key (only complete ones: temp names are skipped)."""
    try:
        return {p.stem: p for p in (store_dir / "fragments").glob("*/*.ekv")}
    except OSError:  # a directory the process may not read (the permission fault)
        return {}


def readable_entries(store_dir: Path, keys: Iterable[str] | None = None) -> set[str]:
    """The keys (of `keys`, default all) whose fragment file exists and decodes with a valid
    checksum, read straight from the files (no store is opened, so nothing is repaired)."""
    from edgekv.errors import CorruptEntry
    from edgekv.serial import decode_fragment

    files = fragment_files(store_dir)
    ok = set()
    for key in (files if keys is None else keys):
        path = files.get(key)
        if path is None:
            continue
        try:
            decode_fragment(path.read_bytes())
        except (CorruptEntry, OSError):
            continue
        ok.add(key)
    return ok


def check_store(store_dir: Path) -> dict[str, int]:
    """The disk store as a crash left it, before any process repairs it: fragment files,
    index rows, rows without a file, files without a row, damaged files, leftover temp
    files, and whether the index opens at all (`index_ok`)."""
    files = fragment_files(store_dir)
    temps = [p for p in (store_dir / "fragments").glob("*/.*.tmp")]
    rows: set[str] = set()
    index_ok = 1
    db_path = store_dir / "index.sqlite3"
    if db_path.exists():
        try:
            db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
            try:
                rows = {r[0] for r in db.execute("SELECT key FROM entries_v2")}
                if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                    index_ok = 0
            finally:
                db.close()
        except sqlite3.Error:
            index_ok = 0
    damaged = len(files) - len(readable_entries(store_dir, files))
    return {"files": len(files), "rows": len(rows), "rows_without_file": len(rows - set(files)),
            "files_without_row": len(set(files) - rows), "damaged": damaged,
            "temp_files": len(temps), "index_ok": index_ok}


def _r3(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)


def make_row(fault: str, *, runs: int | None, requests: int | None,
             wrong_outputs: int | None, lost_requests: int | None, lost_entries: int | None,
             recovery_s: float | Sequence[float | None] | None, how: str,
             status: str = "measured", **extra: Any) -> dict[str, Any]:
    """One row of the matrix with the contract keys first. `recovery_s` is one time, or one
    per recovery (None or a negative time: it did not recover): the row then holds their
    median as `recovery_s`, the worst as `recovery_s_max` (None if any did not recover) and
    `not_recovered`."""
    if recovery_s is None or isinstance(recovery_s, (int, float)):
        typical = worst = _r3(recovery_s)
        more: dict[str, Any] = {}
    else:
        ok = [float(r) for r in recovery_s if r is not None and r >= 0]
        missed = len(recovery_s) - len(ok)
        typical = _r3(statistics.median(ok)) if ok else None
        worst = _r3(max(ok)) if ok and not missed else None
        more = {"not_recovered": missed}
    return {"fault": fault, "runs": runs, "requests": requests, "wrong_outputs": wrong_outputs,
            "lost_requests": lost_requests, "lost_entries": lost_entries,
            "recovery_s": typical, "recovery_s_max": worst, **more, "status": status,
            "how": how, **extra}


def failed_row(fault: str, error: BaseException | str) -> dict[str, Any]:
    """The row of a fault whose harness crashed: nothing was measured, so every count is None
    (never 0, which reads as a pass), with the reason."""
    why = error if isinstance(error, str) else reason(error)
    return make_row(fault, runs=None, requests=None, wrong_outputs=None, lost_requests=None,
                    lost_entries=None, recovery_s=None, how="harness failed: not measured",
                    status="failed", error=why)


def answers(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "answer"]


def in_flight(events: Sequence[dict[str, Any]]) -> int:
    """Requests a worker started (`ask`) and never answered: killed in flight, if it was
    killed (0 or 1 for one worker)."""
    asks = sum(1 for e in events if e.get("event") == "ask")
    return max(0, asks - len(answers(events)))


def removed(events: Sequence[dict[str, Any]], kind: str = "evicted") -> set[str]:
    """The keys a worker's disk tier removed: `evicted` (capacity or TTL policy) or
    `damaged` (a checksum or header that failed on read)."""
    out: set[str] = set()
    for e in events:
        out.update(e.get(kind, ()))
    return out


def entry_counts(events: Sequence[dict[str, Any]], store_dir: Path,
                 written: set[str] | None = None) -> dict[str, int]:
    """Acknowledged entries (`written`, default every fragment file the workers saw complete
    after an answer) against what the store holds now, by key, each file's checksum verified:
    `lost_entries` are gone or damaged with no policy to explain it, `evicted_entries` are gone
    because the store's capacity or TTL policy removed them (reported by the worker's disk
    tier: not lost, shown apart)."""
    acked_keys = acked(events) if written is None else written
    gone = acked_keys - readable_entries(store_dir, acked_keys)
    evicted = gone & removed(events, "evicted")
    return {"acked_entries": len(acked_keys), "lost_entries": len(gone - evicted),
            "evicted_entries": len(evicted)}


def unseen(events: Sequence[dict[str, Any]], written: set[str]) -> int:
    """Of `written`, the entries a worker under a fault never saw in the store (it could not
    list or read them): unavailable while the fault lasts, not lost."""
    return len(written - acked(events))


def count_wrong(events: Sequence[dict[str, Any]], cold: Sequence[Sequence[int]]) -> int:
    """Answers whose token ids differ from their prompt's cold run."""
    return sum(list(e["tokens"]) != list(cold[e["p"]]) for e in answers(events))


def acked(events: Sequence[dict[str, Any]]) -> set[str]:
    """Every fragment file a worker saw complete in the store after one of its answers."""
    out: set[str] = set()
    for e in answers(events):
        out.update(e.get("files", ()))
    return out


def run_worker(cache_dir: Path, prompts_file: Path, opts: dict[str, Any], *,
               timeout: float = 1800.0, **kw: Any) -> tuple[int, list[dict[str, Any]], str]:
    """Run a worker to its end; (exit status, events, stderr text)."""
    with tempfile.TemporaryFile() as err:
        proc = start_worker(cache_dir, prompts_file, opts, stderr=err, **kw)
        assert proc.stdout is not None
        with proc.stdout:
            events = read_events(proc.stdout)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        err.seek(0)
        return rc, events, err.read().decode(errors="replace")


def first_answer_s(events: Sequence[dict[str, Any]]) -> float | None:
    """Seconds from a worker's start to its first answer (open + first request)."""
    a = answers(events)
    return float(a[0]["s"]) if a else None

# -- the worker (a child process) --------------------------------------------------------------

class RemovalLog:
    """The keys a store tier removes, by cause: `damaged` when its corrupt-entry count went up
    with the removal (a checksum or header failed on read), else `evicted` (its capacity or TTL
    policy, or a delete the process asked for: the harness's workers ask none). An acknowledged
    entry that is gone and was evicted is not lost; one gone without a removal here is."""

    def __init__(self, tier: Any) -> None:
        self._tier = tier
        self._gone: dict[str, list[str]] = {"evicted": [], "damaged": []}
        self._corrupt = self._count()
        tier.add_remove_listener(self._on_remove)

    def _count(self) -> int:
        try:
            return int(self._tier.stats().corrupt)
        except Exception:  # noqa: BLE001 - an index that cannot answer: no new damage known
            return getattr(self, "_corrupt", 0)

    def _on_remove(self, key: str) -> None:  # called inside the tier's `delete`
        corrupt = self._count()
        self._gone["damaged" if corrupt > self._corrupt else "evicted"].append(key)
        self._corrupt = corrupt

    def drain(self) -> dict[str, list[str]]:
        """The keys removed since the last drain, by cause."""
        out = {k: sorted(set(v)) for k, v in self._gone.items()}
        for v in self._gone.values():
            v.clear()
        return out
