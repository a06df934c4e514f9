"""The server processes of `edgekv bench serve` (one request at a time, and `--concurrency`)
and of the seed bench's llama-server peer: their command lines, a process on loopback
started until healthy and stopped, the settings each one's own log says it resolved to, and
the sampling fields that make each greedy."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from edgekv.errors import ConfigError

__all__ = ["SERVERS", "Server", "free_port", "get_health", "greedy_extra", "peer_env", "peer_lib",
           "resolved_settings", "server_command"]

KERNEL_SWITCH = "GGML_CPU_BATCH_INVARIANT"  # EdgeKV's (`edgekv.engines` sets it here)

# name -> (system, cache on?, the cache-off run it is compared with)
SERVERS: dict[str, tuple[str, bool, str]] = {
    "llama_cpp_server_nocache": ("llama_cpp_server", False, "llama_cpp_server_nocache"),
    "edgekv": ("edgekv", True, "edgekv_nocache"),
    "edgekv_nocache": ("edgekv", False, "edgekv_nocache"),
    # EdgeKV on its fastest engine: ONNX Runtime over the same GGUF weights (de-quantized)
    "edgekv_onnx": ("edgekv", True, "edgekv_onnx_nocache"),
    "edgekv_onnx_nocache": ("edgekv", False, "edgekv_onnx_nocache"),
    "llama_cpp_server": ("llama_cpp_server", True, "llama_cpp_server_nocache"),
    "llama_server": ("llama_server", True, "llama_server_nocache"),
    "llama_server_reuse": ("llama_server", True, "llama_server_nocache"),
    "llama_server_nocache": ("llama_server", False, "llama_server_nocache"),
    "llama_server_fa_off": ("llama_server", True, "llama_server_fa_off_nocache"),
    "llama_server_fa_off_nocache": ("llama_server", False, "llama_server_fa_off_nocache"),
    # `python -m llama_cpp.server` on the wheel a plain `pip install llama-cpp-python` builds
    "llama_cpp_server_stock": ("llama_cpp_server", True, "llama_cpp_server_stock_nocache"),
    "llama_cpp_server_stock_nocache": ("llama_cpp_server", False,
                                       "llama_cpp_server_stock_nocache"),
}


def peer_env(name: str, stock_lib: Path | None = None) -> dict[str, str] | None:
    """Server `name`'s environment: EdgeKV's inherits this one (None); a peer's is this one
    without EdgeKV's kernel switch, as its users run it, and `python -m llama_cpp.server` on
    the .venv loads the stock wheel's libraries (`make stock-lib`: LLAMA_CPP_LIB_PATH) where
    `stock_lib` is given (the `_stock` servers have a venv of their own)."""
    system = SERVERS[name][0] if name in SERVERS else name
    if system == "edgekv":
        return None
    env = {k: v for k, v in os.environ.items() if k not in (KERNEL_SWITCH, "LLAMA_CPP_LIB_PATH")}
    if system == "llama_cpp_server" and "_stock" not in name and stock_lib is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(stock_lib.resolve())
    return env


def peer_lib(name: str, stock_lib: Path | None = None) -> str | None:
    """What native build server `name` runs, in words (for the JSON); None for EdgeKV and
    llama-server (its own binary)."""
    system = SERVERS[name][0]
    if system != "llama_cpp_server":
        return None
    if "_stock" in name:
        return "the stock venv's wheel (make stock-llama-cpp-python)"
    if stock_lib is not None:
        return f"the stock wheel's libraries ({stock_lib}, make stock-lib), switch unset"
    return ("EdgeKV's build of the .venv with its kernel switch unset (stock kernels; make "
            "stock-lib for the stock wheel)")


def get_health(base_url: str) -> Any:
    """GET /health's JSON body (EdgeKV's says its slots and engine settings), or the error."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError) as e:
        return {"error": str(e)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One server process on loopback, restartable with the same command and directory."""

    name: str
    cmd: list[str]
    health: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: list[float] = field(default_factory=list)  # seconds from spawn to healthy
    env: dict[str, str] | None = None  # the process's environment (None: this one's)
    out: IO[bytes] | None = field(default=None, repr=False)  # its log, open while it runs

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 600.0) -> float:
        t0 = time.perf_counter()
        self.out = out = open(self.log, "ab")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env)
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                tail = self.log.read_text(errors="replace")[-400:].strip()
                raise ConfigError(f"{self.name} exited with {code} while starting; see "
                                  f"{self.log}, which ends: {tail}")
            try:
                with urllib.request.urlopen(self.base_url + self.health, timeout=2) as r:
                    if r.status == 200:
                        took = time.perf_counter() - t0
                        self.starts.append(took)
                        return took
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise ConfigError(f"{self.name} did not become healthy in {timeout_s:.0f} s; "
                          f"see {self.log}")

    def stop(self) -> None:
        from edgekv.serve.runner import stop_process  # edgekv serve's extra is needed here anyway

        if self.proc is not None:
            stop_process(self.proc, grace_s=30)
        self.proc = None
        if self.out is not None:
            self.out.close()
            self.out = None


def server_command(name: str, *, model: str, n_ctx: int, threads: int, root: Path,
                   llama_server: Path | None, stock_python: Path | None = None
                   ) -> tuple[list[str], str] | None:
    """The command line of server `name` (with `{port}`) and its health path; None where the
    server is not available (llama-server or the stock wheel not built)."""
    system, cache, _ = SERVERS[name]
    py = sys.executable
    if "_stock" in name:
        if stock_python is None:
            return None
        py = str(stock_python)
    if system == "edgekv":
        cmd = [py, "-m", "edgekv", "serve", "--model", model, "--n-ctx", str(n_ctx),
               "--port", "{port}", "--cache-dir", str(root / name), "--threads", str(threads)]
        if name.startswith("edgekv_onnx"):
            cmd += ["--engine", "onnx"]
        return (cmd if cache else cmd + ["--no-cache"]), "/health"
    if system == "llama_cpp_server":
        return [py, "-m", "llama_cpp.server", "--model", model, "--n_ctx", str(n_ctx),
                "--n_threads", str(threads), "--n_threads_batch", str(threads),
                "--host", "127.0.0.1", "--port", "{port}",
                "--cache", "true" if cache else "false"], "/v1/models"
    if llama_server is None:
        return None
    # -lv 4: log verbosity only (no setting changes), so that its log states what it resolved
    cmd = [str(llama_server), "-m", model, "-c", str(n_ctx), "-t", str(threads), "-tb",
           str(threads), "--host", "127.0.0.1", "--port", "{port}", "--no-webui", "-lv", "4"]
    if not cache:
        cmd.append("--no-cache-prompt")
    if name == "llama_server_reuse":
        cmd += ["--cache-reuse", "256"]
    if name.startswith("llama_server_fa_off"):
        cmd += ["-fa", "off"]
    return cmd, "/health"


# what each server's own log says it resolved to (llama.cpp's log lines, whoever prints them)
_SETTINGS = {
    "flash_attn": re.compile(r"Flash Attention (enabled)|Flash Attention not supported, set to "
                             r"(disabled)|flash_attn\s*=\s*(\w+)"),
    "n_slots": re.compile(r"n_slots\s*=\s*(\d+)"),
    "prompt_cache": re.compile(r"prompt cache is (enabled, size limit: [^\n]+|disabled)"),
    "threads": re.compile(r"n_threads\s*=\s*(\d+ \(n_threads_batch\s*=\s*\d+\))"),
    "n_ctx": re.compile(r"\bn_ctx\s*=\s*(\d+)"),
    "system_info": re.compile(r"system_info: ([^\n]+)"),
    "engine": re.compile(r"engine: (llama\.cpp[^\n]+)"),
}


def resolved_settings(log: str) -> dict[str, str | None]:
    """The settings a server's log reports: the last value of each (None: not in its log).
    Flash attention's resolved value ("Flash Attention enabled") wins over the requested one
    (auto)."""
    out: dict[str, str | None] = {}
    for key, pattern in _SETTINGS.items():
        found = [next(g for g in m.groups() if g is not None) for m in pattern.finditer(log)]
        if key == "flash_attn":  # "auto" resolved at context creation wins
            told = [m.group(1) or m.group(2) for m in pattern.finditer(log)
                    if m.group(1) or m.group(2)]
            found = told or found
        out[key] = found[-1].strip() if found else None
    return out


def greedy_extra(system: str) -> dict[str, Any]:
    """Sampling fields that make each server greedy and penalty-free (llama-cpp-python's server
    defaults to repeat_penalty 1.1); EdgeKV takes the OpenAI fields only."""
    return {} if system == "edgekv" else {"repeat_penalty": 1.0, "top_k": 1}
