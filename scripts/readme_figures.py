"""The README's figures, each pinned to one field of the JSON it cites (docs/readme-figures.json).

    python scripts/readme_figures.py            # add the figures not pinned yet; drop gone ones
    python scripts/readme_figures.py --list     # every pin, with how many fields it could be

A *unit* of the README is a table row, or a paragraph or list item with its wrapped lines
joined (a source named on the next line still counts). A unit that names files or folders under
`docs/bench/` is sourced, and each number on it is a figure (tests/test_readme_figures.py: which
numbers are names, not figures); a path in the form `git show <commit>:docs/bench/FILE` points
to a run in git history and sources nothing. A pin says which field a figure is: `file` and
`path` (keys and list indices joined by `/`, a `/` in a key written `~1` as in a JSON pointer;
`#len` for the length of a list). The test checks each figure
against its pinned field only, at the README's precision, so a figure that happens to equal
another number in the same JSON fails when its own field changes.

A new figure is pinned here to the field whose value matches and whose name fits its unit best
(`ms` to keys with `ms`, `%` to shares and rates, `x` to ratios, a bare count to counts), the
first in the file on a tie; `candidates` records how many fields matched, so a reader sees
which pins were a choice. A pin whose value stopped matching is never moved: the test fails.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PINS = ROOT / "docs" / "readme-figures.json"
# a path after `<commit>:` (`git show abc1234:docs/bench/x.json`) is a run in git history, not a
# file of the tree: it sources nothing
SOURCE = re.compile(r"(?<![\w:/.-])docs/bench/[\w./-]*")
# names that carry digits but are not figures
NAMES = re.compile(r"Gemma ?3|Zen ?\d|\d+-node|MiniLM-L6-v2|all-MiniLM-L6|L6|x86-64|"
                   r"Python 3\.\d+|[A-Za-z]+\d\w*|(?<![\d.])\d+(?!x\b|ms\b|s\b)[A-Za-z]\w*|"
                   r"\w+_\d\w*|top-\d+|k=\d+")
FIGURE = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(x|%| ?ms| ?s\b)?(?![\w])")
ITEM = re.compile(r"^\s*(?:[-*]|\d+\.)\s")

__all__ = ["Figure", "fields", "figures", "matches", "units"]

Figure = tuple[str, float, int, str]  # as shown, value, decimal places, unit


def units(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each table row, and each paragraph or list item with its
    wrapped lines joined; code blocks and headings are skipped."""
    out: list[tuple[int, str]] = []
    cur: list[str] = []
    start = 0
    fence = False

    def flush() -> None:
        if cur:
            out.append((start, " ".join(s.strip() for s in cur)))
            cur.clear()

    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            flush()
            fence = not fence
            continue
        if fence:
            continue
        if not line.strip() or line.startswith("#"):
            flush()
        elif line.startswith("|"):
            flush()
            out.append((i, line))
        else:
            if ITEM.match(line):
                flush()
            if not cur:
                start = i
            cur.append(line)
    flush()
    return out


def sources(unit: str) -> list[Path]:
    out: list[Path] = []
    for m in SOURCE.findall(unit):
        p = ROOT / m.rstrip(".,;:)")
        if p.is_dir():
            out += sorted(p.glob("*.json"))
        elif p.suffix == ".json" and p not in out:
            out.append(p)
    return out


def figures(unit: str) -> list[Figure]:
    text = re.sub(r"`[^`]*`", " ", unit)  # code spans: commands and flags
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    text = SOURCE.sub(" ", text)
    text = NAMES.sub(" ", text)
    out = []
    for m in FIGURE.finditer(text):
        whole, frac, unit_ = m.group(1), m.group(2) or "", (m.group(3) or "").strip()
        value = float(whole.replace(",", "") + frac)
        out.append((m.group(0), value, len(frac) - 1 if frac else 0, unit_))
    return out


def fields(x: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """(path, value) of every number in a JSON value, and `path/#len` of every list."""
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield path, float(x)
    elif isinstance(x, dict):
        for k, v in x.items():
            k = str(k).replace("~", "~0").replace("/", "~1")  # as a JSON pointer escapes them
            yield from fields(v, f"{path}/{k}" if path else k)
    elif isinstance(x, list):
        yield f"{path}/#len", float(len(x))
        for i, v in enumerate(x):
            yield from fields(v, f"{path}/{i}" if path else str(i))


def at(data: Any, path: str) -> float | None:
    """The number at `path` (see `fields`), or None where there is none."""
    x = data
    for part in (s.replace("~1", "/").replace("~0", "~") for s in path.split("/")):
        if part == "#len":
            return float(len(x)) if isinstance(x, list) else None
        if isinstance(x, list) and part.isdigit() and int(part) < len(x):
            x = x[int(part)]
        elif isinstance(x, dict) and part in x:
            x = x[part]
        else:
            return None
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def matches(value: float, places: int, unit: str, v: float) -> bool:
    scales = {"%": (1.0, 100.0), "s": (1.0, 0.001), "ms": (1.0, 1000.0)}.get(unit, (1.0,))
    tol = 0.5 * 10 ** -places + 1e-9
    return any(abs(v * k - value) <= tol for k in scales)


_HINTS = {"ms": ("ms",), "s": ("_s", "seconds", "ms"), "%": ("share", "rate", "pct", "percent",
          "identical", "equal", "agree", "hit", "reuse", "frac"),
          "x": ("ratio", "speedup", "vs", "x", "over"), "": ("count", "n_", "tokens", "requests",
          "runs", "#len", "rows", "rounds")}


def _score(path: str, unit: str) -> int:
    return sum(h in path.lower() for h in _HINTS.get(unit, ()))


def key(unit: str) -> str:
    """A unit's name in the pins: its first 100 characters, spaces collapsed."""
    return " ".join(unit.split())[:100]


def sourced() -> list[tuple[int, str, list[Path]]]:
    return [(i, u, src) for i, u in units(README.read_text()) if (src := sources(u))]


def update(pins: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The pins for the README as it is: existing ones kept, new figures pinned, gone ones
    dropped; and the figures that match no field of their sources (left unpinned)."""
    old = {(p["unit"], p["index"], p["figure"]): p for p in pins}
    out, unmatched = [], []
    for line, u, src in sourced():
        datas = [(p, json.loads(p.read_text())) for p in src]
        for n, (shown, value, places, unit) in enumerate(figures(u)):
            k = (key(u), n, shown)
            if k in old:
                out.append(old[k])
                continue
            cands = [(p, path) for p, d in datas for path, v in fields(d)
                     if matches(value, places, unit, v)]
            if not cands:
                unmatched.append(f"README.md:{line}: {shown!r} in none of "
                                 f"{[p.name for p in src]}")
                continue
            best = max(cands, key=lambda c: _score(c[1], unit))
            out.append({"unit": key(u), "index": n, "figure": shown,
                        "file": best[0].relative_to(ROOT).as_posix(), "path": best[1],
                        "candidates": len(cands)})
    return out, unmatched


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print the pins")
    a = p.parse_args(argv)
    pins = json.loads(PINS.read_text()) if PINS.is_file() else []
    if a.list:
        for pin in pins:
            print(f"{pin['figure']:>12}  {pin['file']}:{pin['path']}  "
                  f"({pin['candidates']} candidates)")
        return 0
    new, unmatched = update(pins)
    PINS.write_text(json.dumps(new, indent=1) + "\n")
    chosen = sum(pin["candidates"] > 1 for pin in new)
    print(f"{len(new)} figures pinned ({chosen} chosen among several matching fields); "
          f"{len(unmatched)} match nothing")
    for m in unmatched:
        print("  " + m)
    return 1 if unmatched else 0


if __name__ == "__main__":
    sys.exit(main())
