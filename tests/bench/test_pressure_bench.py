"""`edgekv bench pressure` on the fake engine, small: the JSON contract, and the policies'
accounting (the figures themselves come from `edgekv bench pressure`, never from a test)."""

from __future__ import annotations

from edgekv.bench.pressure import POLICIES, Workload, pressure_table, run_pressure
from edgekv.engines.fake import FakeAdapter

KEYS = {"ratio", "policy", "reused_tokens", "hit_rate", "ttft_ms_mean", "ttft_ms_p95",
        "orphan_bytes_max"}


def test_pressure_rows_keep_the_contract(tmp_path):
    work = Workload.make(conversations=6, docs=2, turns=3, doc_tokens=128, question_tokens=16,
                         requests=14, max_tokens=4, vocab=(1, 250), seed=1)
    assert len(work.schedule) == 14 and all(0 <= t < 3 for _, t in work.schedule)
    rows = run_pressure(FakeAdapter(), work, (3,), tmp_path, 64, "fake", lambda _m: None)
    assert [r["policy"] for r in rows] == list(POLICIES)
    for r in rows:
        assert KEYS <= set(r) and r["ratio"] == 3
        assert r["ttft_ms_mean"] is None  # the fake engine's clock is not a TTFT
    by = {r["policy"]: r for r in rows}
    assert by["leaf"]["orphan_bytes_max"] == 0 and by["unbounded"]["orphan_bytes_max"] == 0
    assert by["unbounded"]["reused_tokens"] >= max(by["lru"]["reused_tokens"],
                                                   by["leaf"]["reused_tokens"])
    # the tier is a ratio of what the workload needs: freeing the tails a longer path repeats
    # loses no reuse (the leaf index never full reuses what a cache that frees nothing does)
    # and holds no more than it
    u = by["unbounded"]
    assert u["unique_reused_tokens"] == u["reused_tokens"]
    assert 0 < u["kv_total_bytes"] <= u["kv_stored_bytes"] == u["held_bytes_end"]
    assert by["leaf"]["capacity_bytes"] == u["kv_total_bytes"] // 3
    assert "orphan bytes max" in pressure_table({"pressure": rows, "redis": []})
