"""Every figure the README quotes beside a benchmark JSON is the field of that JSON it is pinned
to (docs/readme-figures.json, made by scripts/readme_figures.py).

A README unit (a table row, or a paragraph or list item with its wrapped lines joined) that
names files or folders under `docs/bench/` is sourced: each number on it must have a pin, and
the value at the pinned field must match at the README's precision (`308 ms` matches 308.4;
`88%` matches 0.88 or 88.0; `2.17 s` matches 2173 ms). Numbers inside `code spans` (commands,
flags) and names with digits (SmolLM2-135M, Q4_1, Gemma 3) are not figures. Every row of the
"Measured" table must name its source."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from tests.scriptkit import load_script

ROOT = Path(__file__).resolve().parents[1]
rf = load_script("readme_figures")


def _pins() -> dict[tuple[str, int, str], dict]:
    return {(p["unit"], p["index"], p["figure"]): p for p in json.loads(rf.PINS.read_text())}


def check(units: list[tuple[int, str, list[Path]]], pins: dict, root: Path = ROOT) -> list[str]:
    """What is wrong with the figures of `units` against `pins`: one line each."""
    bad = []
    for line, u, _src in units:
        for n, (shown, value, places, unit) in enumerate(rf.figures(u)):
            pin = pins.get((rf.key(u), n, shown))
            if pin is None:
                bad.append(f"README.md:{line}: {shown!r} is not pinned "
                           "(python scripts/readme_figures.py)")
                continue
            v = rf.at(json.loads((root / pin["file"]).read_text()), pin["path"])
            if v is None or not rf.matches(value, places, unit, v):
                bad.append(f"README.md:{line}: {shown!r} but {pin['file']}:{pin['path']} "
                           f"is {v}")
    return bad


def test_every_measured_row_names_its_json():
    text = rf.README.read_text()
    section = text.split("\n## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("|--")]
    assert len(rows) > 5
    missing = [r[:80] for r in rows[1:] if not rf.sources(r)]
    assert not missing, f"Measured rows without a docs/bench JSON beside them: {missing}"


def test_every_sourced_figure_is_its_pinned_field():
    units = rf.sourced()
    assert units, "the README names no benchmark JSON"
    bad = check(units, _pins())
    assert not bad, "\n".join(bad)


def test_the_checker_catches_a_stale_figure():
    """The checker itself can fail: a figure that is not its field's value is reported."""
    assert rf.matches(308, 0, "ms", 308.4) and rf.matches(88, 0, "%", 0.88)
    assert rf.matches(0.3, 1, "s", 308.4)  # 308.4 ms shown in seconds
    assert not rf.matches(2173, 0, "ms", 2.0) and not rf.matches(30.4, 1, "x", 0.88)
    got = rf.figures("| `bench --requests 40` | **EdgeKV 308 ms**, 1.59x, SmolLM2-135M Q4_1, "
                     "88% |")
    assert [(v, u) for _, v, _, u in got] == [(308.0, "ms"), (1.59, "x"), (88.0, "%")]


def test_a_figure_equal_to_another_number_of_its_json_is_still_caught(tmp_path):
    """The old check accepted a figure equal to any number in the JSON; a pin is one field.
    Here the README's 308 ms is pinned to `ttft_ms`; after a rerun `ttft_ms` is 512 while
    another field (`p95_ms`) happens to be 308: the figure is stale, and it is reported."""
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    run = tmp_path / "docs" / "bench" / "x.json"
    unit = "- TTFT 308 ms over 2 runs\n  (docs/bench/x.json)"
    (i, joined), = rf.units(unit)
    assert "docs/bench/x.json" in joined  # the source on the wrapped line counts
    units = [(i, joined, [run])]
    pins = {(rf.key(joined), 0, "308 ms"): {"file": "docs/bench/x.json", "path": "ttft_ms"},
            (rf.key(joined), 1, "2"): {"file": "docs/bench/x.json", "path": "runs/#len"}}
    run.write_text(json.dumps({"ttft_ms": 308.4, "p95_ms": 400.0, "runs": [1, 2]}))
    assert check(units, pins, tmp_path) == []
    run.write_text(json.dumps({"ttft_ms": 512.0, "p95_ms": 308.0, "runs": [1, 2]}))
    bad = check(units, pins, tmp_path)
    assert len(bad) == 1 and "ttft_ms is 512.0" in bad[0]
    # a figure nobody pinned is reported too
    assert "not pinned" in check(units, {}, tmp_path)[0]


def test_a_run_in_git_history_sources_nothing():
    """`git show <commit>:docs/bench/FILE` points to a run that left the tree: a unit naming only
    such a pointer is not sourced (its numbers need no pin), and beside a current file it adds
    nothing to the unit's sources."""
    old = "- Decode at 1B ran a tenth slower (`git show 8e48a15:docs/bench/gone-run.json`)."
    assert rf.sources(old) == []
    both = "- TTFT 308 ms (docs/bench/reuse.json; before: `git show 8e48a15:docs/bench/gone.json`)"
    assert rf.sources(both) == [ROOT / "docs" / "bench" / "reuse.json"]


def _named_runs(text: str) -> list[tuple[str | None, str]]:
    """The runs a text names: (commit, path) for `git show COMMIT:docs/bench/F`, (None, path)
    for a file in the tree."""
    pat = re.compile(r"(?:git show ([0-9a-f]{7,40}):)?(docs/bench/[\w./-]*\w\.(?:json|md))")
    return [(m.group(1), m.group(2)) for m in pat.finditer(text)]


def test_every_run_the_docs_name_is_where_they_say():
    """A docs file that names a run under docs/bench/ names one that is there: in the tree, or,
    for a `git show COMMIT:docs/bench/F` pointer, in that commit (a run that leaves the tree
    leaves a pointer, not a dangling name)."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = []
    for doc in docs:
        for commit, path in _named_runs(doc.read_text()):
            if commit is None:
                ok = (ROOT / path).exists()
            else:
                ok = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=ROOT,
                                    capture_output=True).returncode == 0
            if not ok:
                bad.append(f"{doc.relative_to(ROOT)}: {commit + ':' if commit else ''}{path}")
    assert not bad, "runs named but not there:\n" + "\n".join(sorted(set(bad)))


def test_a_dangling_run_name_is_caught():
    got = _named_runs("see docs/bench/gone.json and "
                      "`git show 5d1e591:docs/bench/kernels-arm.json`.")
    assert got == [(None, "docs/bench/gone.json"), ("5d1e591", "docs/bench/kernels-arm.json")]
