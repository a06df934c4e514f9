"""Engine adapters behind the `KVAdapter` protocol (heavy engines import lazily)."""

from __future__ import annotations

# EdgeKV's batch-invariant kernels are switched on by the llama.cpp adapter when it opens a
# model (patch 0008's run-time setter, engines/llamacpp.py), not through the environment: the
# order of imports does not matter, and child processes (a benchmark's peers) keep the stock
# kernels.
from .base import FragmentSpec, Generation, KVAdapter
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
