"""The llama.cpp patch series (patches/llama.cpp): it applies to the vendored tree, a patch that
does not apply stops the build with the reason, and a second run is a no-op."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ..conftest import skip_or_fail

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts/apply_patches.sh"
PATCHES = ROOT / "patches/llama.cpp"
VENDORED = ROOT / "build/src/llama_cpp_python-0.3.36/vendor/llama.cpp"


def apply(src: Path, pdir: Path = PATCHES) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(SCRIPT), str(src), str(pdir)], capture_output=True,
                          text=True)


def tree_copy(tmp_path: Path) -> Path:
    """A source root holding the parts of the vendored tree the series edits: ggml's CPU backend
    and its public headers (0008 declares the setter in ggml-cpu.h)."""
    if not (VENDORED / "ggml/src/ggml-cpu").is_dir():
        skip_or_fail("the llama-cpp-python sdist is not extracted (make test and make "
                     "llama-server do it)")
    root = tmp_path / "llama_cpp_python"
    for part in ("ggml/src/ggml-cpu", "ggml/include"):
        shutil.copytree(VENDORED / part, root / "vendor/llama.cpp" / part)
    return root


def test_every_patch_is_numbered_and_says_why():
    patches = sorted(PATCHES.glob("*.patch"))
    assert patches, "no patches in patches/llama.cpp"
    for p in patches:
        assert p.name[:4].isdigit() and p.name[4] == "-", p.name
        head = p.read_text(encoding="utf-8").split("\n---\n", 1)[0]
        assert "Why" in head and ("GGML_" in head or "LLAMA_" in head), p.name


def test_the_series_applies_to_the_vendored_tree_once(tmp_path):
    root = tree_copy(tmp_path)
    first = apply(root)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("applied ") == len(list(PATCHES.glob("*.patch")))
    cpu = (root / "vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c").read_text()
    assert 'getenv("GGML_CPU_BATCH_INVARIANT")' in cpu
    # the run-time setter (0008), declared where a program over ggml-cpu.h finds it
    assert "void ggml_cpu_set_batch_invariant(bool on) {" in cpu
    again = apply(root)
    assert again.returncode == 0 and "already carries" in again.stdout


def test_a_patch_that_does_not_apply_stops_the_build_with_the_reason(tmp_path):
    root = tree_copy(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "0001-bad.patch").write_text(
        "Why: nothing\n---\n--- a/ggml/src/ggml-cpu/ggml-cpu.c\n"
        "+++ b/ggml/src/ggml-cpu/ggml-cpu.c\n@@ -1,1 +1,1 @@\n"
        "-this line is not in the file\n+nor is this\n")
    res = apply(root, bad)
    assert res.returncode != 0
    assert "0001-bad.patch does not apply" in res.stderr and "refusing" in res.stderr
    assert not (root / ".edgekv-patches").exists()


def test_a_tree_patched_with_another_series_is_refused(tmp_path):
    root = tree_copy(tmp_path)
    (root / ".edgekv-patches").write_text("deadbeef  0001-other.patch\n")
    res = apply(root)
    assert res.returncode != 0 and "another patch series" in res.stderr


def test_the_invariant_kernels_are_recognised_by_their_symbol(tmp_path, monkeypatch):
    """`batch_invariant_kernels`: only a CPU backend that exports the switch's accessor, and
    only while the switch is on; a folder without the backend, or the switch at 0, is not."""
    from edgekv.engines.llamacpp import batch_invariant_kernels

    assert not batch_invariant_kernels(None)
    assert not batch_invariant_kernels(tmp_path)  # no libggml-cpu here
    monkeypatch.setenv("GGML_CPU_BATCH_INVARIANT", "0")
    assert not batch_invariant_kernels(tmp_path)
    libc = Path("/lib/x86_64-linux-gnu/libc.so.6")
    if libc.exists():  # a real shared library without the symbol
        (tmp_path / "libggml-cpu.so").symlink_to(libc)
        monkeypatch.setenv("GGML_CPU_BATCH_INVARIANT", "1")
        assert not batch_invariant_kernels(tmp_path)


def test_the_series_carries_the_decode_paths():
    """The decode-speed pieces are in the series (each is exercised by the probe)."""
    text = {p.name[:4]: p.read_text(encoding="utf-8") for p in PATCHES.glob("*.patch")}
    assert "ggml_compute_forward_flash_attn_ext_few_rows" in text["0003"]
    assert "Atype == GGML_TYPE_Q8_0 || Atype == GGML_TYPE_Q4_0" in text["0004"]
    assert "static bool invariant_pad()" in text["0005"]
    assert "ggml_compute_forward_flash_attn_ext_segments" in text["0007"]
    # 0008: the switch at run time; 0005's work buffer sized for either mode
    assert "GGML_BACKEND_API void    ggml_cpu_set_batch_invariant(bool on);" in text["0008"]
    assert "invariant_out_offset(op, true)" in text["0008"]
    # 0009: on ARM with i8mm, a lone row or column of the 2x2 kernel is paired with itself
    self_pair = "const bool self_pair = num_rows_per_vec_dot > 1 && ggml_cpu_batch_invariant();"
    assert self_pair in text["0009"]
    assert "if (!ggml_cpu_batch_invariant() &&" in text["0009"]
    # 0010: one src1 column without the tiles, Q5_K from its blocks, every other tiled type
    # from the unpacked weights (exercised by probe/edgekv_kernels.cpp, test_probe_c.py)
    assert "static void tiled_q5_K_one_row(" in text["0010"]
    assert "tiled_one_col<B, SUBBLK, HAS_MIN, BIAS>(" in text["0010"]
    # 0011: on ARM with FP16 arithmetic, F16 products take tinyBLAS below 8 columns too
    assert "if (n < 8 && !ggml_cpu_batch_invariant())" in text["0011"]
    # 0012: IQ4_XS's one column from its blocks (the kernel check's IQ4_XS rows exercise it)
    assert "static void tiled_iq4_xs_one_row(" in text["0012"]
    assert "std::is_same<B, block_iq4_xs>::value) {" in text["0012"]
