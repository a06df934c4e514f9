"""The shape of the code (scripts/shape.py): no import cycles among the package's modules, nor
among the harness's, counting every import (function-local and TYPE_CHECKING ones too). The
cycle finder is checked on a small synthetic package first, so that this test can fail."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from tests.scriptkit import load_script

ROOT = Path(__file__).resolve().parent.parent
shape = load_script("shape")

def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_the_cycle_finder_sees_every_kind_of_import(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from .a import x\n",
        "pkg/a.py": "x = 1\n",
        # a cycle through a function-local import
        "pkg/b.py": "def f():\n    from . import c\n",
        "pkg/c.py": "from .b import f\n",
        # a cycle through TYPE_CHECKING, a parent-relative import and a plain absolute one
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    from ..e import y\n",
        "pkg/e.py": "import pkg.sub.d\ny = 2\n",
        # the package's __init__ is a module: a cycle through it
        "pkg/g.py": "from . import x\n",
        "pkg/h.py": "import os\nfrom .a import x\n",  # no cycle: a -> nothing
    })
    _write(tmp_path, {"pkg/a.py": "x = 1\nfrom .g import *\n"})
    found = {frozenset(c["modules"]) for c in shape.import_cycles(tmp_path, "pkg")}
    assert found == {frozenset({"pkg.b", "pkg.c"}), frozenset({"pkg.sub.d", "pkg.e"}),
                     frozenset({"pkg", "pkg.a", "pkg.g"})}
    for c in shape.import_cycles(tmp_path, "pkg"):
        cyc = c["cycle"]
        assert cyc[0] == cyc[-1] and set(cyc) == set(c["modules"])


def test_an_acyclic_package_has_no_cycles(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from . import b\n",
                      "pkg/b.py": "import json\n"})
    assert shape.import_cycles(tmp_path, "pkg") == []


def test_no_import_cycles_in_the_package():
    cycles = [c["cycle"] for c in shape.import_cycles(ROOT / "src", "edgekv")]
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_in_the_harness():
    assert shape.import_cycles(ROOT / "bench", "edgekv_harness") == []


def test_no_import_cycles_in_the_lab():
    assert shape.import_cycles(ROOT / "bench", "edgekv_bench") == []


def test_the_wheel_holds_no_harness():
    bench = ROOT / "src" / "edgekv" / "bench"
    for name in ("faults", "faults_kit", "faults_local", "faults_load", "faults_redis", "fuzz",
                 "redis_servers"):
        assert not (bench / f"{name}.py").exists(), name
        assert (ROOT / "bench" / "edgekv_harness" / f"{name}.py").is_file(), name


def test_the_wheel_holds_no_lab():
    """The benchmarks, baselines, texts, demo and the kernel's netem tooling are the lab's
    distribution (bench/), and no product module imports it."""
    pkg = ROOT / "src" / "edgekv"
    assert not (pkg / "bench").exists()
    for name in ("baseline", "markdown", "texts", "demo", "stream/netem"):
        assert not (pkg / f"{name}.py").exists(), name
    for name in ("baseline", "markdown", "texts", "demo", "netem", "reuse", "serve", "cli"):
        assert (ROOT / "bench" / "edgekv_bench" / f"{name}.py").is_file(), name
    for f in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("edgekv_bench", "edgekv_harness")
                           for n in names), f"{f}:{node.lineno} imports the lab"


# the modules one request passes through, from HTTP to the engine and back
REQUEST_PATH = ("core/pipeline.py", "core/request.py", "limits.py", "core/match.py",
                "core/fill.py", "core/writeback.py", "core/prefix_index.py", "core/passages.py",
                "serve/slots.py", "engines/shared.py", "engines/spec.py", "serve/app.py",
                "serve/generation.py", "serve/responses.py", "serve/scheduler.py",
                "serve/errors.py")


def test_shape_json():
    """The shape's figures, asserted, and written to docs/bench/shape.json by this test (so the
    file cannot go stale): no import cycle in the product, the lab or the harness; no lab module
    in the wheel; no getattr probing of capabilities; no private reached through another
    object; `EdgeKV.generate` and every function on the request path at most 60 lines."""
    out = ROOT / "docs" / "bench" / "shape.json"
    assert shape.main(["--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) >= {"import_cycles", "wheel_lines", "harness_lines", "generate_lines",
                        "getattr_capability_probes", "private_cross_module", "lab_lines",
                        "import_floors", "longest_functions", "functions_over_60_lines"}
    for k in ("import_cycles", "getattr_capability_probes", "private_cross_module",
              "functions_over_60_lines"):
        assert res[k]["count"] == len(res[k]["list"])
    assert res["wheel_lines"] > 0 and res["harness_lines"] > 0 and res["lab_lines"] > 0
    for k in ("import_cycles", "harness_import_cycles", "lab_import_cycles",
              "getattr_capability_probes", "private_cross_module"):
        assert res[k]["count"] == 0, (k, res[k]["list"])
    assert res["lab_lines_in_wheel"] == 0
    assert 0 < res["generate_lines"] <= 60
    long_on_path = [f for f in res["functions_over_60_lines"]["list"]
                    if f.split(":")[0].removeprefix("src/edgekv/") in REQUEST_PATH]
    assert long_on_path == []
    assert all(Path(ROOT / "src" / "edgekv" / m).is_file() for m in REQUEST_PATH)


def test_the_servers_do_not_import_each_other():
    """serve (the OpenAI server) and kvserver (the KV server) share only `http`; the device's
    SparKV client (`stream`) imports neither server, and serve does not reach into stream."""
    graph = shape.import_graph(shape.modules(ROOT / "src", "edgekv"))

    def deps(pkg: str) -> set[str]:
        return {d for m, ds in graph.items() if m == pkg or m.startswith(pkg + ".") for d in ds}

    assert not any(d.startswith("edgekv.kvserver") for d in deps("edgekv.serve"))
    assert not any(d.startswith("edgekv.serve") for d in deps("edgekv.kvserver"))
    assert not any(d.startswith(("edgekv.serve", "edgekv.kvserver"))
                   for d in deps("edgekv.stream"))
    assert not any(d.startswith("edgekv.stream") for d in deps("edgekv.serve"))
