"""The C++ probe (probe/edgekv_probe.cpp, what the ARM check runs under qemu, where no aarch64
Python exists) agrees with the Python probe (engines/probe.py) on x86: the same schedules, the
same max |logit diff| to the bit, the same KV verdicts, on EdgeKV's build with its kernels on
and off (off, some schedules differ: the comparison sees a difference, and both see the same)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import real_stack, skip_or_fail

real_stack("real engine", "llama_cpp", "gguf")

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
TREES = (ROOT / "build/patched/llama_cpp_python-0.3.36/vendor/llama.cpp",
         ROOT / "build/src/llama_cpp_python-0.3.36/vendor/llama.cpp")


def _build(tmp_path_factory, program: str) -> Path:
    """probe/<program>.cpp built against the .venv's engine (EdgeKV's patched build)."""
    import llama_cpp

    tree = next((t for t in TREES if (t / "include/llama.h").exists()), None)
    if tree is None:
        skip_or_fail("no llama.cpp tree with include/llama.h: run `make setup`")
    out = tmp_path_factory.mktemp("probe") / program
    lib = Path(llama_cpp.__file__).parent / "lib"
    subprocess.run(["sh", str(ROOT / "probe/build.sh"), "native", str(out), str(lib), str(tree),
                    program], check=True, capture_output=True, text=True)
    return out


@pytest.fixture(scope="module")
def c_probe(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "edgekv_probe")


@pytest.fixture(scope="module")
def c_kernels(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, "edgekv_kernels")


@pytest.fixture(scope="module")
def standin() -> Path:
    from edgekv.config import default_cache_dir
    from edgekv_bench.synthetic import ensure_model

    return ensure_model("synthetic-smollm2-2l-q4_k_m", default_cache_dir())


def _env(invariant: str) -> dict[str, str]:
    return {**os.environ, "GGML_CPU_BATCH_INVARIANT": invariant, "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("invariant", ["1", "0"])
def test_c_probe_prints_what_the_python_probe_finds(c_probe, standin, tmp_path, invariant):
    import heapq

    c_json, py_json = tmp_path / "c.json", tmp_path / "py.json"
    subprocess.run([str(c_probe), "--model", str(standin), "--text", heapq.__file__,
                    "--threads", "2", "--json", str(c_json)], env=_env(invariant), check=True,
                   capture_output=True, text=True, timeout=600)
    subprocess.run([sys.executable, "-m", "edgekv.cli", "probe", "--model", str(standin),
                    "--threads", "2", "--json", str(py_json), "--cache-dir", str(tmp_path / "c")],
                   env=_env(invariant), check=True, capture_output=True, text=True, timeout=600)
    c, py = json.loads(c_json.read_text()), json.loads(py_json.read_text())
    for key in ("invariant", "tokens", "results", "notes", "pending", "long_tokens", "sequences",
                "granularity", "flash_attn", "version"):
        assert c[key] == py[key], key
    assert c["batch_invariant"] is (invariant == "1")
    diffs = [d for _, d, _ in c["results"]]
    if invariant == "1":
        assert c["invariant"] and set(diffs) == {0.0}
    else:  # the stock kernels: a batch and a lone token sum in other orders
        assert max(diffs) > 0.0 and not c["invariant"]


# the K-quant types x86 sends to the tiled mat-mul from 8 columns on (stock) and for every column
# count with the switch on (0006; one-row kernels: Q6_K in 0006, Q5_K in 0010)
TILED = {"q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs"}


@pytest.mark.parametrize("invariant", ["1", "0"])
def test_kernel_check_a_column_alone_equals_it_in_every_batch(c_kernels, tmp_path, invariant):
    """probe/edgekv_kernels.cpp: every weight type's mul_mat, each column computed alone equals
    the same column in batches of 2-64, plain and repacked, 1 and 2 threads. With the stock
    kernels (switch off) it sees the batch-size switch to the tiled path, so it can fail."""
    out = tmp_path / "kernels.json"
    run = subprocess.run([str(c_kernels), "--invariant", invariant, "--threads", "1,2",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["batch_invariant"] is (invariant == "1")
    assert TILED | {"q4_0", "q4_1", "q8_0", "iq4_nl", "f16"} <= {r["type"] for r in rows}
    assert {r["threads"] for r in rows if not r["skipped"]} == {1, 2}
    assert any(r["buffer"] == "CPU_REPACK" and not r["skipped"] for r in rows)
    differ = {r["type"] for r in rows if r["differ"]}
    if invariant == "1":
        assert run.returncode == 0, run.stdout + run.stderr
        assert report["equal"] and not differ
    else:
        assert run.returncode == 3 and not report["equal"]
        if os.uname().machine == "x86_64":  # the tiled path is x86's
            assert TILED <= differ
