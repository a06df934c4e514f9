"""The harnesses a source checkout keeps beside the package: `harness/edgekv_harness` (the
fault matrix, the fuzz supervisor, Redis test servers). The wheel does not ship them; a
checkout's `edgekv` finds them next to its `src/`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ..errors import EdgeKVError

__all__ = ["HARNESS", "harness_dir", "harness_module"]

HARNESS = "edgekv_harness"


def harness_dir() -> Path | None:
    """`harness/` of the checkout this package runs from (`src/edgekv/bench` -> the checkout's
    root), where it holds `edgekv_harness`; None in an installed wheel."""
    d = Path(__file__).resolve().parents[3] / "harness"
    return d if (d / HARNESS / "__init__.py").is_file() else None


def harness_module(name: str, what: str | None = None) -> ModuleType:
    """`edgekv_harness.<name>`: importable already (the tests' `pythonpath`), else from the
    checkout's `harness/` (put on `sys.path`). Raises `EdgeKVError` saying that `what` runs
    only in a source checkout where there is none."""
    if importlib.util.find_spec(HARNESS) is None:
        d = harness_dir()
        if d is None:
            raise EdgeKVError(
                f"{what or f'{HARNESS}.{name}'} runs only in a source checkout: its harness "
                f"(harness/{HARNESS}, beside src/) is not part of the installed package")
        sys.path.append(str(d))
    return importlib.import_module(f"{HARNESS}.{name}")
