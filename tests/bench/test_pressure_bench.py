"""`edgekv bench pressure` on the fake engine, small: the JSON contract, and the policies'
accounting (the figures themselves come from `edgekv bench pressure`, never from a test)."""

from __future__ import annotations

from edgekv.engines.fake import FakeAdapter
from edgekv_bench.pressure import POLICIES, Workload, pressure_table, run_pressure

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
    # the leaf row carries the least-recently-used leaf order on the same tier and requests
    plain = by["leaf"]["leaf_lru"]
    assert by["leaf"]["leaf_order"] == "lru-2" and plain["orphan_bytes_max"] == 0
    assert plain["reused_tokens"] <= u["reused_tokens"] and plain["ttft_ms_mean"] is None
    # and the clairvoyant reference (the leaf read again furthest in the future first)
    best = by["leaf"]["leaf_clairvoyant"]
    assert best["orphan_bytes_max"] == 0 and best["reused_tokens"] <= u["reused_tokens"]
    text = pressure_table({"pressure": rows, "redis": []})
    assert "orphan bytes max" in text and "leaf (least recently used)" in text
    assert "leaf (clairvoyant" in text


def test_the_clairvoyant_rank_puts_the_furthest_next_read_first():
    """The rank is minus the next request (after the one being served) that reads the chunk:
    one never read again ranks lowest (goes first), the one read soonest highest."""
    from types import SimpleNamespace

    from edgekv_bench.pressure import _next_read_rank

    clock = [0]
    rank = _next_read_rank([["a"], ["a", "b"], ["c"], ["a", "b"]], clock)
    node = {k: SimpleNamespace(key=k) for k in "abcd"}
    assert rank(node["d"]) == float("-inf")
    assert rank(node["a"]) == -1.0 and rank(node["b"]) == -1.0 and rank(node["c"]) == -2.0
    clock[0] = 1  # request 1 is served: its reads are behind it
    assert rank(node["a"]) == -3.0 and rank(node["c"]) == -2.0
    clock[0] = 3
    assert rank(node["a"]) == rank(node["c"]) == float("-inf")


def test_tiers_from_an_earlier_run_size_the_ram_tier(tmp_path):
    """`--tiers-from`: each ratio's tier as an earlier run's JSON sized it (two versions of
    the cache on the same RAM); a file that is not such a run is refused with the reason."""
    import json

    import pytest

    from edgekv.errors import EdgeKVError
    from edgekv_bench.pressure import earlier_tiers

    work = Workload.make(conversations=4, docs=2, turns=2, doc_tokens=128, question_tokens=16,
                         requests=8, max_tokens=4, vocab=(1, 250), seed=2)
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"pressure": [
        {"engine": "fake", "ratio": 3, "policy": p, "capacity_bytes": 12345}
        for p in ("lru", "leaf")] + [
        {"engine": "fake", "ratio": 3, "policy": "unbounded", "capacity_bytes": 1 << 40}]}))
    tiers = earlier_tiers(earlier)
    assert tiers == {("fake", 3.0): 12345}
    rows = run_pressure(FakeAdapter(), work, (3,), tmp_path / "run", 64, "fake",
                        lambda _m: None, tiers)
    assert {r["policy"]: r["capacity_bytes"] for r in rows if r["policy"] != "unbounded"} == {
        "lru": 12345, "leaf": 12345}
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(EdgeKVError, match=r"--tiers-from .*bad.json: not a `bench pressure` JSON"):
        earlier_tiers(bad)
    with pytest.raises(EdgeKVError, match="not a `bench pressure` JSON"):
        earlier_tiers(tmp_path / "missing.json")
