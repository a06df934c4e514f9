"""The local faults of `edgekv bench faults`: processes sharing one cache directory, kill -9
while writing, a full disk, a read-only or forbidden cache directory, a squeezed RAM tier, and
privacy at rest. Each is `(workdir, options) -> row` (see `faults`)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import resource
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .faults_kit import (
    Fault,
    HarnessError,
    Watched,
    acked,
    answers,
    check_store,
    child_env,
    cold_outputs,
    cold_texts,
    count_wrong,
    drop_dac_override,
    edgekv_cmd,
    entry_counts,
    fault_prompts,
    first_answer_s,
    in_flight,
    make_row,
    new_cache_dir,
    read_events,
    readable_entries,
    removed,
    run_worker,
    start_worker,
    unseen,
    write_prompts,
)

__all__ = ["FAULTS"]

ROOT = os.getuid() == 0


def _setup(work: Path, o: dict[str, Any], *, semantic: bool = False,
           cache: Path | None = None) -> tuple[list[str], list[list[int]], Path, Path]:
    prompts = fault_prompts(o["requests"], o["seed"])
    cold = cold_outputs(prompts, o)
    cache = new_cache_dir(cache or work / "cache", semantic=semantic)
    return prompts, cold, cache, write_prompts(cache.parent / "prompts.json", prompts)


def _logged(stderr: str) -> int:
    """Warning lines the store wrote about failures (what 'logged once' counts)."""
    return sum(1 for line in stderr.splitlines()
               if line.startswith("WARNING") and "failed (" in line)


def _errors(events: Sequence[dict[str, Any]]) -> int:
    done = [e for e in events if e.get("event") == "done"]
    a = answers(events)
    return int(done[-1]["errors"]) if done else int(a[-1]["errors"]) if a else 0


def _recovery(cache: Path, pf: Path, o: dict[str, Any], cold: list[list[int]],
              **kw: Any) -> tuple[float | None, int, int, str]:
    """The next process after the fault: open the store, serve one request. Returns (seconds
    to its first answer, wrong outputs, lost requests, stderr)."""
    rc, ev, err = run_worker(cache, pf, o, count=1, **kw)
    lost = int(rc != 0 or not answers(ev))
    return first_answer_s(ev), count_wrong(ev, cold), lost, err


def _chmod_tree(root: Path, dmode: int, fmode: int) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        with contextlib.suppress(OSError):
            os.chmod(dirpath, dmode)
        for f in filenames:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(dirpath, f), fmode)
    with contextlib.suppress(OSError):
        os.chmod(root, dmode)


# -- concurrent processes on one cache directory ---------------------------------------------

def _until(deadline: float) -> Iterator[int]:
    """0, 1, 2, ... while before `deadline`, but always the first."""
    i = 0
    while i == 0 or time.time() < deadline:
        yield i
        i += 1


def concurrent(work: Path, o: dict[str, Any]) -> dict[str, Any]:
    """Two worker loops, `edgekv serve` with a client, and a series of `edgekv generate`
    CLI processes on one cache directory for `duration` seconds."""
    prompts, cold, cache, pf = _setup(work, o)
    texts = cold_texts(prompts, o)
    until = time.time() + float(o["duration"])
    errf = (work / "stderr.txt").open("wb")
    procs = [start_worker(cache, pf, o, order="random", until=until, seed=o["seed"] + k,
                          stderr=errf) for k in range(2)]
    events: list[list[dict[str, Any]]] = [[] for _ in procs]
    readers = [threading.Thread(target=read_events, args=(p.stdout, ev), daemon=True)
               for p, ev in zip(procs, events)]
    results: dict[str, list[tuple[int, bool]]] = {"serve": [], "cli": []}  # (prompt, ok)
    failures: dict[str, int] = {"serve": 0, "cli": 0}
    rng = random.Random(o["seed"])

    def cli_loop() -> None:  # each loop runs at least once, then until the deadline
        for _ in _until(until):
            i = rng.randrange(len(prompts))
            args = ["generate", prompts[i], "--raw", "--json", "--no-semantic", "--max-tokens",
                    str(o["max_tokens"]), "--cache-dir", str(cache), "--n-ctx", str(o["n_ctx"])]
            if o["model"]:
                args += ["--model", str(o["model"])]
            r = subprocess.run(edgekv_cmd(*args), capture_output=True, env=child_env(cache),
                               timeout=1800)
            if r.returncode != 0:
                failures["cli"] += 1
                continue
            out = json.loads(r.stdout.decode().strip().splitlines()[-1])
            results["cli"].append((i, list(out["tokens"]) == cold[i]))

    serve_cmd = ["serve", "--port", "0", "--cache-dir", str(cache), "--n-ctx", str(o["n_ctx"])]
    if o["model"]:
        serve_cmd += ["--model", str(o["model"])]
    server = subprocess.Popen(edgekv_cmd(*serve_cmd), stdout=subprocess.PIPE, stderr=errf,
                              env=child_env(cache))

    def serve_loop() -> None:
        import httpx

        assert server.stdout is not None
        line = server.stdout.readline().decode()
        if "listening on " not in line:  # the server died before it listened
            raise HarnessError(f"edgekv serve exited with status {server.wait()} before "
                               "it listened (see its stderr)")
        url = line.split("listening on ", 1)[1].split()[0]
        with httpx.Client(base_url=url, timeout=600) as c:
            while c.get("/health").status_code != 200 and server.poll() is None:
                time.sleep(0.5)
            model = c.get("/v1/models").json()["data"][0]["id"]
            for _ in _until(until):
                i = rng.randrange(len(prompts))
                try:
                    r = c.post("/v1/completions", json={
                        "model": model, "prompt": prompts[i], "max_tokens": o["max_tokens"],
                        "temperature": 0})
                except httpx.HTTPError:  # the server under test died: a lost request
                    failures["serve"] += 1
                    if server.poll() is not None:
                        return
                    continue
                if r.status_code != 200:
                    failures["serve"] += 1
                    continue
                results["serve"].append((i, r.json()["choices"][0]["text"] == texts[i]))

    threads = [Watched(cli_loop), Watched(serve_loop)]
    for t in readers + threads:
        t.start()
    rcs = [p.wait() for p in procs]
    for t in readers + threads:
        t.join()
    from edgekv.serve.runner import stop_process

    serve_rc = server.poll()  # None: it was still serving (a crash is a lost request)
    stop_process(server)
    for p in [*procs, server]:
        if p.stdout is not None:
            p.stdout.close()
    errf.close()
    Watched.check(threads)
    store = cache / "store"
    state = check_store(store)
    all_events = [e for ev in events for e in ev]
    counts = entry_counts(all_events, store)
    recovery, wrong_r, lost_r, _ = _recovery(cache, pf, o, cold)
    n_other = sum(len(v) for v in results.values())
    wrong = (count_wrong(all_events, cold) + sum(not ok for v in results.values() for _, ok in v)
             + wrong_r)
    lost = sum(rc != 0 for rc in rcs) + sum(failures.values()) + lost_r
    return make_row(
        "concurrent_processes", runs=len(procs) + 2, requests=len(answers(all_events)) + n_other
        + sum(failures.values()) + 1, wrong_outputs=wrong, lost_requests=lost,
        lost_entries=counts["lost_entries"],
        recovery_s=recovery, how=f"2 worker loops + `edgekv serve` (HTTP client) + `edgekv "
        f"generate` CLI processes one after another, on one cache directory for "
        f"{o['duration']:.0f} s; SQLite WAL + busy timeout, atomic renames",
        evicted_entries=counts["evicted_entries"], acked_entries=counts["acked_entries"],
        requests_by_process={"workers": len(answers(all_events)), **{
            k: len(v) for k, v in results.items()}},
        failed_by_process={"workers": sum(rc != 0 for rc in rcs), **failures},
        serve_exit=serve_rc,
        store_after=state, torn=state["damaged"] + state["temp_files"],
        index_consistent=state["rows_without_file"] == 0 and state["files_without_row"] == 0
        and state["index_ok"] == 1)


# -- kill -9 while writing --------------------------------------------------------------------

def kill9(work: Path, o: dict[str, Any]) -> dict[str, Any]:
    """Loop `kills` times: a worker writes fragments, the index and the semantic index (saved
    after every addition); it is killed with SIGKILL at a random moment after its first
    answer; the next worker opens the store (repairing it) and must answer as a cold run.

    Counted apart: `killed_in_flight` (a kill that landed while a request ran: its `ask` had
    no `answer`; the kill, not the cache, ends it), `lost_entries` (acknowledged, then not
    readable after the next open, by key, checksum verified) and `evicted_entries` (removed by
    the store's own capacity or TTL policy). Recovery: each worker after a kill, from its spawn
    to its first answer (open the model and the store, repair, answer); a worker that never
    answers did not recover."""
    # find_spec, not import: importing usearch before llama.cpp loads a model makes the
    # model's vocabulary load fail with std::bad_cast (measured; see docs/reliability.md)
    semantic = o.get("engine", "llamacpp") != "fake" and \
        importlib.util.find_spec("usearch") is not None
    prompts, cold, cache, pf = _setup(work, o, semantic=semantic)
    store = cache / "store"
    env = child_env(cache, EDGEKV_INDEX_SAVE_EVERY="1")
    rng = random.Random(o["seed"])
    written: set[str] = set()
    evicted: set[str] = set()
    lost_total: set[str] = set()
    per_kill: list[int] = []
    recov: list[float | None] = []
    wrong = n_answers = failed_starts = killed = 0
    torn_seen: dict[str, int] = {"rows_without_file": 0, "files_without_row": 0,
                                 "damaged": 0, "temp_files": 0}
    errf = (work / "stderr.txt").open("wb")
    for k in range(int(o["kills"])):
        ev: list[dict[str, Any]] = []
        proc = start_worker(cache, pf, o, order="random", seed=o["seed"] * 1000 + k,
                            semantic=semantic, env=env, stderr=errf)
        reader = threading.Thread(target=read_events, args=(proc.stdout, ev), daemon=True)
        reader.start()
        while not answers(ev) and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 3.0))  # lands in prefill, decode, fragment or index writes
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader.join()
        assert proc.stdout is not None
        proc.stdout.close()
        if not answers(ev):
            failed_starts += 1
        killed += in_flight(ev) if answers(ev) else 0  # a dead start is counted as lost
        state = check_store(store)  # as the crash left it, before the next process repairs it
        for key in torn_seen:
            torn_seen[key] += state[key]
        written |= acked(ev)
        evicted |= removed(ev)
        lost_now = written - readable_entries(store, written) - evicted
        per_kill.append(len(lost_now - lost_total))
        lost_total |= lost_now
        wrong += count_wrong(ev, cold)
        n_answers += len(answers(ev))
        if k > 0:  # the first worker starts a fresh store: it recovers from nothing
            recov.append(first_answer_s(ev))
    errf.close()
    rc, ev, _ = run_worker(cache, pf, o, count=len(prompts), semantic=semantic, env=env)
    final = check_store(store)
    if int(o["kills"]) > 0:
        recov.append(first_answer_s(ev))
    wrong += count_wrong(ev, cold)
    n_answers += len(answers(ev))
    evicted |= removed(ev)
    gone = written - readable_entries(store, written)  # after the final worker, too
    lost_total |= gone - evicted
    return make_row(
        "kill9_while_writing", runs=int(o["kills"]), requests=n_answers + killed + failed_starts,
        wrong_outputs=wrong,
        lost_requests=failed_starts + int(rc != 0 or len(answers(ev)) != len(prompts)),
        lost_entries=len(lost_total), recovery_s=recov,
        how="SIGKILL at a uniform random moment 0-3 s after the worker's first answer, "
        f"{int(o['kills'])} times; fragments, SQLite index and "
        f"{'semantic index (saved after every addition)' if semantic else 'no semantic index'}"
        " being written; the next process opens (reconciles) the store and answers",
        killed_in_flight=killed, evicted_entries=len(gone & evicted),
        acked_entries=len(written), lost_entries_per_kill=per_kill,
        recovery_each_s=[None if r is None else round(r, 3) for r in recov],
        torn_after_kills=torn_seen, store_after_repair=final,
        notes="killed in flight: requests running when SIGKILL landed (counted apart from "
        "lost requests: the kill, not the cache, ends them)")


# -- resource faults ----------------------------------------------------------------------------

def _tmpfs(path: Path, size: str) -> bool:
    if not ROOT or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                        str(path)], capture_output=True)
    return r.returncode == 0


def _fsize_limit(nbytes: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


def disk_full(work: Path, o: dict[str, Any]) -> dict[str, Any]:
    """The store's file system fills up mid-run: a 4 MiB tmpfs (one fragment and a bit) when
    the harness may mount, else RLIMIT_FSIZE (writes past 2 MiB fail with EFBIG)."""
    fs = work / "fs"
    mounted = _tmpfs(fs, "4m")
    prompts, cold, cache, pf = _setup(work, o, cache=fs / "cache")
    preexec = None if mounted else _fsize_limit(2 * 1024 * 1024)
    try:
        rc, ev, err = run_worker(cache, pf, o, count=len(prompts), preexec=preexec)
        counts = entry_counts(ev, cache / "store")
        if mounted:  # free space: the same files, a larger file system
            subprocess.run(["mount", "-o", "remount,size=256m", str(fs)], check=True)
        recovery, wrong_r, lost_r, err_r = _recovery(cache, pf, o, cold)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(fs)], capture_output=True)
    return make_row(
        "disk_full", runs=1, requests=len(answers(ev)) + 1,
        wrong_outputs=count_wrong(ev, cold) + wrong_r,
        lost_requests=int(rc != 0) + len(prompts) - len(answers(ev)) + lost_r,
        lost_entries=counts["lost_entries"], recovery_s=recovery,
        how="real ENOSPC: a 4 MiB tmpfs holds the cache directory" if mounted else
        "real EFBIG: RLIMIT_FSIZE of 2 MiB on the child (no mount permission)",
        evicted_entries=counts["evicted_entries"], acked_entries=counts["acked_entries"],
        store_errors=_errors(ev), errors_logged=_logged(err),
        recovered_errors_logged=_logged(err_r))


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[str]:
    """Make `path` read-only for a child: a read-only bind mount (real EROFS, binds root too)
    where the harness may mount, else directories 0555 and files 0444 (EACCES; a root
    harness also drops the child's CAP_DAC_OVERRIDE). Yields how."""
    if ROOT and shutil.which("mount") is not None and subprocess.run(
            ["mount", "--bind", str(path), str(path)], capture_output=True).returncode == 0:
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True,
                           capture_output=True)
            yield "read-only bind mount of the cache directory (EROFS)"
        finally:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        return
    _chmod_tree(path, 0o555, 0o444)
    try:
        yield ("directories 0555, files 0444" +
               (", child without CAP_DAC_OVERRIDE (EACCES)" if ROOT else " (EACCES)"))
    finally:
        _chmod_tree(path, 0o700, 0o600)


def read_only(work: Path, o: dict[str, Any]) -> dict[str, Any]:
    """The cache directory becomes read-only after a warm run: the next process must reuse
    what is there, fail its writes cleanly and answer everything."""
    prompts, cold, cache, pf = _setup(work, o)
    half = max(1, len(prompts) // 2)
    rc0, ev0, _ = run_worker(cache, pf, o, count=half)
    written = acked(ev0)
    with _read_only(cache) as how:
        rc, ev, err = run_worker(cache, pf, o, count=len(prompts), preexec=drop_dac_override)
        counts = entry_counts(ev0 + ev, cache / "store", written)
    recovery, wrong_r, lost_r, _ = _recovery(cache, pf, o, cold)
    reused = sum(e["cached"] > 0 for e in answers(ev))
    return make_row(
        "read_only_cache_dir", runs=1, requests=len(answers(ev)) + 1,
        wrong_outputs=count_wrong(ev0, cold) + count_wrong(ev, cold) + wrong_r,
        lost_requests=int(rc0 != 0) + int(rc != 0) + len(prompts) - len(answers(ev)) + lost_r,
        lost_entries=counts["lost_entries"], recovery_s=recovery,
        how=how, evicted_entries=counts["evicted_entries"],
        unavailable_entries=unseen(ev, written) if answers(ev) else None,
        acked_entries=len(written), store_errors=_errors(ev), errors_logged=_logged(err),
        reused_from_read_only=reused)


def no_permission(work: Path, o: dict[str, Any]) -> dict[str, Any]:
    """The store directory is mode 000 (someone else's): nothing can be read or written;
    every request is answered by local compute with the RAM tier only."""
    prompts, cold, cache, pf = _setup(work, o)
    rc0, ev0, _ = run_worker(cache, pf, o, count=max(1, len(prompts) // 2))
    written = acked(ev0)
    os.chmod(cache / "store", 0o000)
    try:
        rc, ev, err = run_worker(cache, pf, o, count=len(prompts), preexec=drop_dac_override)
    finally:
        os.chmod(cache / "store", 0o700)
    counts = entry_counts(ev0 + ev, cache / "store", written)
    recovery, wrong_r, lost_r, _ = _recovery(cache, pf, o, cold)
    return make_row(
        "missing_permissions", runs=1, requests=len(answers(ev)) + 1,
        wrong_outputs=count_wrong(ev0, cold) + count_wrong(ev, cold) + wrong_r,
        lost_requests=int(rc0 != 0) + int(rc != 0) + len(prompts) - len(answers(ev)) + lost_r,
        lost_entries=counts["lost_entries"], recovery_s=recovery,
        how="store directory mode 000" + (
            ", child without CAP_DAC_OVERRIDE (EACCES)" if ROOT else " (EACCES)"),
        evicted_entries=counts["evicted_entries"],
        unavailable_entries=unseen(ev, written) if answers(ev) else None,
        acked_entries=len(written), store_errors=_errors(ev), errors_logged=_logged(err))


def ram_pressure(work: Path, o: dict[str, Any]) -> dict[str, Any]:
    """A RAM tier smaller than two fragments: every write evicts, reads fall through to disk."""
    prompts, cold, cache, pf = _setup(work, o)
    env = child_env(cache, EDGEKV_RAM_CAPACITY_BYTES=str(4 * 1024 * 1024))
    rc, ev, err = run_worker(cache, pf, o, count=2 * len(prompts), order="random",
                             seed=o["seed"], env=env)
    counts = entry_counts(ev, cache / "store")
    done = [e for e in ev if e.get("event") == "done"]
    return make_row(
        "ram_tier_pressure", runs=1, requests=len(answers(ev)),
        wrong_outputs=count_wrong(ev, cold),
        lost_requests=int(rc != 0) + 2 * len(prompts) - len(answers(ev)),
        lost_entries=counts["lost_entries"], recovery_s=None,
        how="RAM tier capped at 4 MiB (a fragment is ~3 MiB): LRU evicts on every store",
        evicted_entries=counts["evicted_entries"], acked_entries=counts["acked_entries"],
        reused=sum(e["cached"] > 0 for e in answers(ev)),
        ram_evictions=done[-1]["stats"].get("ram", {}).get("evictions") if done else None,
        errors_logged=_logged(err))


# -- privacy at rest ------------------------------------------------------------------------

def privacy(work: Path, o: dict[str, Any]) -> dict[str, Any]:
    """After a run with debug logging: the cache directory 0700, the store's files 0600, and
    no prompt text in the logs."""
    prompts, cold, cache, pf = _setup(work, o)
    old = os.umask(0o022)  # a usual umask: the code, not the umask, must make files private
    try:
        rc, ev, err = run_worker(cache, pf, o, count=len(prompts), verbose=True)
        args = ["-v", "generate", prompts[0], "--raw", "--json", "--no-semantic", "--max-tokens",
                str(o["max_tokens"]), "--cache-dir", str(cache), "--n-ctx", str(o["n_ctx"])]
        cli = subprocess.run(edgekv_cmd(*args + (["--model", o["model"]] if o["model"] else [])),
                             capture_output=True, env=child_env(cache), timeout=1800)
        err += cli.stderr.decode(errors="replace")
        cli_ok = cli.returncode == 0 and json.loads(cli.stdout)["tokens"] == cold[0]
    finally:
        os.umask(old)
    loose = []
    for dirpath, _dirs, files in os.walk(cache / "store"):
        for name in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
            mode = stat.S_IMODE(os.stat(name).st_mode)
            if mode & 0o077:
                loose.append(f"{os.path.relpath(name, cache)}={mode:o}")
    counts = entry_counts(ev, cache / "store")  # after the CLI process used the store too
    top = stat.S_IMODE(os.stat(cache).st_mode)
    needles = {p.rsplit("Question: ", 1)[1].split("\n")[0] for p in prompts}
    leaks = sum(err.count(n) for n in needles)
    return make_row(
        "privacy_at_rest", runs=1, requests=len(answers(ev)),
        wrong_outputs=count_wrong(ev, cold) + int(not cli_ok),
        lost_requests=int(rc != 0) + len(prompts) - len(answers(ev)) + int(cli.returncode != 0),
        lost_entries=counts["lost_entries"], recovery_s=None, how="worker with DEBUG "
        "logging and `edgekv -v generate`, under umask 022; modes walked, stderr searched for "
        "each prompt's question", evicted_entries=counts["evicted_entries"],
        acked_entries=counts["acked_entries"], cache_dir_mode=f"{top:o}",
        loose_store_modes=loose, prompt_text_in_logs=leaks, log_lines=len(err.splitlines()))


FAULTS: dict[str, Fault] = {
    "concurrent_processes": concurrent,
    "kill9_while_writing": kill9,
    "disk_full": disk_full,
    "read_only_cache_dir": read_only,
    "missing_permissions": no_permission,
    "ram_tier_pressure": ram_pressure,
    "privacy_at_rest": privacy,
}
with contextlib.suppress(ImportError):
    from .faults_load import load_fault, serve_kill

    FAULTS["serve_load"] = load_fault
    FAULTS["serve_kill_under_load"] = serve_kill
