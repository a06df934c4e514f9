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
    from edgekv_bench.cli import BENCHES, HARNESS_BENCHES

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
    from edgekv_bench.cli import bench_parser

    class Parser:  # `edgekv bench NAME ...` as the lab's plugin receives it
        def parse_args(self, argv):
            assert argv[0] == "bench"
            return bench_parser().parse_args(argv[1:])

    p = Parser()
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


def test_lab_commands_without_the_lab_say_so(monkeypatch, capsys):
    """The product installed alone (no `pip install -e bench`): `edgekv bench` and `edgekv demo`
    keep their names, and running one says how to get the lab, exit 2, no traceback."""
    from edgekv import cli

    monkeypatch.setattr(cli, "_plugins", lambda: {})
    for argv in (["bench", "faults", "--targets", "kill9"], ["bench", "fuzz", "--help"],
                 ["demo"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "the lab is not installed" in err and "pip install -e bench" in err, err
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "    bench " in out and "    demo " in out


def test_help_imports_no_lab_module():
    """`edgekv --help` lists the lab's commands by their entry points, importing none of them
    a help screen does not load the benchmarks."""
    import subprocess
    import sys

    code = ("import sys\nfrom edgekv.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\n"
            "print('LOADED', sorted(m for m in sys.modules if m.startswith(('edgekv_bench', "
            "'edgekv_harness'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "bench" in out and "LOADED []" in out, out.splitlines()[-1]


def test_vv_turns_on_edgekvs_own_debug_lines_only(tmp_path, capsys):
    import logging

    from edgekv.cli import main as cli_main

    edgekv_log = logging.getLogger("edgekv")
    before = edgekv_log.level
    try:
        assert cli_main(["-vv", "cache", "stats", "--cache-dir", str(tmp_path), "--json"]) == 0
        assert logging.getLogger("edgekv.engines.llamacpp_slots").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("uvicorn").isEnabledFor(logging.DEBUG)
    finally:
        edgekv_log.setLevel(before)
