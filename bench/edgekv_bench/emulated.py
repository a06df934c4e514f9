"""The kernels bench's arch rows (issue 33): which instruction-set family a row ran on, and for
the aarch64 ones, EdgeKV's engine cross-built at a feature level (scripts/arm_check.sh) and
its batch-invariance probe (probe/edgekv_probe.cpp, the schedules of engines/probe.py) run
under qemu-user.

Emulation gives exactness, never speed: qemu runs every NEON instruction in software, so an
emulated row's speeds are null, its rows say `emulated: true`, and its probe seconds measure
qemu, not a device.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekv.errors import EdgeKVError

__all__ = ["ARCHES", "Arch", "emulated_cost", "host_arch", "probe_emulated", "run_emulated"]


@dataclass(frozen=True, slots=True)
class Arch:
    name: str
    level: str | None  # build/arm/<level> (scripts/arm_check.sh); None: x86, native only
    march: str | None
    qemu_cpu: str | None  # the CPU qemu emulates (it has every feature the level uses)
    device: str


ARCHES: dict[str, Arch] = {a.name: a for a in (
    Arch("x86_64-avx512", None, None, None, "an x86 CPU with AVX512"),
    Arch("x86_64-avx2", None, None, None, "an x86 CPU with AVX2, no AVX512"),
    Arch("aarch64-dotprod", "dotprod", "armv8.2-a+dotprod+fp16", "cortex-a76",
         "a Cortex-A76 (Raspberry Pi 5, 2019-2021 phones)"),
    Arch("aarch64-i8mm", "i8mm", "armv8.6-a+dotprod+fp16+i8mm", "max",
         "an Armv8.6+ core with i8mm (recent phones)"),
)}


def host_arch(machine: str | None = None, flags: frozenset[str] | None = None) -> str:
    """This machine's arch row name, from /proc/cpuinfo's flags (x86) or Features (aarch64)."""
    import platform

    from edgekv.engines.probe import cpu_identity

    machine = machine or platform.machine()
    flags = cpu_identity()[1] if flags is None else flags
    if machine in ("aarch64", "arm64"):
        return "aarch64-i8mm" if "i8mm" in flags else "aarch64-dotprod"
    return "x86_64-avx512" if "avx512f" in flags else "x86_64-avx2"


def probe_binary(arch: Arch, root: Path) -> Path:
    if arch.level is None:
        raise EdgeKVError(f"{arch.name} is not emulated here")
    binary = root / "build/arm" / arch.level / "edgekv_probe"
    if not binary.is_file():
        raise EdgeKVError(f"{binary} is missing: run `scripts/arm_check.sh build {arch.level}` "
                          "(make arm-check; it needs qemu-user and g++-aarch64-linux-gnu)")
    return binary


def probe_emulated(arch: Arch, model: Path, *, invariant: bool, long_tokens: int,
                   root: Path = Path("."), threads: int = 1,
                   timeout: float = 3600) -> dict[str, Any]:
    """The C probe's JSON for `model` on `arch` under qemu (GGML_CPU_BATCH_INVARIANT as given:
    off, the cross build runs the stock kernels, every patch being gated on the switch)."""
    import heapq

    binary = probe_binary(arch, root)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        cmd = ["qemu-aarch64", "-cpu", str(arch.qemu_cpu), "-L", "/usr/aarch64-linux-gnu",
               str(binary), "--model", str(model), "--text", heapq.__file__,
               "--threads", str(threads), "--long", str(long_tokens), "--json", str(out)]
        env = {**os.environ, "GGML_CPU_BATCH_INVARIANT": "1" if invariant else "0"}
        try:
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError as e:
            raise EdgeKVError("qemu-aarch64 is missing: apt-get install qemu-user "
                              "(scripts/arm_check.sh tools)") from e
        except subprocess.TimeoutExpired as e:
            raise EdgeKVError(f"the probe on {arch.name} did not finish in {timeout:g} s of "
                              "wall time (qemu shares the cores with whatever else runs)") from e
        if res.returncode != 0 or not out.exists():
            raise EdgeKVError(f"the probe on {arch.name} failed (exit {res.returncode}): "
                              f"{res.stderr[-600:]}")
        return dict(json.loads(out.read_text()))


def run_emulated(jobs: Sequence[tuple[Arch, Path, bool, int]], *, root: Path = Path("."),
                 parallel: int | None = None,
                 progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Each (arch, model, invariant, long tokens) probed under qemu, one thread each, as many
    at once as there are cores (qemu-user runs a guest thread on a host thread); the results
    in the order of `jobs`. A job that fails or runs out of time comes back as `{"error":
    why}`: a Gemma 3 probe that timed out after hours of emulation once took the finished
    SmolLM2 rows beside it down with it.

    The longest jobs start first (`emulated_cost`): started in the given order, the 2,040-token
    schedules of the last arch's Gemma 3 stand-in (400 s of qemu) ran alone at the end while
    the other core idled, 1,213 s for jobs that add up to 1,953 s of qemu on 2 cores
    (`git show 5d1e591:docs/bench/kernels-arm.json`)."""
    for arch in {j[0] for j in jobs}:
        probe_binary(arch, root)  # every binary is there before hours of emulation start
    done = 0

    def one(job: tuple[Arch, Path, bool, int]) -> dict[str, Any]:
        nonlocal done
        arch, model, invariant, long_tokens = job
        try:
            r = probe_emulated(arch, model, invariant=invariant, long_tokens=long_tokens,
                               root=root)
        except EdgeKVError as e:  # this job's row says so; the others' results are kept
            r = {"error": str(e)}
        done += 1
        if progress:
            progress(f"qemu {done}/{len(jobs)}: {arch.name} {model.name}"
                     + (f": {r['error']}" if "error" in r else ""))
        return r

    order = sorted(range(len(jobs)), key=lambda i: -emulated_cost(jobs[i][1], jobs[i][3]))
    with ThreadPoolExecutor(max_workers=parallel or os.cpu_count() or 1) as pool:
        done_in_order = list(pool.map(one, [jobs[i] for i in order]))
    results: list[dict[str, Any]] = [{} for _ in jobs]
    for i, r in zip(order, done_in_order, strict=True):
        results[i] = r
    return results


def emulated_cost(model: Path, long_tokens: int) -> float:
    """What a probe job costs under qemu, for ordering only: the long schedules run about
    seven times the tokens of the short ones, and a bigger file has more to compute."""
    size = model.stat().st_size if model.is_file() else 0
    return (1.0 + 7.0 * (long_tokens > 0)) * (1 + size / 2**20)
