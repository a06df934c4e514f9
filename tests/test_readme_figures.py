"""Every figure the README quotes beside a benchmark JSON is found in that JSON.

A README line (a table row, a list item or a paragraph line) that names one or more files or
folders under `docs/bench/` is a sourced line: each number on it must be a value of one of the
JSONs it names, at the README's precision (`308 ms` matches 308.4; `88%` matches 0.88 or 88.0;
`2.17 s` matches 2173 ms), or the length of a list in them (a count of rows). Numbers inside
`code spans` (commands, flags) and names with digits (SmolLM2-135M, Q4_1, Gemma 3) are not
figures. Every row of the "Measured" table must name its source."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SOURCE = re.compile(r"docs/bench/[\w./-]*")
# names that carry digits but are not figures
NAMES = re.compile(r"Gemma ?3|Zen ?\d|\d+-node|MiniLM-L6-v2|all-MiniLM-L6|L6|x86-64|"
                   r"Python 3\.\d+|[A-Za-z]+\d\w*|(?<![\d.])\d+(?!x\b|ms\b|s\b)[A-Za-z]\w*|"
                   r"\w+_\d\w*|top-\d+|k=\d+")
FIGURE = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(x|%| ?ms| ?s\b)?(?![\w])")


def numbers(x: object) -> Iterator[float]:
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield float(x)
    elif isinstance(x, dict):
        for v in x.values():
            yield from numbers(v)
    elif isinstance(x, list):
        yield float(len(x))
        for v in x:
            yield from numbers(v)


def sources(line: str) -> list[Path]:
    out: list[Path] = []
    for m in SOURCE.findall(line):
        p = ROOT / m.rstrip(".,;:)")
        if p.is_dir():
            out += sorted(p.glob("*.json"))
        elif p.suffix == ".json":
            out.append(p)
    return out


def figures(line: str) -> list[tuple[str, float, int, str]]:
    text = re.sub(r"`[^`]*`", " ", line)  # code spans: commands and flags
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    text = SOURCE.sub(" ", text)
    text = NAMES.sub(" ", text)
    out = []
    for m in FIGURE.finditer(text):
        whole, frac, unit = m.group(1), m.group(2) or "", (m.group(3) or "").strip()
        value = float(whole.replace(",", "") + frac)
        out.append((m.group(0), value, len(frac) - 1 if frac else 0, unit))
    return out


def found(value: float, places: int, unit: str, pool: set[float]) -> bool:
    scales = {"%": (1.0, 100.0), "s": (1.0, 0.001), "ms": (1.0, 1000.0)}.get(unit, (1.0,))
    tol = 0.5 * 10 ** -places + 1e-9
    return any(abs(v * k - value) <= tol for v in pool for k in scales)


def sourced_lines() -> list[tuple[int, str, list[Path]]]:
    return [(i, line, src) for i, line in enumerate(README.read_text().splitlines(), 1)
            if (src := sources(line))]


def test_every_measured_row_names_its_json():
    text = README.read_text()
    section = text.split("\n## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("|--")]
    assert len(rows) > 5
    missing = [r[:80] for r in rows[1:] if not sources(r)]
    assert not missing, f"Measured rows without a docs/bench JSON beside them: {missing}"


def test_every_sourced_figure_is_in_the_json_it_names():
    lines = sourced_lines()
    assert lines, "the README names no benchmark JSON"
    bad = []
    for i, line, src in lines:
        pool: set[float] = set()
        for p in src:
            pool |= set(numbers(json.loads(p.read_text())))
        for shown, value, places, unit in figures(line):
            if not found(value, places, unit, pool):
                bad.append(f"README.md:{i}: {shown!r} not in {[p.name for p in src]}")
    assert not bad, "\n".join(bad)


def test_the_checker_catches_a_stale_figure(tmp_path):
    """The checker itself can fail: a figure that is not in the cited JSON is reported."""
    pool = set(numbers({"ttft_ms_mean": 308.4, "rows": [1, 2], "share": 0.88}))
    assert found(308, 0, "ms", pool) and found(88, 0, "%", pool) and found(2, 0, "", pool)
    assert found(0.3, 1, "s", pool)  # 308.4 ms shown in seconds
    assert not found(2173, 0, "ms", pool) and not found(30.4, 1, "x", pool)
    got = figures("| `bench --requests 40` | **EdgeKV 308 ms**, 1.59x, SmolLM2-135M Q4_1, 88% |")
    assert [(v, u) for _, v, _, u in got] == [(308.0, "ms"), (1.59, "x"), (88.0, "%")]
