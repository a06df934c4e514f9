"""`bench rag`'s workload, summary, recommendation, table and plot on synthetic rows (the
measured run is docs/bench/rag.*)."""

from __future__ import annotations

from pathlib import Path

from edgekv_bench.rag import (
    _modes,
    _parse_budgets,
    _recommend,
    _stopper,
    _summary,
    _workload,
    build_pool,
    rag_table,
    write_pareto,
)


def _row(mode_scores: dict[str, tuple[float, bool, float, bool]]) -> dict[str, object]:
    return {"modes": {m: {"ttft_ms": t, "reused_passage_share": 0.5, "top1_agree": a,
                          "kl_first": 0.01, "greedy_agree": g, "correct": c}
                      for m, (t, a, g, c) in mode_scores.items()}}


def test_modes_cover_each_policy_and_budget() -> None:
    labels = [m[0] for m in _modes(_parse_budgets("0,k16,0.05,0.15,0.30"))]
    assert labels == ["nocache", "prefix", "passage/0", "epic/k16", "epic/5%", "epic/15%",
                      "epic/30%", "blend/5%", "blend/15%", "blend/30%"]


def test_pool_and_workload_have_known_answers() -> None:
    pool = build_pool(lambda t: t.split(), lo=10, hi=60, size=8)  # words stand for tokens
    assert len(pool) >= 6
    for req in _workload(pool, 20, seed=1):
        assert 3 <= len(req["passages"]) <= 6 and len(set(req["passages"])) == len(req["passages"])
        owners = [pool[j]["module"] for j in req["passages"] if req["function"] in
                  pool[j]["functions"]]
        assert owners == [req["answer"]]  # named in exactly one passage of the request


def test_stopper_stops_at_the_first_divergence_after_the_answer() -> None:
    ref = list(range(20))
    stop = _stopper(ref)
    assert all(stop(t) for t in range(12))
    assert stop(12) and not stop(99)
    early = _stopper(ref)
    assert early(5)  # a divergence inside the answer's tokens does not stop it


def test_recommendation_prefers_the_fastest_faithful_mode(tmp_path: Path) -> None:
    rows = [_row({"nocache": (1000, True, 1.0, True), "prefix": (990, True, 1.0, True),
                  "passage/0": (100, False, 0.1, False), "epic/k16": (200, True, 0.9, True),
                  "epic/30%": (400, True, 1.0, True)}) for _ in range(4)]
    modes = _summary(["nocache", "prefix", "passage/0", "epic/k16", "epic/30%"], rows)
    rec = _recommend(modes)
    assert rec["mode"] == "epic/k16" and rec["ttft_speedup_vs_nocache"] == 5.0
    res = {"modes": modes, "recommendation": rec, "requests": 4, "pool": [1] * 8,
           "model": "m"}
    png = write_pareto(res, tmp_path / "rag.png")
    assert png.stat().st_size > 1000
    assert "epic/k16" in rag_table(res, png.name) and "rag.png" in rag_table(res, png.name)
