"""scripts/cpu_flags.py: the llama.cpp CMake flags setup builds with, for x86 and aarch64 CPUs,
from recorded /proc/cpuinfo files (tests/fixtures/cpuinfo) and synthetic Features lines. The
rule on both: never switch on an instruction set the CPU does not list."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cpu_flags.py"
FIXTURES = ROOT / "tests" / "fixtures" / "cpuinfo"
_spec = importlib.util.spec_from_file_location("cpu_flags", SCRIPT)
assert _spec is not None and _spec.loader is not None
cpu_flags = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_flags)

PI5 = FIXTURES / "raspberry-pi-5.txt"
PHONE = FIXTURES / "phone-armv9-tensor-g3.txt"
ZEN4 = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
        "sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl "
        "nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 "
        "sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy "
        "svm cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext perfctr_core ssbd ibrs "
        "ibpb stibp vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f "
        "avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl "
        "xsaveopt xsavec xgetbv1 xsaves avx512_bf16 clzero xsaveerptr wbnoinvd arat npt "
        "nrip_save avx512vbmi umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni "
        "avx512_bitalg avx512_vpopcntdq rdpid fsrm")
HASWELL = ("fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand "
           "bmi1 avx2 bmi2 erms")


def run(*args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                         check=True, env=env)
    return out.stdout.strip()


def arm(features: str) -> str | None:
    return cpu_flags.arm_arch(set(features.split()))


def test_raspberry_pi_5() -> None:
    """Cortex-A76: Armv8.2 with dotprod and fp16; lrcpc alone does not make it 8.3 (no
    jscvt/fcma/pointer auth), dotprod alone not 8.4."""
    args = run("--cpuinfo", str(PI5), "--machine", "aarch64", "--patched").split()
    assert "-DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16" in args
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_CPU_KLEIDIAI=OFF" in args
    assert "-DGGML_LLAMAFILE=ON" in args
    assert not any("AVX" in a or "AMX" in a for a in args)
    sig = run("--cpuinfo", str(PI5), "--machine", "aarch64", "--patched", "--signature")
    assert sig == "aarch64-armv8.2-a+dotprod+fp16-llamafile-patched"


def test_phone_armv9() -> None:
    """An Armv9.0 phone: every 8.6 feature listed, so armv8.6-a with i8mm and bf16; SVE is
    listed but stays off unless asked for (EDGEKV_ARM_SVE=ON)."""
    args = run("--cpuinfo", str(PHONE), "--machine", "aarch64", "--patched").split()
    assert "-DGGML_CPU_ARM_ARCH=armv8.6-a+dotprod+fp16+i8mm+bf16" in args
    import os

    env = dict(os.environ, EDGEKV_ARM_SVE="ON")
    args = run("--cpuinfo", str(PHONE), "--machine", "aarch64", env=env).split()
    assert "-DGGML_CPU_ARM_ARCH=armv8.6-a+dotprod+fp16+i8mm+bf16+sve" in args
    assert "-DGGML_LLAMAFILE=OFF" in args  # unpatched flag set: llamafile off, as on x86


def test_environment_names_the_cpu() -> None:
    import os

    env = dict(os.environ, EDGEKV_CPUINFO=str(PI5), EDGEKV_MACHINE="aarch64")
    assert run("--patched", "--signature", env=env) == (
        "aarch64-armv8.2-a+dotprod+fp16-llamafile-patched")


@pytest.mark.parametrize(("features", "want"), [
    ("fp asimd evtstrm crc32 cpuid", "armv8-a"),  # Cortex-A53 (Raspberry Pi 3/4: A72 alike)
    ("fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid", "armv8-a"),
    # Cortex-A55 lists asimddp and fp16: extensions over 8.2
    ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc "
     "dcpop asimddp", "armv8.2-a+dotprod+fp16"),
    # fphp without asimdhp: no vector fp16
    ("fp asimd crc32 atomics fphp cpuid asimdrdm dcpop asimddp", "armv8.2-a+dotprod"),
    # i8mm on an 8.2 core (no pointer auth): a tag, not armv8.6-a (which would add bf16 too)
    ("fp asimd crc32 atomics fphp asimdhp asimdrdm dcpop asimddp i8mm",
     "armv8.2-a+dotprod+fp16+i8mm"),
    # i8mm without bf16 on an otherwise 8.5 core: armv8.5-a + i8mm, never armv8.6-a
    ("fp asimd crc32 atomics fphp asimdhp asimdrdm jscvt fcma lrcpc dcpop asimddp asimdfhm "
     "dit uscat ilrcpc flagm sb paca pacg dcpodp flagm2 frint i8mm",
     "armv8.5-a+dotprod+fp16+i8mm"),
    ("", None),
])
def test_arm_levels(features: str, want: str | None) -> None:
    assert arm(features) == want


def test_arm_never_enables_what_is_not_listed() -> None:
    """Each -march the script writes, for each feature subset of the phone's line that drops
    one name, implies only what the line lists (the level's own names and the tags)."""
    phone = cpu_flags.arm_features(PHONE.read_text())
    for drop in sorted(phone):
        feats = phone - {drop}
        march = cpu_flags.arm_arch(feats)
        assert march is not None or drop in ("fp", "asimd")
        if march is None:
            continue
        level, *tags = march.split("+")
        implied = set()
        for name, needed in cpu_flags.ARM_LEVELS:
            implied |= set(needed)
            if name == level:
                break
        assert implied <= feats, (drop, march)
        for needed, tag in cpu_flags.ARM_EXTENSIONS:
            if tag in tags:
                assert set(needed) <= feats, (drop, march)


def test_x86_unchanged_by_machine_option() -> None:
    """x86: each listed instruction set on, AMX and native never; AVX512 sub-features only
    with the AVX512 foundation."""
    zen4 = cpu_flags.flags_for("x86_64", f"flags\t\t: {ZEN4}\n", True)
    # what the recorded Zen 4 flag line says, read from it (never this machine's CPU)
    for option, flag in (("AVX512", "avx512f"), ("AVX512_BF16", "avx512_bf16")):
        assert flag in ZEN4.split()  # the fixture is the machine that had them
        assert f"-DGGML_{option}=ON" in zen4
    assert "-DGGML_AMX_INT8=OFF" in zen4 and "-DGGML_NATIVE=OFF" in zen4
    assert "-DGGML_LLAMAFILE=ON" in zen4
    hsw = cpu_flags.flags_for("x86_64", f"flags\t\t: {HASWELL} avx512_vnni\n", False)
    assert "-DGGML_AVX2=ON" in hsw and "-DGGML_FMA=ON" in hsw
    assert "-DGGML_AVX512=OFF" in hsw and "-DGGML_AVX512_VNNI=OFF" in hsw
    assert "-DGGML_AVX_VNNI=OFF" in hsw and "-DGGML_LLAMAFILE=OFF" in hsw
    assert cpu_flags.signature("x86_64", hsw, False) == (
        "x86_64-sse42-avx-avx2-bmi2-fma-f16c-nollamafile")


@pytest.mark.parametrize("listed", [ZEN4, HASWELL, HASWELL + " avx512_vnni avx512_bf16"])
def test_x86_each_option_follows_the_recorded_flags(listed: str) -> None:
    """The recorded flag lines above (a Zen 4, a Haswell, a Haswell claiming AVX512 parts without
    the foundation): every option is ON exactly where its cpuinfo flags are all listed (the
    AVX512 parts also need the foundation), never from the CPU running the test."""
    flags = set(listed.split())
    args = cpu_flags.flags_for("x86_64", f"flags\t\t: {listed}\n", True)
    base = next(needed for needed, option in cpu_flags.X86_FEATURES if option == "GGML_AVX512")
    foundation = all(f in flags for f in base)
    for needed, option in cpu_flags.X86_FEATURES:
        on = all(f in flags for f in needed)
        if option.startswith("GGML_AVX512_"):
            on = on and foundation
        assert f"-D{option}={'ON' if on else 'OFF'}" in args, (option, args)


def test_x86_cpuinfo_file(tmp_path: Path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\nflags\t\t: {HASWELL}\n")
    assert run("--cpuinfo", str(f), "--machine", "x86_64", "--patched", "--signature") == (
        "x86_64-sse42-avx-avx2-bmi2-fma-f16c-llamafile-patched")


def test_other_machine_portable() -> None:
    assert cpu_flags.flags_for("riscv64", "isa : rv64imafdc\n", True) == [
        "-DGGML_NATIVE=OFF", "-DGGML_LLAMAFILE=ON"]
    assert cpu_flags.flags_for("aarch64", None, False) == [
        "-DGGML_NATIVE=OFF", "-DGGML_LLAMAFILE=OFF"]


def test_this_machine_gets_only_what_its_cpuinfo_lists() -> None:
    """Detected, never assumed: on the machine running the tests, each x86 instruction set
    is on exactly where /proc/cpuinfo lists it (an AVX2-only EPYC gets AVX512 off), AMX
    never."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() != "x86_64" or not cpuinfo.is_file():
        pytest.skip("x86-64 Linux only")
    text = cpuinfo.read_text()
    listed = set(next(line for line in text.splitlines() if line.startswith("flags"))
                 .split(":", 1)[1].split())
    args = cpu_flags.flags_for("x86_64", text, True)
    for flag, option in (("avx512f", "AVX512"), ("avx2", "AVX2"), ("fma", "FMA"),
                         ("avx512_bf16", "AVX512_BF16"), ("avx512_vnni", "AVX512_VNNI")):
        state = "ON" if flag in listed and (flag == "avx512f" or not flag.startswith("avx512")
                                            or "avx512f" in listed) else "OFF"
        assert f"-DGGML_{option}={state}" in args, (option, state, args)
    assert "-DGGML_AMX_INT8=OFF" in args and "-DGGML_NATIVE=OFF" in args
