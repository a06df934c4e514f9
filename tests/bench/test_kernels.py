"""`edgekv bench kernels`: its pieces without the builds (the real run writes
docs/bench/kernels.json)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from edgekv.engines.fake import FakeAdapter
from edgekv.errors import EdgeKVError
from edgekv_bench import kernels, kernels_worker


def test_first_divergence_is_64_on_an_invariant_engine_and_earlier_on_a_variant_one():
    prompt = kernels_worker.divergence_prompts(1)[0]
    assert kernels_worker.first_divergence(FakeAdapter(), prompt) == 64
    assert kernels_worker.first_divergence(FakeAdapter(batch_variant=True), prompt) < 64


def test_divergence_prompts_are_distinct_and_deterministic():
    a, b = kernels_worker.divergence_prompts(20), kernels_worker.divergence_prompts(20)
    assert a == b and len(set(a)) == 20


def test_unknown_builds_and_missing_tools_are_refused(tmp_path):
    args = SimpleNamespace(models="smollm2-q4_1", builds="stock,nightly", runs=1, prompts=1,
                           threads=1, cache_dir=str(tmp_path))
    with pytest.raises(EdgeKVError, match="nightly"):
        kernels.run_cli(args)
    with pytest.raises(EdgeKVError, match="llama-quantize"):
        kernels.ensure_quantized(tmp_path, tmp_path / "no-such-llama-quantize",
                                 tmp_path / "model.Q4_1.gguf")


def test_a_build_whose_libraries_are_missing_is_named(tmp_path):
    with pytest.raises(EdgeKVError, match="edgekv-before-lib"):
        kernels.run_kernels_bench(models=("smollm2-q4_1",), builds=("edgekv_before",), runs=1,
                                  prompts=1, cache_dir=tmp_path, root=tmp_path)


def test_every_build_sets_the_invariant_switch_itself(tmp_path):
    """EdgeKV turns GGML_CPU_BATCH_INVARIANT on where the environment is silent, so each row
    says it: on for edgekv only. Without the stock wheel the stock rows run the .venv's
    patched build with it off, and say so."""
    builds = kernels.default_builds(tmp_path)
    assert {b.name: b.env[kernels.INVARIANT] for b in builds.values()} == {
        "stock": "0", "stock_fa": "0", "edgekv_before": "0", "edgekv": "1"}
    assert builds["edgekv"].lib is None and builds["edgekv"].flash_attn
    assert builds["stock"].lib is None and "make stock-lib" in builds["stock"].note


def test_ratios_take_the_faster_stock_configuration_per_figure():
    def row(build, p512, dec):
        return {"model": "m", "build": build, "prefill_tok_s_512": p512,
                "prefill_tok_s_2048": None, "decode_tok_s": dec, "decode_tok_s_after_2048": None}

    rows = [row("stock", 100.0, 60.0), row("stock_fa", 120.0, 50.0), row("edgekv", 114.0, 57.0)]
    (r,) = kernels.stock_ratios(rows)
    assert r["prefill_tok_s_512"] == 0.95 and r["decode_tok_s"] == 0.95
    assert r["prefill_tok_s_2048"] is None


def test_the_table_marks_a_reduced_run():
    row = {"model": "m", "weights": "Q4_1", "build": "edgekv", "flash_attn": True,
           "prefill_tok_s_512": 300.0, "prefill_tok_s_512_spread": [290.0, 310.0],
           "prefill_tok_s_2048": 250.0, "prefill_tok_s_2048_spread": [240.0, 260.0],
           "decode_tok_s": 100.0, "decode_tok_s_spread": [90.0, 110.0],
           "llama_bench_pp512": None, "llama_bench_pp2048": None, "llama_bench_tg32": None,
           "probe_identical": 9, "probe_total": 9, "first_divergence_mean": 64.0}
    res = {"rows": [row], "runs": 5, "prompts": 4, "threads": 2, "models": ["m"]}
    text = kernels.kernels_table(res)
    assert "REDUCED RUN" in text and "9/9" in text and "300 (290-310)" in text


def test_a_rounds_decode_speed_is_its_median_step():
    """A burst of load that stalls a few of a round's steps moves the whole-time figure, not
    the decode speed (1 / the median step); the figures are medians over the rounds."""
    calm = {"prefill_512_s": 2.0, "prefill_2048_s": 8.0, "decode_steps_s": [0.005] * 64,
            "decode_2048_steps_s": [0.01] * 64}
    burst = dict(calm, decode_steps_s=[0.005] * 60 + [0.5] * 4)
    s = kernels.speeds([calm, burst, calm])
    assert s["prefill_tok_s_512"] == 256.0 and s["prefill_tok_s_2048"] == 256.0
    assert s["decode_tok_s"] == 200.0 and s["decode_tok_s_spread"] == [200.0, 200.0]
    assert s["decode_tok_s_after_2048"] == 100.0 and s["decode_steps"] == 64
    assert kernels.speeds([burst])["decode_tok_s_whole"] < 50 < kernels.speeds([burst])[
        "decode_tok_s"]


def test_the_worker_times_every_decode_step():
    from edgekv.engines.fake import FakeAdapter

    out = kernels_worker._speed(FakeAdapter(n_ctx=4096))
    assert len(out["decode_steps_s"]) == len(out["decode_2048_steps_s"]) == 64
    assert all(t > 0 for t in out["decode_steps_s"] + out["decode_2048_steps_s"])
