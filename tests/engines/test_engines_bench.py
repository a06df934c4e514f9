"""`bench engines` agreement measures, and the cross-engine default following the measurement."""

import json
from pathlib import Path

from edgekv.engines.layout import CROSS_ENGINE_REUSE
from edgekv_bench.engines import _agreement, first_divergence, reuse_verdict

FAMILY = {"llamacpp": "llama.cpp", "torch": "torch", "onnx": "onnxruntime"}
RESULT = Path(__file__).resolve().parents[2] / "docs" / "bench" / "engines.json"


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([9, 2], [1, 2]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early


def test_agreement_counts_identical_prompts_and_mean_position():
    a = _agreement([None, 4, None, 0], 32)
    assert a["identical_share"] == 0.5
    assert a["mean_first_divergence"] == (32 + 4 + 32 + 0) / 4
    assert a["min_first_divergence"] == 0


def test_reuse_only_where_every_prompt_was_identical():
    assert reuse_verdict({"src": "torch", "dst": "onnx", "identical_share": 1.0})
    assert not reuse_verdict({"src": "torch", "dst": "onnx", "identical_share": 0.95})
    assert reuse_verdict({"src": "onnx", "dst": "onnx", "identical_share": 0.0})


def test_default_cross_engine_reuse_is_the_measured_verdict():
    """`CROSS_ENGINE_REUSE` enables exactly the pairs docs/bench/engines.json measured identical
    on every prompt; a pair with no measurement stays off."""
    res = json.loads(RESULT.read_text())
    assert res["prompts"] >= 20
    measured = {(FAMILY[p["src"]], FAMILY[p["dst"]]): p["reuse_enabled"]
                for p in res["pairs"] if p["src"] != p["dst"]}
    for pair, on in measured.items():
        assert CROSS_ENGINE_REUSE.get(pair, False) == on, pair
    for pair, on in CROSS_ENGINE_REUSE.items():
        assert not on or measured.get(pair), f"{pair} enabled without a measurement"
