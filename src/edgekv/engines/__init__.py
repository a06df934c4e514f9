"""Engine adapters behind the `KVAdapter` protocol (heavy engines import lazily)."""

from __future__ import annotations

import os

# ggml reads GGML_CPU_BATCH_INVARIANT once, when its CPU backend starts, in whatever code loads
# llama.cpp first in the process (a benchmark's plain llama-cpp-python peer included), so EdgeKV
# sets its default here, on import, unless the environment already says (engines/llamacpp.py)
os.environ.setdefault("GGML_CPU_BATCH_INVARIANT", "1")

from .base import FragmentSpec, Generation, KVAdapter  # noqa: E402
from .fake import FakeAdapter
from .shared import aligned_batches, check_injectable

__all__ = ["ENGINES", "FakeAdapter", "FragmentSpec", "Generation", "KVAdapter", "aligned_batches",
           "check_injectable", "open_adapter"]

ENGINES = ("llamacpp", "torch", "onnx")


def open_adapter(engine: str, model: object = None, *, n_ctx: int = 2048,
                 n_threads: int | None = None, memo_dir: object = None,
                 **kwargs: object) -> KVAdapter:
    """The adapter for `engine` (llamacpp, torch or onnx), each imported only when asked for."""
    from ..errors import ConfigError

    if engine == "llamacpp":
        from .llamacpp import LlamaCppAdapter

        return LlamaCppAdapter(model, n_ctx=n_ctx, n_threads=n_threads, memo_dir=memo_dir,  # type: ignore[arg-type]
                               **kwargs)
    if engine == "torch":
        from .torch import TorchAdapter

        return TorchAdapter(model, n_ctx=n_ctx, n_threads=n_threads, memo_dir=memo_dir)  # type: ignore[arg-type]
    if engine == "onnx":
        from .onnx import OnnxAdapter

        return OnnxAdapter(model, n_ctx=n_ctx, n_threads=n_threads, memo_dir=memo_dir)  # type: ignore[arg-type]
    raise ConfigError(f"engine {engine!r} is not available here: use one of {ENGINES} "
                      "(MLC-LLM has no package in the reachable registries)")
