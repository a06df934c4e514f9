"""`serve` and `generate` switches: a switch that needs another, or cannot go with another, is
refused with a clear message before anything loads (exit code 2); an unknown one is argparse's
error. (Each switch working end to end, on the real engine through HTTP:
tests/serve/test_real_switches.py.)"""

from __future__ import annotations

import pytest

from edgekv.cli import build_parser, main


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--kv-tenant", "acme"], "--kv-tenant need --kv-server"),
    (["serve", "--kv-link", "20,40"], "--kv-link need --kv-server"),
    (["generate", "hi", "--kv-secret-file", "/x"], "--kv-secret-file need --kv-server"),
    (["serve", "--kv-server", "http://127.0.0.1:9", "--passage-reuse"], "do not combine"),
    (["generate", "hi", "--kv-server", "http://127.0.0.1:9", "--passage-reuse"],
     "do not combine"),
    (["serve", "--kv-server", "http://127.0.0.1:9", "--no-cache"], "drop --kv-server"),
    (["serve", "--no-cache", "--semantic", "--prefetch"], "drop --semantic, --prefetch"),
    (["serve", "--approximate"], "add --semantic"),
    (["serve", "--kv-server", "http://127.0.0.1:9", "--kv-link", "fast"], "MBPS,RTT_MS"),
    (["serve", "--kv-server", "http://127.0.0.1:9", "--kv-link", "0,10"], "Mbit/s > 0"),
    (["serve", "--kv-server", "ftp://127.0.0.1:9"], "must look like http://HOST:PORT"),
    (["serve", "--parallel", "0"], "--parallel 0: give 1 or more"),
    (["serve", "--parallel", "2", "--passage-reuse"], "drop one of them"),
    (["serve", "--parallel", "4", "--kv-server", "http://127.0.0.1:9"], "drop one of them"),
    (["generate", "hi", "--raw", "--chat"], "contradict each other"),
    (["generate", "hi", "--raw", "--system", "be brief"], "--system is a chat message"),
    (["generate", "hi", "--passage-reuse", "--chat"], "does not combine with --chat"),
])
def test_conflicting_or_incomplete_switches_are_refused(tmp_path, capsys, argv, message):
    (tmp_path / "kv-server.secret").write_text("00" * 32)  # where --kv-secret-file defaults
    rc = main([*argv, "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "edgekv: error:" in err and message in err


def test_a_bad_first_probe_setting_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EDGEKV_FIRST_PROBE", "later")
    rc = main(["generate", "hi", "--cache-dir", str(tmp_path)])
    assert rc == 2 and "EDGEKV_FIRST_PROBE='later': give short or full" in capsys.readouterr().err


def test_a_missing_kv_secret_is_refused_with_what_to_do(tmp_path, capsys):
    rc = main(["serve", "--kv-server", "http://127.0.0.1:9", "--kv-secret-file",
               str(tmp_path / "none"), "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "copy the kv-server's --secret-file there" in err and "none" in err


def test_unknown_switch_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--semantik"])
    assert e.value.code == 2 and "--semantik" in capsys.readouterr().err


def test_every_switch_is_documented_in_help():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for switch in ("--kv-server", "--kv-secret-file", "--kv-tenant", "--kv-link", "--semantic",
                   "--prefetch", "--passage-reuse", "--approximate", "documents",
                   "X-EdgeKV-Tier", "edgekv_prefetch_hit_rate", "--parallel",
                   "edgekv_batch_slots"):
        assert switch in text
