"""Resource faults and privacy at rest. Fast: the disk store under a failing directory (a
real OS error: the shard directories are blocked by plain files), modes under umask 022.
Real: the fault matrix's rows with the real engine in child processes (a full tmpfs or
RLIMIT_FSIZE, a read-only bind mount or modes, a store directory with mode 000, a squeezed
RAM tier), each answer compared with its cold run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat

import pytest

from edgekv import CacheConfig, EdgeKV, StoreError, open_store
from edgekv.engines.fake import FakeAdapter
from edgekv.errors import ConfigError
from edgekv.store import DiskStore
from edgekv_harness import faults
from edgekv_harness.faults import make_row, run_cli
from tests.conftest import real_stack


def _block_shards(root):
    """Every shard directory name taken by a plain file: each write fails in the kernel."""
    frags = root / "fragments"
    frags.mkdir(parents=True, exist_ok=True)
    for i in range(256):
        (frags / f"{i:02x}").write_bytes(b"")


def _unblock(root):
    for p in (root / "fragments").iterdir():
        if p.is_file():
            p.unlink()


def test_failing_writes_are_counted_and_logged_once(tmp_path, fragment_factory, caplog):
    store = DiskStore(tmp_path, 10**9)
    _block_shards(tmp_path)
    caplog.set_level(logging.DEBUG, logger="edgekv.store.disk")
    for i in range(5):
        with pytest.raises(StoreError):
            store.put(f"{i:02x}ab", fragment_factory(chain_key=f"{i:02x}ab"))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "failed" in warnings[0].getMessage()
    assert store.stats().errors == 5
    _unblock(tmp_path)
    store.put("00ab", fragment_factory(chain_key="00ab"))
    assert store.get("00ab") is not None
    assert any("succeed again" in r.getMessage() for r in caplog.records)
    store.close()


def test_generate_answers_by_local_compute_when_the_disk_fails(tmp_path, caplog):
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path, reuse_granularity="chunk",
                      ram_capacity_bytes=0)  # no RAM tier to hide the disk
    kv = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
    _block_shards(tmp_path / "store")
    prompt = list(range(1, 200))
    cold = kv.generate(prompt, max_tokens=6, use_cache=False)
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        r = kv.generate(prompt, max_tokens=6)
        assert r.tokens == cold.tokens and r.cached_tokens == 0
    disk = kv.store.tier_stats()[-1]
    assert disk.errors >= 3
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    kv.store.close()


def test_cache_dir_and_store_files_are_private(tmp_path, fragment_factory):
    old = os.umask(0o022)
    try:
        cache = tmp_path / "cache"
        cfg = CacheConfig(chunk_size=64, cache_dir=cache, reuse_granularity="chunk")
        kv = EdgeKV(FakeAdapter(), open_store(cfg), cfg)
        kv.generate(list(range(1, 200)), max_tokens=4)
        kv.store.close()
    finally:
        os.umask(old)
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in [cache, *cache.rglob("*")]}
    assert len(modes) > 4
    loose = {str(p): oct(m) for p, m in modes.items() if m & 0o077}
    assert not loose


def test_make_private_never_adds_permissions(tmp_path):
    from edgekv.store.disk import make_private

    d = tmp_path / "ro"
    d.mkdir()
    os.chmod(d, 0o555)
    make_private(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o500
    os.chmod(d, 0o700)


def test_unknown_fault_is_refused(tmp_path):
    args = argparse.Namespace(targets="no_such_fault", cache_dir=str(tmp_path), model=None,
                              duration=None, kills=None, requests=None, max_tokens=None,
                              n_ctx=None, seed=0)
    with pytest.raises(ConfigError, match="unknown fault"):
        run_cli(args)


def test_rows_carry_the_contract_keys():
    row = make_row("x", runs=1, requests=2, wrong_outputs=0, lost_requests=0, lost_entries=0,
                   recovery_s=1.23456, how="h")
    assert list(row)[:7] == ["fault", "runs", "requests", "wrong_outputs", "lost_requests",
                             "lost_entries", "recovery_s"]
    assert row["recovery_s"] == 1.235
    assert row["recovery_s_max"] == 1.235 and row["status"] == "measured"


# -- what goes missing: failed harnesses, evictions, kills in flight, the worst recovery ------

def _fine(work, o):
    return make_row("fine", runs=1, requests=2, wrong_outputs=0, lost_requests=0,
                    lost_entries=0, recovery_s=0.5, how="h")


def test_a_harness_that_raises_is_a_failed_row_with_null_counts(tmp_path):
    def boom(work, o):
        raise ValueError("no model here\nsecond line of detail")

    rows = faults.run_faults(None, {}, tmp_path, registry={"boom": boom, "fine": _fine})
    bad, good = rows
    assert bad["status"] == "failed" and bad["error"] == "ValueError: no model here"
    for key in ("runs", "requests", "wrong_outputs", "lost_requests", "lost_entries",
                "recovery_s", "recovery_s_max"):
        assert bad[key] is None, key  # never 0: a crash must not read as a pass
    assert good["status"] == "measured" and good["requests"] == 2
    res = {"rows": rows, **faults.summarize(rows), "options": dict(faults.DEFAULTS)}
    assert res["failed_rows"] == ["boom"] and res["measured_rows"] == 1
    assert json.loads(json.dumps(res))["rows"][0]["wrong_outputs"] is None
    text = faults.faults_table(res)
    line = next(ln for ln in text.splitlines() if ln.startswith("| boom"))
    assert "FAILED" in line and "not measured" in line and "| 0 " not in line
    assert "1 of 2 rows FAILED" in text


def test_a_harness_thread_that_dies_fails_its_row(tmp_path):
    def loses_its_client(work, o):
        def client():
            raise KeyError("choices")

        t = faults.Watched(client)
        t.start()
        t.join()
        faults.Watched.check([t])
        return _fine(work, o)  # never reached: the thread's death is not swallowed

    row, = faults.run_faults(None, {}, tmp_path, registry={"x": loses_its_client})
    assert row["status"] == "failed" and row["requests"] is None
    assert "client" in row["error"] and "KeyError" in row["error"]


def test_a_row_that_made_no_request_is_failed(tmp_path):
    def idle(work, o):
        return make_row("idle", runs=1, requests=0, wrong_outputs=0, lost_requests=0,
                        lost_entries=0, recovery_s=None, how="h")

    row, = faults.run_faults(None, {}, tmp_path, registry={"idle": idle})
    assert row["status"] == "failed" and row["lost_entries"] is None
    assert "nothing was measured" in row["error"]


def test_recovery_reports_the_median_and_the_worst():
    row = make_row("k", runs=3, requests=3, wrong_outputs=0, lost_requests=0, lost_entries=0,
                   recovery_s=[25.0, 127.6, 20.0, 30.0], how="h")
    assert row["recovery_s"] == 27.5 and row["recovery_s_max"] == 127.6
    assert row["not_recovered"] == 0
    never = make_row("k", runs=2, requests=2, wrong_outputs=0, lost_requests=0, lost_entries=0,
                     recovery_s=[3.0, -1.0, None], how="h")
    assert never["recovery_s"] == 3.0 and never["recovery_s_max"] is None
    assert never["not_recovered"] == 2
    text = faults.faults_table({"rows": [row, never]})
    assert "127.6" in text and "never (2)" in text


def test_evicted_and_damaged_entries_are_kept_apart_from_lost(tmp_path, fragment_factory):
    """A real disk store: an entry its capacity policy evicts is evicted (not lost), a damaged
    one it drops on read is lost, as is one whose file vanished with no removal at all."""
    frag = fragment_factory(chain_key="c0")
    size = len(__import__("edgekv.serial", fromlist=["x"]).encode_fragment(frag))
    store = DiskStore(tmp_path, int(size * 3.5))  # room for 3 entries
    log = faults.RemovalLog(store)
    keys = [f"{i:02x}ab" for i in range(5)]
    for i, k in enumerate(keys[:4]):
        store.put(k, fragment_factory(chain_key=k, seed=i))
    first = {"event": "answer", "files": sorted(faults.fragment_files(tmp_path)), **log.drain()}
    assert first["evicted"] == [keys[0]] and first["damaged"] == []
    store.put(keys[4], fragment_factory(chain_key=keys[4], seed=4))  # evicts keys[1]
    path = faults.fragment_files(tmp_path)[keys[2]]
    path.write_bytes(path.read_bytes()[:-7] + b"garbage")  # damaged on disk
    assert store.get(keys[2]) is None  # read: checksum fails, the store drops it
    faults.fragment_files(tmp_path)[keys[3]].unlink()  # vanishes: nobody removed it
    second = {"event": "answer", "files": sorted(faults.fragment_files(tmp_path)), **log.drain()}
    assert second["evicted"] == [keys[1]] and second["damaged"] == [keys[2]]
    counts = faults.entry_counts([first, second], tmp_path)
    assert counts == {"acked_entries": 4, "lost_entries": 2, "evicted_entries": 1}
    store.close()


def test_unavailable_entries_are_the_ones_a_faulted_process_could_not_see():
    ev = [{"event": "answer", "files": ["a", "b"]}, {"event": "answer", "files": ["b"]}]
    assert faults.unseen(ev, {"a", "b", "c", "d"}) == 2


def _fake_opts(**kw):
    return {**faults.DEFAULTS, "engine": "fake", "requests": 2, "max_tokens": 4, **kw}


def _events(proc, sink):
    import threading

    t = threading.Thread(target=faults.read_events, args=(proc.stdout, sink), daemon=True)
    t.start()
    return t


def test_a_request_killed_by_sigkill_is_counted_in_flight(tmp_path):
    """A real worker process (fake engine, each request at least 3 s): killed with SIGKILL
    as soon as its second request starts."""
    import signal
    import time

    cache = tmp_path / "cache"
    cache.mkdir()
    pf = faults.write_prompts(tmp_path / "p.json", faults.fault_prompts(2))
    ev: list = []
    proc = faults.start_worker(cache, pf, _fake_opts(fake_delay_s=3.0))
    reader = _events(proc, ev)
    try:
        while proc.poll() is None and [e["event"] for e in ev].count("ask") < 2:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader.join()
        proc.stdout.close()
    assert [e["event"] for e in ev] == ["open", "ask", "answer", "ask"], ev
    assert faults.in_flight(ev) == 1
    assert ev[2]["evicted"] == [] and ev[2]["damaged"] == [] and ev[2]["files"]


def test_a_worker_reports_what_its_disk_tier_evicts(tmp_path):
    """The real worker process with a disk tier too small for its entries: what it evicts is
    reported by key and counted as evicted, not lost."""
    cache = tmp_path / "cache"
    cache.mkdir()
    pf = faults.write_prompts(tmp_path / "p.json", faults.fault_prompts(3))
    env = faults.child_env(cache, EDGEKV_DISK_CAPACITY_BYTES=str(64 * 1024))
    rc, ev, err = faults.run_worker(cache, pf, _fake_opts(), count=3, env=env)
    assert rc == 0, err
    counts = faults.entry_counts(ev, cache / "store")
    assert counts["evicted_entries"] > 0, counts
    assert counts["lost_entries"] == 0 and counts["acked_entries"] >= counts["evicted_entries"]


def test_kill9_row_on_the_fake_engine(tmp_path):
    """The kill -9 harness end to end on real processes (fake engine; requests of 3.5 s, so
    each kill, 0-3 s after a worker's first answer, lands inside its second request)."""
    from edgekv_harness.faults_local import kill9

    row = kill9(tmp_path, _fake_opts(kills=2, seed=0, fake_delay_s=3.5))
    assert row["status"] == "measured"
    assert row["killed_in_flight"] == 2, row
    assert row["wrong_outputs"] == 0 and row["lost_requests"] == 0, row
    assert row["lost_entries"] == 0 and row["evicted_entries"] == 0, row
    assert row["requests"] == 2 + 2 + 2, row  # 2 killed workers: 1 answered + 1 killed each
    assert len(row["recovery_each_s"]) == 2 and row["not_recovered"] == 0, row
    assert row["recovery_s_max"] >= row["recovery_s"] > 0, row
    assert row["acked_entries"] > 0, row


def test_missing_permissions_counts_unavailable_entries(tmp_path):
    """Mode 000 on the store (a root harness drops the child's CAP_DAC_OVERRIDE): every entry
    of the warm run is unavailable to the next process, none is lost."""
    from edgekv_harness.faults_local import FAULTS

    row = FAULTS["missing_permissions"](tmp_path, _fake_opts(requests=3))
    assert row["wrong_outputs"] == 0 and row["lost_requests"] == 0, row
    assert row["acked_entries"] > 0 and row["unavailable_entries"] == row["acked_entries"], row
    assert row["lost_entries"] == 0, row


real_stack("llama.cpp + SmolLM2", "llama_cpp",
           check=lambda: __import__("edgekv.engines.models", fromlist=["x"]).resolve_model(None))

OPTS = {"model": None, "duration": 10, "kills": 0, "seed": 0, "requests": 3, "max_tokens": 4,
        "n_ctx": 2048}


def _clean(row):
    assert "error" not in row and row["status"] == "measured", row
    assert row["wrong_outputs"] == 0 and row["lost_requests"] == 0, row
    assert row["lost_entries"] == 0, row


@pytest.mark.parametrize("name", ["disk_full", "read_only_cache_dir", "missing_permissions"])
def test_real_resource_fault(tmp_path, name):
    from edgekv_harness.faults_local import FAULTS

    row = FAULTS[name](tmp_path, dict(OPTS))
    _clean(row)
    assert row["store_errors"] > 0 and row["errors_logged"] == 1, row
    assert row["recovery_s"] is not None, row


def test_real_ram_pressure_and_privacy_through_the_cli(tmp_path):
    args = argparse.Namespace(targets="ram_tier_pressure,privacy_at_rest",
                              cache_dir=str(tmp_path), model=None, duration=None, kills=None,
                              requests=3, max_tokens=4, n_ctx=None, seed=0)
    res, text = run_cli(args)
    json.dumps(res)
    ram, priv = res["rows"]
    _clean(ram)
    _clean(priv)
    assert ram["ram_evictions"] > 0 and ram["reused"] > 0, ram
    assert priv["cache_dir_mode"] == "700" and not priv["loose_store_modes"], priv
    assert priv["prompt_text_in_logs"] == 0, priv
    assert "ram_tier_pressure" in text


def test_real_serve_killed_under_load_recovers_from_its_disk_tier(tmp_path):
    """`edgekv serve` killed with SIGKILL twice while 8 clients stream, and started again at
    once: every request ends in a correct answer or an error its client saw (the kill cuts
    streams in flight), nothing stored is lost, and each restart serves a correct answer that
    reused the cache, after its socket listened and its /health said 200."""
    from edgekv_harness.faults_local import FAULTS

    row = FAULTS["serve_kill_under_load"](tmp_path, dict(OPTS, kills=2))
    _clean(row)
    assert row["runs"] == 2 and row["not_recovered"] == 0, row
    assert not row["unexpected"] and row["client_errors"].get("timeout", 0) == 0, row
    assert sum(row["client_errors"].values()) > 0, row
    assert row["answered"] > 0 and row["cached_answers"] > 0 and row["acked_entries"] > 0, row
    for part in row["recovery_parts_s"]:
        assert 0 < part["listen_s"] <= part["health_s"] <= part["answer_s"], row
    assert row["recovery_s_max"] >= row["recovery_s"] > 0, row
