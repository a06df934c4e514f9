"""The CLI parses and delegates; bad input is a clear error with exit code 2, not a traceback."""

from __future__ import annotations

import json

import pytest

from edgekv.cli import main


def test_cache_stats_and_clear_on_an_empty_store(tmp_path, capsys):
    assert main(["cache", "stats", "--json", "--cache-dir", str(tmp_path)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 0 and stats["path"].endswith("store")
    assert main(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert "removed 0" in capsys.readouterr().out


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path / "nope.gguf"),
                 "--cache-dir", str(tmp_path), "hello"])
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err and "--model" in err


def test_not_a_gguf_is_refused(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a model")
    code = main(["generate", "--no-semantic", "--model", str(bad), "--cache-dir", str(tmp_path),
                 "x"])
    assert code == 2 and "not a GGUF" in capsys.readouterr().err


def test_bad_workload_line_names_file_and_line(tmp_path, capsys):
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    code = main(["bench", "seed", "--workload", str(wl), "--json", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert code == 2 and "w.jsonl:2" in err and "prompt" in err


def test_bench_lists_every_benchmark(capsys):
    from edgekv.cli import BENCHES, HARNESS_BENCHES

    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for name in (*BENCHES, *HARNESS_BENCHES):
        assert f"    {name} " in out, name


@pytest.mark.parametrize("argv", [
    ["bench", "codec", "--requests", "3"],       # serve's, seed's, ...: not codec's
    ["bench", "serve", "--modes", "plain"],      # seed's
    ["bench", "kernels", "--engine", "torch"],   # reuse's and seed's
    ["bench", "fuzz", "--duration", "1"],        # faults'
    ["bench", "faults", "--inputs", "10"],       # fuzz's
    ["bench", "stream", "--n-ctx", "512"],
])
def test_an_option_of_another_bench_is_an_argparse_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_bench_options_keep_their_names_and_defaults():
    from edgekv.cli import build_parser

    p = build_parser()
    a = p.parse_args(["bench", "serve", "--servers", "edgekv", "--requests", "24",
                      "--threads", "1"])
    # --n-ctx unset: 2048 one request at a time, enough for every sequence with --concurrency
    # (resolved by the bench, bench/serve.run_cli)
    assert (a.bench, a.servers, a.requests, a.threads, a.max_tokens, a.n_ctx) == \
        ("serve", "edgekv", 24, 1, 48, None)
    a = p.parse_args(["bench", "seed", "--workload", "chat", "--modes", "plain,edgekv_strict"])
    assert (a.workload, a.modes, a.requests, a.seed, a.engine) == \
        ("chat", "plain,edgekv_strict", None, 0, "llamacpp")
    a = p.parse_args(["bench", "kernels", "--models", "smollm2-q4_1", "--builds", "stock"])
    assert (a.models, a.builds, a.runs, a.prompts) == ("smollm2-q4_1", "stock", 5, 20)
    a = p.parse_args(["bench", "faults", "--targets", "kill9", "--duration", "10"])
    assert (a.targets, a.duration, a.kills, a.n_ctx) == ("kill9", 10.0, None, 2048)
    a = p.parse_args(["bench", "fuzz", "--inputs", "200"])
    assert (a.inputs, a.targets, a.seed) == (200, None, 0)
    a = p.parse_args(["bench", "reuse"])
    assert (a.runs, a.context_tokens, a.sweep, a.max_tokens, a.chunk_size) == \
        (5, 512, "300,517,777,1000", 16, None)


def test_harness_benches_outside_a_checkout_say_so(monkeypatch, capsys):
    """An installed wheel has no harness/: `bench faults` keeps its name and says why not."""
    import importlib.util

    from edgekv.bench import checkout

    real = importlib.util.find_spec
    monkeypatch.setattr(checkout, "harness_dir", lambda: None)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == checkout.HARNESS else real(name, *a))
    for argv in (["bench", "faults", "--targets", "kill9"], ["bench", "fuzz", "--help"]):
        assert main(argv) == 2
        assert "only in a source checkout" in capsys.readouterr().err
