"""`edgekv bench serve` without servers: the peers' command lines, the settings read from their
logs, and the before/after-restart split of the figures."""

from __future__ import annotations

from pathlib import Path

from edgekv_bench.serve import SERVERS, Answer, Server, _summary, resolved_settings, server_command

# lines as the vendored tree's llama-server prints them at -lv 4
LLAMA_SERVER_LOG = """\
system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | AVX2 = 1 | LLAMAFILE = 1 |
llama_context: n_ctx         = 2048
llama_context: flash_attn            = auto
resolve_fused_ops: Flash Attention enabled
srv    load_model: initializing, n_slots = 4, n_ctx_slot = 2048, kv_unified = 'true'
srv    load_model: prompt cache is enabled, size limit: 8192 MiB
"""


def cmd(name: str, **kw: object) -> list[str] | None:
    got = server_command(name, model="m.gguf", n_ctx=2048, threads=2, root=Path("/tmp/x"),
                         llama_server=Path("/bin/llama-server"), **kw)  # type: ignore[arg-type]
    return None if got is None else got[0]


def test_peers_run_with_their_defaults_and_the_asked_variants():
    plain = cmd("llama_server")
    assert plain is not None and "-fa" not in plain and "--no-cache-prompt" not in plain
    assert cmd("llama_server_fa_off")[-2:] == ["-fa", "off"]  # type: ignore[index]
    off = cmd("llama_server_fa_off_nocache")
    assert off is not None and "--no-cache-prompt" in off and off[-2:] == ["-fa", "off"]
    # each fa-off run is compared with its own fa-off cache-off run
    assert SERVERS["llama_server_fa_off"][2] == "llama_server_fa_off_nocache"


def test_the_stock_wheel_runs_only_where_it_was_built():
    assert cmd("llama_cpp_server_stock") is None
    got = cmd("llama_cpp_server_stock", stock_python=Path("/s/bin/python"))
    assert got is not None and got[:3] == ["/s/bin/python", "-m", "llama_cpp.server"]
    assert cmd("llama_cpp_server")[0] != "/s/bin/python"  # type: ignore[index]


def test_peers_run_without_edgekvs_switch_and_llama_cpp_python_on_the_stock_wheel(
        monkeypatch, tmp_path):
    from edgekv_bench.servers import peer_env, peer_lib

    monkeypatch.setenv("GGML_CPU_BATCH_INVARIANT", "1")
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", "/elsewhere")
    lib = tmp_path / "stock-lib"
    for name in ("llama_cpp_server", "llama_cpp_server_nocache", "llama_server",
                 "llama_cpp_server_stock"):
        env = peer_env(name, lib)
        assert env is not None and "GGML_CPU_BATCH_INVARIANT" not in env
        # the .venv's package on the stock wheel's libraries; the others on their own
        assert env.get("LLAMA_CPP_LIB_PATH") == (str(lib.resolve()) if name in (
            "llama_cpp_server", "llama_cpp_server_nocache") else None)
    assert peer_env("edgekv", lib) is None  # EdgeKV runs its own build, its switch on
    assert "LLAMA_CPP_LIB_PATH" not in (peer_env("llama_cpp_server", None) or {})
    assert "make stock-lib" in str(peer_lib("llama_cpp_server_nocache", lib))
    assert "switch unset" in str(peer_lib("llama_cpp_server_nocache", None))
    assert peer_lib("llama_server", lib) is None


def test_settings_come_from_the_servers_own_log():
    got = resolved_settings(LLAMA_SERVER_LOG)
    assert got["flash_attn"] == "enabled"  # resolved, not the requested "auto"
    assert got["n_slots"] == "4" and got["n_ctx"] == "2048"
    assert got["prompt_cache"] == "enabled, size limit: 8192 MiB"
    assert got["threads"] == "2 (n_threads_batch = 2)"
    assert "LLAMAFILE = 1" in str(got["system_info"])
    assert resolved_settings("flash_attn = off\n")["flash_attn"] == "off"
    assert resolved_settings("flash_attn = auto\nx: Flash Attention not supported, set to "
                             "disabled\n")["flash_attn"] == "disabled"
    assert resolved_settings("")["n_slots"] is None  # not in the log: not made up


def test_figures_before_and_after_the_restart_are_apart(tmp_path):
    def a(text: str, ttft: float, after: bool) -> Answer:
        return Answer(text, ttft, ttft * 2, 100, 50 if after else 80, after)

    rows = [a("x", 0.1, False), a("y", 0.3, False), a("z", 1.0, True)]
    own = [a("x", 0.5, False), a("n", 0.5, False), a("z", 0.5, True)]
    log = tmp_path / "s.log"
    log.write_text(LLAMA_SERVER_LOG)
    m = _summary("llama_server", rows, own, own, Server("llama_server", [], "/h", 1, log))
    assert m["before_restart"] == {"requests": 2, "ttft_ms_mean": 200.0, "ttft_ms_p50": 100.0,
                                   "ttft_ms_p95": 300.0, "cached_tokens": 160,
                                   "agreement_own_cache_off": 0.5}
    assert m["after_restart"]["requests"] == 1 and m["after_restart"]["ttft_ms_mean"] == 1000.0
    assert m["ttft_ms_mean_before_restart"] == 200.0 and m["ttft_ms_mean_after_restart"] == 1000.0
    assert m["resolved"]["n_slots"] == "4"
