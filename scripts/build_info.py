"""Record how a llama.cpp build was configured, as the build itself reports it, in a small JSON
next to the build (`make llama-server`, `make stock-lib`, `make patched-lib` write one).

What is recorded, and from where:
- `cmake`: the options that decide the CPU kernels, read back from the build's CMakeCache.txt
  (GGML_NATIVE, GGML_LLAMAFILE, GGML_CPU_REPACK, the GGML_AVX* family, build type, shared libs);
- `cpu_compile_flags`: the flags ggml-cpu was compiled with (flags.make), where `-march=...`
  shows what a native build resolved to;
- `system_info`: ggml's own feature line (`llama_print_system_info()`, e.g. "CPU : SSE3 = 1 |
  AVX2 = 1 | ... LLAMAFILE = 1 | REPACK = 1"), from the shared library (--lib) or from a binary
  started without a model (--binary: llama-server logs it before it loads one);
- `llamafile`: on/off, from that line where present, else from the CMake option;
- `patches`: the patch files applied to the source (--patches), empty for a stock build.

Usage: python scripts/build_info.py --build-dir DIR [--lib DIR | --binary PATH]
           [--patches FILE...] --out PATH
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

OPTIONS = re.compile(r"^(GGML_NATIVE|GGML_LLAMAFILE|GGML_CPU_REPACK|GGML_AVX\w*|GGML_FMA|GGML_F16C|"
                     r"GGML_BMI2|GGML_SSE42|GGML_AMX\w*|GGML_OPENMP|CMAKE_BUILD_TYPE|"
                     r"BUILD_SHARED_LIBS|CMAKE_C_COMPILER):\w+=(.*)$")


def cmake_options(build_dir: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        text = (build_dir / "CMakeCache.txt").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        m = OPTIONS.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def cpu_compile_flags(build_dir: Path) -> str | None:
    for p in sorted(build_dir.rglob("ggml-cpu.dir/flags.make")):
        for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("CXX_FLAGS"):
                return line.split("=", 1)[1].strip()
    return None


def system_info_from_lib(lib_dir: Path) -> str | None:
    """ggml's feature line, from libllama in `lib_dir` (its libggml* beside it)."""
    for dep in ("libggml-base.so", "libggml-cpu.so", "libggml.so"):
        if (lib_dir / dep).exists():
            ctypes.CDLL(str(lib_dir / dep), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(lib_dir / "libllama.so"))
    lib.llama_print_system_info.restype = ctypes.c_char_p
    lib.llama_backend_init()
    raw = lib.llama_print_system_info()
    return raw.decode() if raw else None


def system_info_from_binary(binary: Path) -> str | None:
    """llama-server prints ggml's feature line at start-up, before it loads a model: started
    on a model that does not exist, it prints the line and exits."""
    try:
        res = subprocess.run([str(binary), "-m", "/nonexistent.gguf", "--port", "0", "-t", "1",
                              "-lv", "4"],  # the line is logged at trace level
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in (res.stdout + res.stderr).splitlines():
        if "system_info" in line or "system info" in line:
            # "... system_info: n_threads = 1 (...) / 2 | CPU : SSE3 = 1 | ..."
            return line.split("|", 1)[1].strip() if "|" in line else line.strip()
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", required=True, type=Path)
    ap.add_argument("--lib", type=Path, help="folder with the built libllama.so")
    ap.add_argument("--binary", type=Path, help="a llama-server binary of the build")
    ap.add_argument("--patches", nargs="*", default=[], help="patch files applied to the source")
    ap.add_argument("--kind", default="stock", help="stock | edgekv | patched")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    info = None
    if args.lib is not None:
        info = system_info_from_lib(args.lib)
    elif args.binary is not None:
        info = system_info_from_binary(args.binary)
    cmake = cmake_options(args.build_dir)
    # ggml's own line says whether llamafile is compiled in; the CMake option where it is absent
    llamafile: bool | None = ("LLAMAFILE = 1" in info) if info else (
        cmake["GGML_LLAMAFILE"].upper() in ("ON", "1", "TRUE") if "GGML_LLAMAFILE" in cmake
        else None)
    record = {
        "kind": args.kind,
        "build_dir": str(args.build_dir),
        "cmake": cmake,
        "cpu_compile_flags": cpu_compile_flags(args.build_dir),
        "system_info": info,
        "llamafile": llamafile,
        "patches": [Path(p).name for p in args.patches],
        "machine": platform.machine(),
        "cmake_args_env": os.environ.get("CMAKE_ARGS", ""),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"{args.out}: llamafile={llamafile} system_info={info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
