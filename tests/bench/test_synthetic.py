"""The lab's made-for-measuring models (edgekv_bench.synthetic) and the kernels bench's arch
rows (edgekv_bench.emulated): names, labels, the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgekv.errors import EdgeKVError
from edgekv_bench import emulated, kernels, synthetic


def test_model_names_parse_and_bad_ones_are_refused_with_the_choices():
    assert synthetic.parse_name("synthetic-llama3.2-1b-q4_k_m") == ("llama3.2-1b", "q4_k_m")
    assert synthetic.parse_name("smollm2-iq4_xs") == ("smollm2", "iq4_xs")
    with pytest.raises(EdgeKVError, match="q4_k_m"):
        synthetic.parse_name("smollm2-q9_z")
    with pytest.raises(EdgeKVError, match="llama3.2-1b"):
        synthetic.parse_name("synthetic-llama9-q4_k_m")
    with pytest.raises(EdgeKVError, match="unknown model"):
        kernels.model_paths(Path("/nonexistent"), Path("/nonexistent"), ["mistral-q4_k_m"])
    assert all(synthetic.is_synthetic(n) for n in synthetic.CI_STANDINS + synthetic.LADDER)


def test_a_shape_with_more_layers_than_its_template_gets_every_block():
    # SmolLM2 360M has 32 layers, its template (SmolLM2 135M) 30: blocks 30 and 31 are made from
    # the template's first block, not left out (llama.cpp refused such a file: 'blk.30.attn_norm
    # .weight' not found)
    template = [("token_embd.weight", [576, 49152]), ("blk.0.attn_norm.weight", [576]),
                ("blk.0.ffn_up.weight", [576, 1536]), ("blk.1.attn_norm.weight", [576]),
                ("blk.1.ffn_up.weight", [576, 1536]), ("output_norm.weight", [576])]
    dims = {576: 960, 1536: 2560}
    got = synthetic.tensor_set(template, 3, dims)
    assert [n for n, _ in got] == ["token_embd.weight",
                                   *(f"blk.{i}.{t}" for i in range(3)
                                     for t in ("attn_norm.weight", "ffn_up.weight")),
                                   "output_norm.weight"]
    assert dict(got)["blk.2.ffn_up.weight"] == [2560, 960]  # numpy order, widths mapped
    assert dict(got)["token_embd.weight"] == [49152, 960]
    assert [n for n, _ in synthetic.tensor_set(template, 1, {})] == [
        "token_embd.weight", "blk.0.attn_norm.weight", "blk.0.ffn_up.weight",
        "output_norm.weight"]


def test_the_host_arch_comes_from_the_cpu_flags():
    assert emulated.host_arch("x86_64", frozenset({"avx2", "avx512f"})) == "x86_64-avx512"
    assert emulated.host_arch("x86_64", frozenset({"avx2"})) == "x86_64-avx2"
    assert emulated.host_arch("aarch64", frozenset({"asimddp", "i8mm"})) == "aarch64-i8mm"
    assert emulated.host_arch("aarch64", frozenset({"asimddp"})) == "aarch64-dotprod"


def test_arches_that_cannot_run_here_are_refused(tmp_path):
    with pytest.raises(EdgeKVError, match="unknown arch"):
        kernels.run_kernels_bench(arches=["riscv64"], cache_dir=tmp_path, root=tmp_path)
    other = "x86_64-avx2" if emulated.host_arch() != "x86_64-avx2" else "x86_64-avx512"
    with pytest.raises(EdgeKVError, match="not this machine"):
        kernels.run_kernels_bench(arches=[other], cache_dir=tmp_path, root=tmp_path)


def test_an_emulated_row_without_its_cross_build_names_the_command(tmp_path):
    arch = emulated.ARCHES["aarch64-i8mm"]
    with pytest.raises(EdgeKVError, match="arm_check.sh build i8mm"):
        emulated.run_emulated([(arch, tmp_path / "m.gguf", True, 0)], root=tmp_path)


def test_emulated_rows_have_null_speeds_and_say_so_in_the_table():
    row = {"model": "synthetic-smollm2-2l-q4_0", "weights": "Q4_0 (synthetic: random weights)",
           "build": "edgekv", "flash_attn": True, "arch": "aarch64-dotprod", "emulated": True,
           "params": 41_000_000, "synthetic": True, **kernels.NULL_SPEEDS,
           "probe_identical": 7, "probe_total": 7, "probe_pending": ["long schedules"],
           "first_divergence_mean": None,
           **{f"llama_bench_{k}": None for k in ("pp512", "pp2048", "tg32")}}
    res = {"rows": [row], "runs": 1, "prompts": 20, "threads": 2, "models": [row["model"]]}
    text = kernels.kernels_table(res)
    assert "aarch64-dotprod (qemu)" in text and "no faithful speed" in text
    assert "7/7 (+pending: long schedules)" in text and "41M" in text
    assert "random weights" in text and "REDUCED RUN" not in text
    assert kernels.stock_ratios([row]) == []


@pytest.mark.real
def test_a_ci_standin_is_the_packaged_architecture_with_two_layers_and_labelled():
    gguf = pytest.importorskip("gguf")
    from edgekv.config import default_cache_dir

    path = synthetic.ensure_model("synthetic-smollm2-2l-q4_0", default_cache_dir())
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.block_count"].contents() == 2
    assert r.fields["general.name"].contents().startswith("synthetic smollm2-2l")
    assert r.fields["edgekv.synthetic"].contents() == "smollm2-2l"
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 49152
    assert {int(t.name.split(".")[1]) for t in r.tensors if t.name.startswith("blk.")} == {0, 1}
    assert 30e6 < synthetic.model_params(path) < 50e6


def test_emulated_jobs_start_longest_first_and_come_back_in_their_order(tmp_path, monkeypatch):
    small, big = tmp_path / "small.gguf", tmp_path / "big.gguf"
    small.write_bytes(b"x" * 10)
    big.write_bytes(b"x" * (3 << 20))
    arch = emulated.ARCHES["aarch64-dotprod"]
    started = []

    def probe(arch, model, *, invariant, long_tokens, root):
        started.append((model.name, long_tokens))
        return {"model": model.name, "long": long_tokens}

    monkeypatch.setattr(emulated, "probe_binary", lambda arch, root: tmp_path)
    monkeypatch.setattr(emulated, "probe_emulated", probe)
    jobs = [(arch, small, True, 0), (arch, big, True, 0), (arch, small, True, 2040)]
    got = emulated.run_emulated(jobs, root=tmp_path, parallel=1)
    assert [(r["model"], r["long"]) for r in got] == [
        ("small.gguf", 0), ("big.gguf", 0), ("small.gguf", 2040)]
    assert started == [("small.gguf", 2040), ("big.gguf", 0), ("small.gguf", 0)]


def test_an_emulated_job_that_does_not_finish_is_a_row_that_says_so(tmp_path, monkeypatch):
    """A probe that fails or runs out of time leaves its own row without a verdict and
    its error; the other jobs' results are kept (`arm_check.sh check` fails on it)."""
    from edgekv.errors import EdgeKVError

    arch = emulated.ARCHES["aarch64-dotprod"]
    ok, slow = tmp_path / "ok.gguf", tmp_path / "slow.gguf"
    for p in (ok, slow):
        p.write_bytes(b"x")

    def probe(arch, model, *, invariant, long_tokens, root):
        if model == slow:
            raise EdgeKVError("the probe on aarch64-dotprod did not finish in 3600 s")
        return {"results": [["a", 0.0, True], ["b", 0.0, True]], "notes": [], "pending": [],
                "seconds": 1.0, "flash_attn": True}

    monkeypatch.setattr(emulated, "probe_binary", lambda arch, root: tmp_path)
    monkeypatch.setattr(emulated, "probe_emulated", probe)
    from edgekv_bench import kernels

    monkeypatch.setattr(kernels, "_model_keys", lambda name, path: {"params": None})
    rows = kernels._emulated_rows(["ok", "slow"], ["edgekv"],
                                  {"ok": (ok, "Q4_0"), "slow": (slow, "Q4_0")}, [arch], [],
                                  tmp_path, None)
    assert [(r["model"], r["probe_identical"], r["probe_total"], r["error"]) for r in rows] == [
        ("ok", 2, 2, None),
        ("slow", 0, 0, "the probe on aarch64-dotprod did not finish in 3600 s")]
    table = kernels.kernels_table({"rows": rows, "runs": 1, "threads": 1, "prompts": 0})
    assert "did not finish" in table


def test_long_schedules_run_where_a_model_or_a_model_at_an_arch_is_named(tmp_path, monkeypatch):
    from edgekv_bench import kernels

    assert kernels.runs_long("m", "aarch64-i8mm", ["m"])
    assert kernels.runs_long("m", "aarch64-i8mm", ["m@aarch64-i8mm"])
    assert not kernels.runs_long("m", "aarch64-dotprod", ["m@aarch64-i8mm"])
    assert kernels.runs_long("m", "aarch64-dotprod", ["all"])
    assert not kernels.runs_long("m", "aarch64-dotprod", ["mm", "m@x"])
    # the CI stand-ins: each long once, at one level
    levels = ("aarch64-dotprod", "aarch64-i8mm")
    for model in ("synthetic-smollm2-2l-q4_k_m", "synthetic-gemma3-2l-q4_k_m"):
        assert sum(kernels.runs_long(model, a, kernels.LONG_MODELS) for a in levels) == 1
    seen = []
    monkeypatch.setattr(emulated, "probe_binary", lambda arch, root: tmp_path)
    monkeypatch.setattr(emulated, "probe_emulated",
                        lambda arch, model, *, invariant, long_tokens, root:
                        seen.append((arch.name, long_tokens)) or {"results": [], "notes": [],
                                                                  "pending": [], "seconds": 1.0,
                                                                  "flash_attn": True})
    monkeypatch.setattr(kernels, "_model_keys", lambda name, path: {"params": None})
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    kernels._emulated_rows(["m"], ["edgekv"], {"m": (model, "Q4_K")},
                           [emulated.ARCHES[a] for a in levels], ["m@aarch64-i8mm"], tmp_path,
                           None)
    assert sorted(seen) == [("aarch64-dotprod", 0), ("aarch64-i8mm", 2040)]
