"""The benchmark's peers on the real engine: the state_seq peer (llama_state_seq_* prefix
caching) reuses token prefixes and answers what plain llama-cpp-python answers; the reuse
benchmark's cold page cache really is cold."""

from __future__ import annotations

import mmap
import shutil
import tempfile
from pathlib import Path

import pytest

from edgekv.engines.models import default_model_path
from edgekv_bench.reuse import _resident_pages, drop_page_cache

from ..conftest import real_stack, skip_or_fail

real_stack("real engine", "llama_cpp", check=default_model_path)

from edgekv_bench.modes import PlainMode, StateSeqMode  # noqa: E402
from edgekv_bench.texts import MANUAL, SYSTEM_PROMPT  # noqa: E402


@pytest.mark.real
def test_state_seq_peer_reuses_prefixes_and_matches_plain() -> None:
    path = str(default_model_path())
    plain = PlainMode(path, 1024, 2, 1, 1)
    peer = StateSeqMode(path, 1024, 16, 1, 1, n_threads=2)
    try:
        llm = plain.llm
        context = llm.tokenize((SYSTEM_PROMPT + "\n\n" + MANUAL).encode())[:300]
        asks = [context + llm.tokenize(f"\nQuestion {q}: what does the hub need?".encode(),
                                       add_bos=False) for q in (1, 2)]
        asks.append(asks[0][:150] + llm.tokenize(b" A different ending.", add_bos=False))
        outs = []
        for toks in asks:
            a, b = plain.run("", toks, 6), peer.run("", toks, 6)
            assert a.text == b.text
            outs.append(b)
        assert outs[0].reused == 0
        assert outs[1].reused >= 300  # the context, then into the question
        assert outs[2].reused == 150  # a prefix of a stored sequence, at token granularity
        assert outs[2].parts["load"] > 0 and outs[2].traffic_bytes > 0
    finally:
        plain.close()
        peer.close()


def _fs_type(path: Path) -> str:
    """The type of the file system `path` is on (the longest mount point above it)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        mount, fstype = line.split()[1:3]
        inside = str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def test_page_cache_drop_leaves_no_page_resident(tmp_path: Path) -> None:
    root = tmp_path
    if _fs_type(root) == "tmpfs":  # tmpfs pages are the file itself: use a disk-backed dir
        build = Path(__file__).resolve().parents[2] / "build"
        build.mkdir(exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="pagecache-", dir=build))
        if _fs_type(root) == "tmpfs":
            skip_or_fail("no disk-backed directory here: tmpfs pages cannot be dropped")
    try:
        f = root / "fragments" / "x.bin"
        f.parent.mkdir()
        f.write_bytes(b"\x01" * (1 << 20))
        f.read_bytes()
        resident, total = _resident_pages(f)
        assert total == (1 << 20) // mmap.PAGESIZE and resident <= total
        got = drop_page_cache(root)
        assert got["files"] == 1 and got["pages"] == total
        assert got["pages_resident_after_drop"] == 0
        f.read_bytes()
        assert _resident_pages(f)[0] > 0  # read back: resident again (mincore sees it)
    finally:
        if root != tmp_path:
            shutil.rmtree(root, ignore_errors=True)
