"""Several processes on one cache directory: the store's own locking (SQLite WAL with a busy
timeout, atomic renames) keeps every acknowledged entry readable and the index consistent
with the files; with the real engine, every output equals its cold run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from edgekv.store import DiskStore
from edgekv_harness.faults import check_store, readable_entries
from tests.conftest import real_stack


def test_processes_hammering_one_store(tmp_path):
    """Three processes put, read, touch and delete overlapping keys at once; each prints the
    keys it wrote and did not delete. After: all of them readable, no torn file, no orphan."""
    code = textwrap.dedent(f"""
        import random, sys
        from edgekv.store import DiskStore
        from tests.conftest import make_fragment
        me = int(sys.argv[1])
        rng = random.Random(me)
        s = DiskStore({str(tmp_path)!r}, 10**9)
        mine = set()
        for i in range(150):
            key = f"p{{me}}-{{rng.randrange(40)}}"
            shared = f"shared-{{rng.randrange(10)}}"
            s.put(key, make_fragment(chain_key=key, seed=i, span=128, width=32))
            mine.add(key)
            s.put(shared, make_fragment(chain_key=shared, seed=7, span=128, width=32))
            got = s.get(shared)
            assert got is not None and got.chain_key == shared
            s.touch(key, 2, 0.0)
            if rng.random() < 0.2:
                s.delete(key)
                mine.discard(key)
            s.children("")
        s.close()
        print("\\n".join(sorted(mine)))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(k)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _, e in outs]
    acked = {k for out, _ in outs for k in out.split()}
    assert acked and acked <= readable_entries(tmp_path)
    state = check_store(tmp_path)
    assert state["rows_without_file"] == 0 and state["files_without_row"] == 0
    assert state["damaged"] == 0 and state["temp_files"] == 0 and state["index_ok"] == 1
    store = DiskStore(tmp_path, 10**9)
    assert set(store.keys()) >= acked
    store.close()


real_stack("llama.cpp + SmolLM2", "llama_cpp",
           check=lambda: __import__("edgekv.engines.models", fromlist=["x"]).resolve_model(None))


def test_real_processes_share_one_cache_dir(tmp_path):
    """Two worker loops, `edgekv serve` with a client and `edgekv generate` CLI runs."""
    from edgekv_harness.faults_local import concurrent

    row = concurrent(tmp_path, {"model": None, "duration": 20, "kills": 0, "seed": 0,
                                "requests": 3, "max_tokens": 4, "n_ctx": 2048})
    assert row["wrong_outputs"] == 0 and row["lost_requests"] == 0, row
    assert row["lost_entries"] == 0 and row["torn"] == 0 and row["index_consistent"], row
    assert row["requests_by_process"]["workers"] >= 2, row
