"""`edgekv bench faults`: the fault matrix, one row per fault, measured on real processes.

Each fault is a function `(workdir, options) -> row` (options: `model`, `duration`, `kills`,
`seed`, `requests`, `max_tokens`, `n_ctx`, `engine`); a row holds `fault`, `runs`, `requests`,
`wrong_outputs`, `lost_requests`, `lost_entries`, `recovery_s` (median over the fault's
recoveries), `recovery_s_max` (the worst), `status` ("measured", or "failed" with `error` and
every count None: a harness that raised, or whose helper thread or child died, measured
nothing), and `how` the fault was made; rows add `evicted_entries` (removed by a capacity or
TTL policy: not lost, shown apart), `unavailable_entries` (there, but not readable while the
fault lasts) and `killed_in_flight` (requests running in a process killed by SIGKILL) where
they apply.
Every output is compared with the same prompt's cold (no-cache) output, computed in the same
run by the same engine (`cold_outputs`). The processes under test are real `edgekv` processes
(the CLI, `edgekv serve`, and this module's `worker`, a benchmark-like loop over the public
API) on real cache directories; faults are made with the kernel where it can be (kill -9, a
size-limited tmpfs, an unprivileged user), never by mocking the store.


The helpers the fault modules share (`fault_prompts`, `cold_outputs`, `new_cache_dir`,
`start_worker`, `read_events`, `edgekv_cmd`, `child_env`, `readable_entries`, `check_store`,
`entry_counts`, `Watched`, `make_row`, ...) live in `faults_kit` and are re-exported here.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .faults_kit import (  # noqa: F401 - re-exported: this module is the harness's face
    DEFAULTS,
    Fault,
    HarnessError,
    RemovalLog,
    Watched,
    check_store,
    child_env,
    cold_outputs,
    drop_dac_override,
    edgekv_cmd,
    entry_counts,
    failed_row,
    fault_prompts,
    fragment_files,
    in_flight,
    make_row,
    new_cache_dir,
    open_engine,
    read_events,
    readable_entries,
    run_worker,
    start_worker,
    unseen,
    write_prompts,
)

__all__ = [
    "DEFAULTS", "FAULTS", "Fault", "HarnessError", "RemovalLog", "Watched", "add_parser",
    "all_faults", "check_store", "child_env", "cold_outputs", "drop_dac_override", "edgekv_cmd",
    "entry_counts", "failed_row", "fault_prompts", "faults_table", "in_flight", "make_row",
    "new_cache_dir", "read_events", "readable_entries", "run_cli", "run_faults", "run_worker",
    "start_worker", "summarize", "unseen", "write_prompts",
]

log = logging.getLogger(__name__)


def _worker(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="edgekv_harness.faults worker")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--order", choices=["seq", "random"], default="seq")
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--until", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"])
    p.add_argument("--n-ctx", type=int, default=DEFAULTS["n_ctx"])
    p.add_argument("--model")
    p.add_argument("--engine", choices=["llamacpp", "fake"], default="llamacpp")
    p.add_argument("--fake-delay", type=float, default=0.0)
    p.add_argument("--semantic", action="store_true")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    from edgekv.config import CacheConfig

    prompts = json.loads(Path(a.prompts).read_text())
    kv = open_engine(a.engine, a.model, CacheConfig.from_env(cache_dir=Path(a.cache_dir)), a.n_ctx,
               a.semantic)
    store_dir = Path(a.cache_dir) / "store"
    removals = RemovalLog(kv.store.persistent_tier())

    def emit(**ev: Any) -> None:
        sys.stdout.write(json.dumps(ev) + "\n")
        sys.stdout.flush()

    def tier_stats() -> list[Any]:
        tiers = getattr(kv.store, "tier_stats", None)
        return list(tiers()) if tiers is not None else [kv.store.stats()]

    def errors() -> int:
        return sum(getattr(s, "errors", 0) for s in tier_stats())

    emit(event="open", s=time.perf_counter() - t0)
    rng = random.Random(a.seed)
    i = 0
    # `until` bounds the loop, but a worker always answers once (a loaded machine may take
    # longer than the whole window to load the model)
    while (a.count == 0 or i < a.count) and (a.until == 0 or time.time() < a.until or i == 0):
        idx = rng.randrange(len(prompts)) if a.order == "random" else i % len(prompts)
        emit(event="ask", i=i, p=idx)
        t_ask = time.perf_counter()
        r = kv.generate(prompts[idx], max_tokens=a.max_tokens)
        if a.engine == "fake" and a.fake_delay > 0:  # a slow fake request (harness tests)
            time.sleep(max(0.0, a.fake_delay - (time.perf_counter() - t_ask)))
        emit(event="answer", i=i, p=idx, tokens=list(r.tokens), cached=r.cached_tokens,
             s=time.perf_counter() - t0, errors=errors(),
             files=sorted(fragment_files(store_dir)) if store_dir.is_dir() else [],
             **removals.drain())
        i += 1
    stats = {s.tier: {"hits": s.hits, "misses": s.misses, "evictions": s.evictions,
                      "errors": getattr(s, "errors", 0), "corrupt": s.corrupt}
             for s in tier_stats()}
    kv.close()
    kv.adapter.close()
    emit(event="done", n=i, errors=sum(v["errors"] for v in stats.values()), stats=stats,
         **removals.drain())
    return 0


# -- the matrix ------------------------------------------------------------------------------

def all_faults() -> dict[str, Fault]:
    """This module's faults, then those of `faults_redis` where that module exists."""
    from . import faults_local

    out: dict[str, Fault] = dict(faults_local.FAULTS)
    if importlib.util.find_spec("edgekv_harness.faults_redis") is not None:
        mod = importlib.import_module("edgekv_harness.faults_redis")
        out.update(getattr(mod, "FAULTS", {}))
    return out


FAULTS = all_faults  # the registry is built on call: faults_redis may be added later


def run_faults(names: Sequence[str] | None, opts: dict[str, Any], work: Path,
               progress: Callable[[str], None] | None = None,
               registry: dict[str, Fault] | None = None) -> list[dict[str, Any]]:
    """Run the named faults (default: all) of `registry` (default: `all_faults()`), each in its
    own work directory. A fault whose harness raises (or whose row measured no request at all)
    yields a failed row (`failed_row`: counts None, `error` says why) instead of stopping the
    matrix or passing for a clean one."""
    registry = all_faults() if registry is None else registry
    unknown = [n for n in names or () if n not in registry]
    if unknown:
        from edgekv.errors import ConfigError

        raise ConfigError(f"unknown fault(s) {', '.join(unknown)}; choose from "
                          f"{', '.join(registry)}")
    rows = []
    for name in names or list(registry):
        if progress is not None:
            progress(name)
        d = work / name
        d.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            row = registry[name](d, {**DEFAULTS, **opts})
        except Exception as e:  # noqa: BLE001 - one broken harness must not hide the others
            log.exception("fault %s: the harness failed", name)
            row = failed_row(name, e)
        else:
            if row.get("status", "measured") == "measured" and not row.get("requests") \
                    and not row.get("lost_requests"):
                row = failed_row(name, "the harness made no request: nothing was measured")
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run's verdict on its own rows: `failed_rows` (faults not measured, with why)."""
    failed = [r for r in rows if r.get("status") == "failed"]
    return {"failed_rows": [r["fault"] for r in failed],
            "failed_reasons": {r["fault"]: r.get("error", "") for r in failed},
            "measured_rows": len(rows) - len(failed)}


def _cell(row: dict[str, Any], key: str) -> Any:
    """A count as the table shows it: "not measured" in a failed row, "-" where the row has no
    such count (the fault cannot cause it), "never" for a recovery that did not happen."""
    if row.get("status") == "failed":
        return "not measured"
    if key == "recovery_s_max" and row.get("not_recovered"):
        return f"never ({row['not_recovered']})"
    v = row.get(key)
    return "-" if v is None else v


_COLUMNS = (("runs", "runs"), ("requests", "requests"), ("wrong_outputs", "wrong outputs"),
            ("lost_requests", "lost requests"), ("lost_entries", "lost entries"),
            ("evicted_entries", "evicted entries"),
            ("unavailable_entries", "unavailable entries"),
            ("killed_in_flight", "killed in flight"), ("recovery_s", "recovery s (median)"),
            ("recovery_s_max", "recovery s (max)"), ("errors_logged", "errors logged"))


def faults_table(res: dict[str, Any]) -> str:
    from edgekv_bench.report import table

    rows = [[r["fault"], "FAILED" if r.get("status") == "failed" else "measured",
             *(_cell(r, k) for k, _ in _COLUMNS),
             r.get("error") or r.get("notes", "")] for r in res["rows"]]
    out = table(["fault", "status", *(h for _, h in _COLUMNS), "notes"], rows)
    failed = res.get("failed_rows") or summarize(res["rows"])["failed_rows"]
    if failed:
        out += (f"\n\n**{len(failed)} of {len(res['rows'])} rows FAILED (not measured: their "
                f"counts are null, not 0): {', '.join(failed)}.**")
    opts = res.get("options")
    if opts:
        cut = {k: (opts.get(k), DEFAULTS[k]) for k in ("duration", "kills", "requests",
                                                       "max_tokens") if opts.get(k) != DEFAULTS[k]}
        out += ("\n\nRun with " + ", ".join(f"{k}={v}" for k, v in opts.items()
                                            if k in DEFAULTS and v is not None)
                + (" (reduced from the defaults: " + ", ".join(
                    f"{k} {d} -> {v}" for k, (v, d) in cut.items()) + ")." if cut else "."))
    return out


def run_cli(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """`edgekv bench faults`: the shared bench flags to options, the matrix, its table."""
    from edgekv_bench.report import environment

    opts = dict(DEFAULTS)
    for k in ("model", "duration", "kills", "requests", "max_tokens", "n_ctx"):
        v = getattr(args, k, None)
        if v is not None:
            opts[k] = v
    opts["seed"] = getattr(args, "seed", 0) or 0
    names = [n for n in (args.targets or "").split(",") if n] or None
    root = Path(args.cache_dir) if getattr(args, "cache_dir", None) else None
    work = Path(tempfile.mkdtemp(prefix="edgekv-faults-", dir=root))
    try:
        rows = run_faults(names, opts, work, progress=lambda n: print(
            f"  fault {n} ...", file=sys.stderr, flush=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    verdict = summarize(rows)
    if verdict["failed_rows"]:
        print(f"bench faults: {len(verdict['failed_rows'])} row(s) FAILED, not measured: "
              + "; ".join(f"{k} ({v})" for k, v in verdict["failed_reasons"].items()),
              file=sys.stderr, flush=True)
    res = {"rows": rows, **verdict, "options": opts, "environment": environment(),
           "uid": os.getuid()}
    return res, faults_table(res)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """`edgekv bench faults` (registered by the CLI where a checkout holds this harness)."""
    from edgekv_bench.options import bench_parser

    p = bench_parser(sub, "faults", "the fault matrix on real processes: kill -9, disk full, "
                     "read-only, permissions, load, Redis down/full/cluster node (checkout only)",
                     run_cli, n_ctx=True)
    p.add_argument("--targets", help="comma-separated faults (default: all; the names are "
                   "the rows of docs/bench/faults.json)")
    p.add_argument("--duration", type=float, help="seconds per timed fault (concurrent "
                   f"processes, load; default {DEFAULTS['duration']:g})")
    p.add_argument("--kills", type=int, help=f"kill -9 loop length (default {DEFAULTS['kills']})")
    p.add_argument("--requests", type=int,
                   help=f"prompts per fault (default {DEFAULTS['requests']})")
    p.add_argument("--max-tokens", type=int,
                   help=f"tokens per answer (default {DEFAULTS['max_tokens']})")
    p.add_argument("--seed", type=int, default=0, help="RNG seed")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return _worker(argv[1:])
    print("usage: python -m edgekv_harness.faults worker ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
