"""Print the llama.cpp CMake flags for the CPU this runs on (setup reads them; nothing is
assumed about the machine the project was written on).

Why not GGML_NATIVE: a native build also enables AMX on Intel CPUs whose VM forbids its
tile registers (every decode then dies with SIGSEGV), and a wheel built natively on one
machine dies with SIGILL on another. So each instruction set is switched on only where
/proc/cpuinfo lists it, and AMX is always off. The setup stamp records these flags: a venv
moved to a CPU with other features is rebuilt instead of crashing.

Why llamafile differs between the two flag sets: llamafile's tinyBLAS computes the products of
batches of two or more tokens, while single tokens (decode steps, a lone last prompt token) take
ggml's own dot products, which for F16 sum in another order. On an unpatched build the
last-token logits and the KV then depend on how the prompt was batched, so reuse could not end
at any token: measured on an AMD EPYC with AVX512 (SmolLM2 Q4_1, flash attention off, `edgekv
probe`), with llamafile 4/6 schedules bit-identical, without it 6/6, at 243 vs 281 tok/s cold
prefill (512 tokens). So the unpatched flag set (no option; `make edgekv-before-lib`, the
engine before the patch series) keeps llamafile off; EDGEKV_LLAMAFILE=ON turns it on.

EdgeKV's engine (`make setup`, --patched: patches/llama.cpp applied) keeps llamafile on: its
batch-invariant mode (GGML_CPU_BATCH_INVARIANT=1, one of the patches, EdgeKV's default) gives a
single token the same sums as a batch, so llamafile's speed no longer costs exactness.

Usage: python scripts/cpu_flags.py            -> "-DGGML_NATIVE=OFF -DGGML_AVX2=ON ..."
       python scripts/cpu_flags.py --signature -> a short name of the flag set (for the stamp)
       python scripts/cpu_flags.py --patched [--signature] -> the same for the patched build
"""

from __future__ import annotations

import os
import platform
import sys

# (cpuinfo flags that must all be present, the ggml CMake option they enable)
X86_FEATURES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("sse4_2",), "GGML_SSE42"),
    (("avx",), "GGML_AVX"),
    (("avx2",), "GGML_AVX2"),
    (("bmi2",), "GGML_BMI2"),
    (("fma",), "GGML_FMA"),
    (("f16c",), "GGML_F16C"),
    (("avx_vnni",), "GGML_AVX_VNNI"),
    (("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"), "GGML_AVX512"),
    (("avx512vbmi",), "GGML_AVX512_VBMI"),
    (("avx512_vnni",), "GGML_AVX512_VNNI"),
    (("avx512_bf16",), "GGML_AVX512_BF16"),
)
# never switched on, whatever the CPU says (see the module docstring)
ALWAYS_OFF = ("GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def llamafile_arg(patched: bool = False) -> str:
    default = "ON" if patched else "OFF"
    on = os.environ.get("EDGEKV_LLAMAFILE", default).strip().upper() in ("1", "ON", "TRUE", "YES")
    return f"-DGGML_LLAMAFILE={'ON' if on else 'OFF'}"


def cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(flags: set[str]) -> list[str]:
    args = [f"-D{opt}=OFF" for opt in ALWAYS_OFF]
    for needed, opt in X86_FEATURES:
        on = all(f in flags for f in needed)
        # AVX512 sub-features are only meaningful on top of the AVX512 foundation
        if opt.startswith("GGML_AVX512_") and not all(
                f in flags for f in X86_FEATURES[7][0]):
            on = False
        args.append(f"-D{opt}={'ON' if on else 'OFF'}")
    return args


def main() -> int:
    argv = sys.argv[1:]
    patched = "--patched" in argv
    argv = [a for a in argv if a != "--patched"]
    if platform.machine() not in ("x86_64", "AMD64"):
        args = ["-DGGML_NATIVE=OFF"]  # other architectures: ggml's portable defaults
    else:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                args = cmake_args(cpu_flags(f.read()))
        except OSError:
            args = ["-DGGML_NATIVE=OFF"]
    args.append(llamafile_arg(patched))
    if argv == ["--signature"]:
        on = [a[len("-DGGML_"):-len("=ON")].lower() for a in args if a.endswith("=ON")]
        if "-DGGML_LLAMAFILE=OFF" in args:
            on.append("nollamafile")
        if patched:
            on.append("patched")
        print("-".join([platform.machine()] + on))
    else:
        print(" ".join(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
