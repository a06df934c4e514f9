"""The CLI parses and delegates; bad input is a clear error with exit code 2, not a traceback."""

from __future__ import annotations

import json

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
