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
from edgekv.bench.faults import make_row, run_cli
from edgekv.engines.fake import FakeAdapter
from edgekv.errors import ConfigError
from edgekv.store import DiskStore
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


real_stack("llama.cpp + SmolLM2", "llama_cpp",
           check=lambda: __import__("edgekv.engines.models", fromlist=["x"]).resolve_model(None))

OPTS = {"model": None, "duration": 10, "kills": 0, "seed": 0, "requests": 3, "max_tokens": 4,
        "n_ctx": 2048}


def _clean(row):
    assert "error" not in row, row
    assert row["wrong_outputs"] == 0 and row["lost_requests"] == 0, row
    assert row["lost_entries"] == 0, row


@pytest.mark.parametrize("name", ["disk_full", "read_only_cache_dir", "missing_permissions"])
def test_real_resource_fault(tmp_path, name):
    from edgekv.bench.faults_local import FAULTS

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
