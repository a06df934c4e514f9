"""`bench stream` pieces that need no engine: spreads, link variants, the variant point."""

from edgekv.stream.costmodel import CostModel
from edgekv_bench.stream import Link, _links, crossover_mbps, spread


def test_spread_reports_centre_and_spread_of_every_run():
    s = spread([30.0, 10.0, 20.0, 50.0, 40.0])
    assert (s["n"], s["mean"], s["median"], s["min"], s["max"]) == (5, 30.0, 30.0, 10.0, 50.0)
    assert s["p10"] == 14.0 and s["p90"] == 46.0 and s["stdev"] > 15
    assert s["runs"] == [30.0, 10.0, 20.0, 50.0, 40.0]  # in the order they ran


def test_variants_shape_the_link_as_labelled():
    links = {lk.variant: lk for lk in _links((1.0,), (10.0,), True, (8.0, 10.0))}
    assert set(links) == {"grid", "jitter", "loss", "prior x4", "prior /4", "drop 10x"}
    assert links["jitter"].shaper(0, 1000, 4).jitter_ms == 20.0
    assert links["loss"].shaper(0, 1000, 4).loss == 0.02
    drop = links["drop 10x"].shaper(0, 1000, 4)
    assert drop.change_after_bytes == 2000  # halfway through the prompt's chunk bytes
    assert drop.bandwidth_mbps == 10 * drop.changed_bandwidth_mbps  # type: ignore[operator]
    assert links["grid"].shaper(0, 1000, 4).change_after_bytes is None
    assert links["prior /4"].prior_factor == 0.25 and links["prior x4"].prior_factor == 4.0
    assert Link(5.0, 10.0).variant == "grid"


def test_variant_point_is_where_transfer_and_compute_of_a_chunk_cost_the_same():
    cost = CostModel(prefill_a_s=0.5, prefill_b_s=0.0)
    assert crossover_mbps(cost, 1_000_000) == 16.0  # 8 Mbit in 0.5 s
