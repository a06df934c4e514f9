"""The shape of the code, as numbers a reviewer can check (issue 21, "evidence of shape").

    python scripts/shape.py [--json docs/bench/shape.json]

Every figure is computed from the source with `ast`; nothing is imported. Keys (each list
figure is `{"count": N, "list": [...]}`):

- `import_cycles`: the strongly connected components (more than one module, or a module that
  imports itself) of the import graph of `src/edgekv`. Every import counts: module level,
  inside functions, under `if TYPE_CHECKING:`. Relative imports are resolved; a package's
  `__init__` is a module of its own (`edgekv.serve` is `src/edgekv/serve/__init__.py`). An
  edge goes to the module that is named: `from .x import y` is an edge to `.x.y` where that is
  a module, else to `.x`; the parent packages that Python also initialises are not edges
  (every submodule would otherwise be in a cycle with a package that re-exports it). Each
  component is listed with its modules and one cycle through them.
- `harness_import_cycles`: the same, among the modules of `bench/edgekv_harness`
  (`lab_import_cycles`: of `bench/edgekv_bench`).
- `wheel_lines`: lines of the `.py` files under `src/edgekv` (what the wheel ships).
- `harness_lines`: lines of the `.py` files of `edgekv_harness` (test and reliability
  harnesses, not shipped; `bench/edgekv_harness`, before the lab had its own distribution
  `harness/edgekv_harness`).
- `lab_lines`: lines of what is not the product: `bench/` (the lab's distribution), `harness/`
  and `scripts/`, and the lab's modules still inside `src/edgekv` (`lab_lines_in_wheel`: the
  bench package, baseline, markdown, texts, demo; 0 once the lab moved out).
- `import_floors`: floors of the package's import graph (`import_floor_chain`: one longest
  chain, top down); `longest_functions`, `functions_over_60_lines`: by `end_lineno - lineno`.
- `generate_lines`: the length of `EdgeKV.generate` in `src/edgekv/cache.py`
  (`end_lineno - lineno + 1`, decorators excluded).
- `getattr_capability_probes`: `getattr(...)`/`hasattr(...)` calls in `src/edgekv` that
  probe an adapter or engine for a capability. Heuristic: the first argument's source text
  contains `adapter` or `engine`, or is `a` (the adapters' usual local name).
- `private_cross_module`: accesses `obj._name` in `src/edgekv` where `obj` is not `self`,
  `cls` or `super()` and `_name` is not a dunder. A heuristic for reaching into another
  object's privates: it counts a module's own `_helper` reached through another object too.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["import_cycles", "import_graph", "measure", "modules"]


def modules(src: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every `.py` of the package rooted at `src/package`."""
    out: dict[str, Path] = {}
    for f in sorted((src / package).rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _resolve(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `mods` that it imports (anywhere in its body)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module)
                for a in node.names:
                    sub = f"{base}.{a.name}" if base else a.name
                    targets.append(sub if sub in mods else base)
            for t in targets:
                # `import a.b.c` names a.b.c; the closest enclosing module of ours is the edge
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
                elif t == mod and isinstance(node, ast.ImportFrom) and node.level == 0:
                    graph[mod].add(t)  # a module importing itself by name
    return graph


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative: deep graphs do not recurse)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def _one_cycle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first, inside it)."""
    start, members = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:  # v -> start closes the cycle: walk back from v
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp  # unreachable for a real component


def import_cycles(src: Path, package: str) -> list[dict[str, list[str]]]:
    """The import cycles of the package: each component's modules and one cycle through them."""
    graph = import_graph(modules(src, package))
    comps = [c for c in _sccs(graph) if len(c) > 1 or c[0] in graph[c[0]]]
    return [{"modules": c, "cycle": _one_cycle(graph, c)} for c in sorted(comps)]


def _lines(files: Iterable[Path]) -> int:
    return sum(len(f.read_text().splitlines()) for f in files)


def _generate_lines(package: Path) -> int | None:
    """The length of `EdgeKV.generate`, wherever in the package the class lives."""
    for f in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "EdgeKV":
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "generate":
                        assert item.end_lineno is not None
                        return item.end_lineno - item.lineno + 1
    return None


def functions(src: Path, package: str) -> list[tuple[int, str]]:
    """(lines, `file:line: qualified name`) of every function and method of the package,
    longest first (`end_lineno - lineno + 1`, decorators excluded)."""
    out: list[tuple[int, str]] = []
    for f in sorted((src / package).rglob("*.py")):
        rel = f.relative_to(src.parent).as_posix()

        def visit(node: ast.AST, prefix: str, rel: str = rel) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    assert child.end_lineno is not None
                    out.append((child.end_lineno - child.lineno + 1,
                                f"{rel}:{child.lineno}: {prefix}{child.name}"))
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")

        visit(ast.parse(f.read_text(), str(f)), "")
    return sorted(out, key=lambda x: (-x[0], x[1]))


def import_floors(src: Path, package: str) -> dict[str, Any]:
    """The floors of the import graph: a module that imports none of the package's is on floor
    1, any other one floor above the highest it imports. Every import counts (as for cycles);
    the package's own `__init__`, which re-exports the API, is left out (it sits on top).
    Returns the number of floors and one longest chain, top down."""
    graph = import_graph(modules(src, package))
    graph.pop(package, None)
    for deps in graph.values():
        deps.discard(package)
    floor: dict[str, int] = {}
    below: dict[str, str | None] = {}

    def height(m: str, seen: tuple[str, ...] = ()) -> int:
        if m not in floor:
            if m in seen:  # a cycle: not a DAG, counted as one floor more (import_cycles says)
                return 0
            best, via = 0, None
            for d in sorted(graph[m]):
                h = height(d, (*seen, m))
                if h > best:
                    best, via = h, d
            floor[m], below[m] = best + 1, via
        return floor[m]

    for m in sorted(graph):
        height(m)
    top = max(sorted(floor), key=lambda m: floor[m]) if floor else None
    chain: list[str] = []
    while top is not None:
        chain.append(top)
        top = below[top]
    return {"floors": max(floor.values(), default=0), "chain": chain}


def _is_probe_target(text: str) -> bool:
    return "adapter" in text or "engine" in text or text == "a"


def _walk_files(src: Path, package: str) -> Iterable[tuple[str, str, ast.AST]]:
    for f in sorted((src / package).rglob("*.py")):
        text = f.read_text()
        rel = f.relative_to(src.parent).as_posix()
        for node in ast.walk(ast.parse(text, str(f))):
            yield rel, text, node


def capability_probes(src: Path, package: str) -> list[str]:
    out = []
    for rel, text, node in _walk_files(src, package):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args):
            first = ast.get_source_segment(text, node.args[0]) or ""
            if _is_probe_target(first):
                out.append(f"{rel}:{node.lineno}: {ast.get_source_segment(text, node)}")
    return out


def private_accesses(src: Path, package: str) -> list[str]:
    out = []
    for rel, text, node in _walk_files(src, package):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not (node.attr.startswith("__") and node.attr.endswith("__"))
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and not (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                         and node.value.func.id == "super")):
            out.append(f"{rel}:{node.lineno}: {ast.get_source_segment(text, node)}")
    return out


def _counted(items: list[Any]) -> dict[str, Any]:
    return {"count": len(items), "list": items}


def _by_place(items: list[str]) -> list[str]:
    """`file:line: text` entries in file order, then line order."""
    def key(item: str) -> tuple[str, int]:
        path, line, _ = item.split(":", 2)
        return path, int(line)

    return sorted(items, key=key)


# what is not the product: the lab (its own distribution under bench/; before it had one, the
# harness/ folder and the bench package inside the wheel) and the scripts
LAB_IN_WHEEL = ("bench", "baseline.py", "markdown.py", "texts.py", "demo.py")


def _lab_files(root: Path) -> list[Path]:
    out = [f for d in ("bench", "harness", "scripts") if (root / d).is_dir()
           for f in (root / d).rglob("*.py")]
    pkg = root / "src" / "edgekv"
    for name in LAB_IN_WHEEL:
        out += sorted((pkg / name).rglob("*.py")) if (pkg / name).is_dir() else \
            [pkg / name] if (pkg / name).is_file() else []
    return out


def measure(root: Path = ROOT) -> dict[str, Any]:
    src = root / "src"
    harness = next((d for d in (root / "bench", root / "harness")
                    if (d / "edgekv_harness").is_dir()), root / "harness")
    lab_pkg = root / "bench" / "edgekv_bench"
    funcs = functions(src, "edgekv")
    floors = import_floors(src, "edgekv")
    return {
        "import_cycles": _counted(import_cycles(src, "edgekv")),
        "harness_import_cycles": _counted(
            import_cycles(harness, "edgekv_harness") if harness.is_dir() else []),
        "lab_import_cycles": _counted(
            import_cycles(root / "bench", "edgekv_bench") if lab_pkg.is_dir() else []),
        "wheel_lines": _lines((src / "edgekv").rglob("*.py")),
        "harness_lines": _lines((harness / "edgekv_harness").rglob("*.py")),
        "lab_lines": _lines(_lab_files(root)),
        "lab_lines_in_wheel": _lines(f for f in _lab_files(root) if src in f.parents),
        "import_floors": floors["floors"],
        "import_floor_chain": floors["chain"],
        "generate_lines": _generate_lines(src / "edgekv"),
        "longest_functions": [f"{n} lines: {where}" for n, where in funcs[:10]],
        "functions_over_60_lines": _counted([where for n, where in funcs if n > 60]),
        "getattr_capability_probes": _counted(_by_place(capability_probes(src, "edgekv"))),
        "private_cross_module": _counted(_by_place(private_accesses(src, "edgekv"))),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--root", default=str(ROOT), help="the checkout (default: this one)")
    a = p.parse_args(argv)
    res = measure(Path(a.root))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    cyc = res["import_cycles"]
    print(f"import cycles: {cyc['count']}")
    for c in cyc["list"]:
        print("  " + " -> ".join(c["cycle"]) + f"  ({len(c['modules'])} modules)")
    print(f"harness import cycles: {res['harness_import_cycles']['count']}")
    print(f"wheel lines: {res['wheel_lines']} (of them the lab's: {res['lab_lines_in_wheel']}); "
          f"lab lines: {res['lab_lines']}; harness lines: {res['harness_lines']}; "
          f"EdgeKV.generate: {res['generate_lines']} lines")
    print(f"import floors: {res['import_floors']} ({' -> '.join(res['import_floor_chain'])})")
    print(f"functions over 60 lines: {res['functions_over_60_lines']['count']}; longest: "
          + "; ".join(res["longest_functions"][:3]))
    print(f"getattr/hasattr capability probes: {res['getattr_capability_probes']['count']}; "
          f"private accesses through another object: {res['private_cross_module']['count']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
