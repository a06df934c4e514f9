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

On aarch64 (a Raspberry Pi 5, a phone, Apple silicon under Linux) the same rule holds with the
Features line of /proc/cpuinfo: GGML_NATIVE stays off and GGML_CPU_ARM_ARCH names an
architecture level whose every implied feature the CPU lists, plus the extensions ggml's ARM
kernels test for where the CPU lists them: +dotprod (asimddp), +fp16 (fphp and asimdhp), +i8mm
(i8mm), +bf16 (bf16). A Raspberry Pi 5 (Cortex-A76) gets armv8.2-a+dotprod+fp16, a recent
phone armv8.6-a+dotprod+fp16+i8mm. SVE is left off even where listed (EDGEKV_ARM_SVE=ON turns
it on where the CPU lists sve): ggml's SVE kernels are a third code path beside NEON and i8mm
that EdgeKV's ARM check (scripts/arm_check.sh) does not run, and on the 128-bit SVE of phone
cores they bring no width over NEON. KleidiAI stays off (it is downloaded at configure time).

Usage: python scripts/cpu_flags.py            -> "-DGGML_NATIVE=OFF -DGGML_AVX2=ON ..."
       python scripts/cpu_flags.py --signature -> a short name of the flag set (for the stamp)
       python scripts/cpu_flags.py --patched [--signature] -> the same for the patched build
       python scripts/cpu_flags.py --cpuinfo FILE --machine aarch64 ...  -> for another CPU
           (a recorded /proc/cpuinfo; also EDGEKV_CPUINFO=FILE and EDGEKV_MACHINE=NAME)
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

# aarch64: (architecture level, the Features-line names of what it implies beyond the level
# before it). A level is chosen only if the CPU lists all of its and every lower level's
# (GCC's -march=LEVEL turns them on: aarch64-arches.def; dotprod from 8.4, i8mm and bf16 from
# 8.6). fp16 is optional at every level, so it is always a tag of its own.
ARM_LEVELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("armv8-a", ("fp", "asimd")),
    ("armv8.1-a", ("atomics", "crc32", "asimdrdm")),
    ("armv8.2-a", ("dcpop",)),
    ("armv8.3-a", ("jscvt", "fcma", "lrcpc", "paca", "pacg")),
    ("armv8.4-a", ("asimddp", "flagm", "ilrcpc", "uscat", "dit")),
    ("armv8.5-a", ("frint", "sb", "flagm2", "dcpodp")),
    ("armv8.6-a", ("i8mm", "bf16")),
)
# (Features-line names that must all be present, the -march extension tag): what ggml's ARM
# code tests for (__ARM_FEATURE_DOTPROD, _FP16_VECTOR_ARITHMETIC, _MATMUL_INT8, BF16)
ARM_EXTENSIONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("asimddp",), "dotprod"),
    (("fphp", "asimdhp"), "fp16"),
    (("i8mm",), "i8mm"),
    (("bf16",), "bf16"),
    (("sve",), "sve"),  # only with EDGEKV_ARM_SVE=ON (module docstring)
)
ARM_MACHINES = ("aarch64", "arm64", "ARM64", "armv8l")
X86_MACHINES = ("x86_64", "AMD64", "amd64")


def llamafile_arg(patched: bool = False) -> str:
    default = "ON" if patched else "OFF"
    on = os.environ.get("EDGEKV_LLAMAFILE", default).strip().upper() in ("1", "ON", "TRUE", "YES")
    return f"-DGGML_LLAMAFILE={'ON' if on else 'OFF'}"


def cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def arm_features(cpuinfo: str) -> set[str]:
    """The Features line of an aarch64 /proc/cpuinfo (the first; big.LITTLE cores list the
    same line on every core, as the kernel exposes only what all of them have)."""
    for line in cpuinfo.splitlines():
        if line.split(":", 1)[0].strip() == "Features":
            return set(line.split(":", 1)[1].split())
    return set()


def arm_arch(features: set[str], *, sve: bool = False) -> str | None:
    """The -march value for a CPU listing `features` (None where it lacks even fp/asimd):
    the highest level all of whose implied features it lists, then each extension it lists."""
    level = None
    for name, needed in ARM_LEVELS:
        if not all(f in features for f in needed):
            break
        level = name
    if level is None:
        return None
    tags = [tag for needed, tag in ARM_EXTENSIONS
            if all(f in features for f in needed) and (tag != "sve" or sve)]
    return "+".join([level, *tags])


def arm_cmake_args(features: set[str]) -> list[str]:
    sve = os.environ.get("EDGEKV_ARM_SVE", "OFF").strip().upper() in ("1", "ON", "TRUE", "YES")
    arch = arm_arch(features, sve=sve)
    args = [f"-D{opt}=OFF" for opt in ALWAYS_OFF if opt.startswith("GGML_NATIVE")]
    args.append("-DGGML_CPU_KLEIDIAI=OFF")
    if arch is not None:
        args.append(f"-DGGML_CPU_ARM_ARCH={arch}")
    return args


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


def _option(argv: list[str], name: str, env: str) -> tuple[list[str], str | None]:
    """`--name VALUE` taken out of argv, else the environment variable `env`."""
    if name in argv:
        i = argv.index(name)
        if i + 1 >= len(argv):
            raise SystemExit(f"cpu_flags: {name} needs a value")
        return argv[:i] + argv[i + 2:], argv[i + 1]
    return argv, os.environ.get(env) or None


def flags_for(machine: str, cpuinfo: str | None, patched: bool) -> list[str]:
    """The CMake flags for a `machine` (platform.machine()) whose /proc/cpuinfo reads
    `cpuinfo` (None: unreadable)."""
    if machine in X86_MACHINES and cpuinfo is not None:
        args = cmake_args(cpu_flags(cpuinfo))
    elif machine in ARM_MACHINES and cpuinfo is not None:
        args = arm_cmake_args(arm_features(cpuinfo))
    else:
        args = ["-DGGML_NATIVE=OFF"]  # other architectures: ggml's portable defaults
    return args + [llamafile_arg(patched)]


def signature(machine: str, args: list[str], patched: bool) -> str:
    on = [a.split("=", 1)[1] for a in args if a.startswith("-DGGML_CPU_ARM_ARCH=")]
    on += [a[len("-DGGML_"):-len("=ON")].lower() for a in args if a.endswith("=ON")]
    if "-DGGML_LLAMAFILE=OFF" in args:
        on.append("nollamafile")
    if patched:
        on.append("patched")
    return "-".join([machine] + on)


def main() -> int:
    argv = sys.argv[1:]
    patched = "--patched" in argv
    argv = [a for a in argv if a != "--patched"]
    argv, cpuinfo_path = _option(argv, "--cpuinfo", "EDGEKV_CPUINFO")
    argv, machine = _option(argv, "--machine", "EDGEKV_MACHINE")
    machine = machine or platform.machine()
    try:
        with open(cpuinfo_path or "/proc/cpuinfo", encoding="utf-8") as f:
            cpuinfo: str | None = f.read()
    except OSError:
        if cpuinfo_path:
            raise SystemExit(f"cpu_flags: cannot read {cpuinfo_path}") from None
        cpuinfo = None
    args = flags_for(machine, cpuinfo, patched)
    if argv == ["--signature"]:
        print(signature(machine, args, patched))
    else:
        print(" ".join(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
