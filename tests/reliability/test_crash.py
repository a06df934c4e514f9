"""Crash safety: what a kill -9 can leave behind is repaired by the next process that opens the
store, and the real kill loop (a worker killed at random moments while it writes fragments,
the index and the semantic index) loses nothing it acknowledged and serves cold outputs."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

from edgekv.serial import encode_fragment
from edgekv.store import DiskStore
from edgekv_harness.faults import check_store, readable_entries
from tests.conftest import real_stack


def _write_file_only(root, key, frag):
    """A fragment file renamed into place whose index row never got committed (a writer
    killed between the two)."""
    path = root / "fragments" / key[:2] / f"{key}.ekv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_fragment(frag))


def test_open_reconciles_what_a_crash_left(tmp_path, fragment_factory):
    store = DiskStore(tmp_path, 10**9)
    store.put("kept", fragment_factory(chain_key="kept"))
    store.put("gone", fragment_factory(chain_key="gone"))
    store.close()
    (tmp_path / "fragments" / "go" / "gone.ekv").unlink()  # row without its file
    _write_file_only(tmp_path, "orphan", fragment_factory(chain_key="orphan", seed=2))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    tmp = tmp_path / "fragments" / "ke" / f".kept.ekv.{dead}.1.tmp"
    tmp.write_bytes(b"half a fragm")  # a dead writer's temp file
    before = check_store(tmp_path)
    assert before["rows_without_file"] == 1 and before["files_without_row"] == 1
    assert before["temp_files"] == 1

    store = DiskStore(tmp_path, 10**9)
    assert sorted(store.keys()) == ["kept", "orphan"]
    assert store.get("orphan") is not None and store.get("gone") is None
    after = check_store(tmp_path)
    assert after == {**after, "rows_without_file": 0, "files_without_row": 0, "temp_files": 0,
                     "damaged": 0, "index_ok": 1}
    store.close()


def test_a_live_writers_temp_file_is_left_alone(tmp_path, fragment_factory):
    DiskStore(tmp_path, 10**9).put("a", fragment_factory(chain_key="a"))
    tmp = tmp_path / "fragments" / "a" / f".a.ekv.{os.getpid()}.7.tmp"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_bytes(b"in progress")
    DiskStore(tmp_path, 10**9).close()
    assert tmp.exists()


def test_torn_file_under_its_own_name_is_dropped(tmp_path, fragment_factory):
    """Only a damaged disk (not a crash: files appear by rename) can do this; the store drops
    it on open rather than serving it."""
    store = DiskStore(tmp_path, 10**9)
    store.put("t", fragment_factory(chain_key="t"))
    store.close()
    path = tmp_path / "fragments" / "t" / "t.ekv"
    path.write_bytes(path.read_bytes()[:100])
    with sqlite3.connect(tmp_path / "index.sqlite3") as db:
        db.execute("DELETE FROM entries_v2")
    store = DiskStore(tmp_path, 10**9)
    assert store.get("t") is None and not path.exists()
    store.close()


def test_kill9_during_puts_loses_only_the_write_in_flight(tmp_path):
    """A child puts fragments in a loop and prints each key once `put` returned; SIGKILL at
    a moment chosen by the child's progress; every printed key must be readable after."""
    code = textwrap.dedent(f"""
        import sys
        from edgekv.store import DiskStore
        from tests.conftest import make_fragment
        s = DiskStore({str(tmp_path)!r}, 10**9)
        for i in range(10**6):
            key = f"k{{i:06d}}"
            s.put(key, make_fragment(chain_key=key, seed=i % 7, span=256, width=64))
            print(key, flush=True)
    """)
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                cwd=os.getcwd(), text=True)
        assert proc.stdout is not None
        acked = []
        for line in proc.stdout:
            acked.append(line.strip())
            if len(acked) >= 5 + 3 * round_:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        acked += [ln.strip() for ln in proc.stdout if ln.strip()]
        proc.stdout.close()
        assert set(acked) <= readable_entries(tmp_path)
        store = DiskStore(tmp_path, 10**9)
        state = check_store(tmp_path)
        assert state["rows_without_file"] == state["files_without_row"] == 0
        assert state["temp_files"] == 0 and state["damaged"] == 0
        store.close()


real_stack("llama.cpp + SmolLM2", "llama_cpp",
           check=lambda: __import__("edgekv.engines.models", fromlist=["x"]).resolve_model(None))


def test_real_kill_loop(tmp_path):
    from edgekv_harness.faults_local import kill9

    row = kill9(tmp_path, {"model": None, "duration": 0, "kills": 3, "seed": 1,
                           "requests": 3, "max_tokens": 4, "n_ctx": 2048})
    assert row["runs"] == 3 and row["requests"] >= 3 + 3
    assert row["wrong_outputs"] == 0 and row["lost_requests"] == 0
    assert row["lost_entries"] == 0, row
    final = row["store_after_repair"]
    assert final["rows_without_file"] == final["files_without_row"] == final["damaged"] == 0
