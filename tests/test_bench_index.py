"""docs/bench/README.md lists every JSON of docs/bench, each with the command that made it
(scripts/bench_index.py makes it from the files and git). The file list is checked exactly; the
commit column depends on the clone's history (a shallow clone has less), so it is not."""

from __future__ import annotations

import re
from pathlib import Path

from tests.scriptkit import load_script

ROOT = Path(__file__).resolve().parent.parent
index = load_script("bench_index")


def _listed(text: str) -> dict[str, str]:
    return {m[1]: m[2] for m in re.finditer(r"^\| `([^`]+)` \| `([^`]+)` \|", text, re.M)}


def test_the_index_lists_every_json_with_its_command():
    listed = _listed((ROOT / "docs" / "bench" / "README.md").read_text())
    present = {f.relative_to(index.DOCS).as_posix() for f in index.DOCS.rglob("*.json")}
    assert set(listed) == present, ("run python scripts/bench_index.py: "
                                    f"missing {sorted(present - set(listed))}, "
                                    f"gone {sorted(set(listed) - present)}")
    assert all(cmd != "not recorded" for cmd in listed.values()), listed


def test_a_new_json_is_seen(tmp_path, monkeypatch):
    (tmp_path / "reuse-new.json").write_text('{"environment": {"cpu": "X (avx2)", '
                                             '"cpu_count": 2, "argv": ["edgekv", "bench", '
                                             '"reuse", "--runs", "9"]}}')
    monkeypatch.setattr(index, "DOCS", tmp_path)
    rows = index.rows()
    assert rows == [("reuse-new.json", "edgekv bench reuse --runs 9", "not committed",
                     "X (avx2), 2 cores")]
