"""PyTorch adapter over transformers: the same GGUF weights, de-quantized to f32.

KV lives in the model's `DynamicCache` (`[batch, heads, seq, dim]` per layer); fragments are
converted to and from the canonical layout (`layout.py`: head-major transpose plus the RoPE
channel-pair permutation of K). Prefill is chunk-aligned like every adapter's.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EngineError, IncompatibleFragment
from ..fragment import KVFragment
from ..keys import ModelFingerprint, file_sha256
from .base import EngineCounters, FragmentSpec, ModelFile
from .hf import HFTokenizerAdapter
from .layout import from_head_major, to_head_major
from .models import require_architecture, resolve_model
from .shared import (
    aligned_batches,
    append_length,
    build_fragments,
    check_prefill,
    injection_length,
    stack_prefix,
)

__all__ = ["TorchAdapter"]

# EdgeKV converts HF KV to its canonical layout by undoing the q/k permutation llama.cpp's
# GGUF converter applies to llama-family models only, and keeps every layer's KV whole:
# sliding-window models (Gemma 3: local layers in windowed caches, two RoPE bases) and
# unpermuted architectures would be converted wrongly, so they are refused
SUPPORTED_ARCHITECTURES = ("llama",)

log = logging.getLogger(__name__)


class TorchAdapter(HFTokenizerAdapter, ModelFile):
    def __init__(self, model_path: str | Path | None = None, *, n_ctx: int = 2048,
                 n_threads: int | None = None, memo_dir: Path | None = None) -> None:
        self.model_path = resolve_model(model_path, memo_dir)
        require_architecture(self.model_path, "torch", SUPPORTED_ARCHITECTURES,
                             "its KV layout (RoPE channel order, sliding-window caches) is "
                             "converted only for llama-family full-attention models")
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:  # pragma: no cover
            raise EngineError("the torch engine needs torch, transformers, gguf and accelerate: "
                              "`make setup` installs them") from e
        self._torch = torch
        self.n_threads = n_threads or os.cpu_count() or 1
        torch.set_num_threads(self.n_threads)
        d, name = str(self.model_path.parent), self.model_path.name
        log.warning("loading %s into PyTorch (de-quantizing the GGUF, ~20 s)", name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
            self._model = AutoModelForCausalLM.from_pretrained(
                d, gguf_file=name, dtype=torch.float32).eval()
        cfg = self._model.config
        self._n_ctx = n_ctx
        self.n_vocab = int(cfg.vocab_size)  # the embedding's rows
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        base = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        self.fingerprint = ModelFingerprint(
            file_sha256=file_sha256(self.model_path, memo_dir), architecture=cfg.model_type,
            n_layer=cfg.num_hidden_layers, n_head_kv=cfg.num_key_value_heads,
            head_dim_k=head_dim, head_dim_v=head_dim, kv_dtype="f32",
            engine=f"torch/{torch.__version__.split('+')[0]}",
            rope=f"base={float(base):g},dims={head_dim}")
        self.counters = EngineCounters()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self._model.parameters())
        self._ids: list[int] = []
        self._cache: Any = None
        import inspect

        # transformers renamed `past_key_values` to `cache`; use whichever this version has
        params = inspect.signature(self._model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def build_info(self) -> str:
        t = self._torch
        return (f"torch/{t.__version__} threads={self.n_threads} "
                f"cpu_capability={t.backends.cpu.get_cpu_capability()}")

    def clear_kv_cache(self) -> None:
        self._ids, self._cache = [], None

    def prefill(self, tokens: Sequence[int], *, align: int) -> np.ndarray:
        torch = self._torch
        check_prefill(self.n_tokens, len(tokens), self._n_ctx)
        from transformers import DynamicCache

        toks, base = list(tokens), self.n_tokens
        logits = None
        with torch.inference_mode():
            for lo, hi in aligned_batches(base, len(toks), align):
                if self._cache is None:
                    self._cache = DynamicCache()
                out = self._model(input_ids=torch.tensor([toks[lo - base : hi - base]]),
                                  use_cache=True, **{self._cache_kw: self._cache})
                self._cache = (getattr(out, "cache", None) or getattr(out, "past_key_values", None)
                               or self._cache)
                self._ids.extend(toks[lo - base : hi - base])
                self.counters.add_batch(lo, hi)
                logits = out.logits[0, -1]
        assert logits is not None
        return logits.float().numpy().copy()

    def extract_fragments(self, specs: Sequence[FragmentSpec]) -> list[KVFragment]:
        def layer_kv(li: int, tok: slice) -> tuple[np.ndarray, np.ndarray]:
            layer = self._cache.layers[li]
            return (from_head_major(layer.keys[0, :, tok].float().numpy(), is_key=True),
                    from_head_major(layer.values[0, :, tok].float().numpy(), is_key=False))

        return build_fragments(specs, self.fingerprint, self._ids, layer_kv, np.float32)

    def inject_fragments(self, fragments: Sequence[KVFragment], limit: int | None = None) -> int:
        from transformers import DynamicCache

        n = injection_length(fragments, self.fingerprint, limit)
        if n > self._n_ctx:
            raise IncompatibleFragment(f"prefix of {n} tokens exceeds the context ({self._n_ctx})")
        self._cache, self._ids = DynamicCache(), []
        self._update(fragments, n)
        return n

    def append_fragments(self, fragments: Sequence[KVFragment]) -> int:
        from transformers import DynamicCache

        held = self.n_tokens
        end = append_length(fragments, self.fingerprint, held, self._n_ctx)
        if self._cache is None:
            self._cache = DynamicCache()
        self._update(fragments, end, held)
        return end

    def _update(self, fragments: Sequence[KVFragment], n: int, start: int = 0) -> None:
        """Add positions [start, n) of the fragments to the cache (`DynamicCache.update`
        concatenates them after what each layer holds) and their token ids."""
        torch, fp = self._torch, self.fingerprint
        keys, values, ids = stack_prefix(fragments, fp, n, start=start)
        for li in range(fp.n_layer):
            k = torch.from_numpy(to_head_major(keys[li], fp.n_head_kv, is_key=True))[None]
            v = torch.from_numpy(to_head_major(values[li], fp.n_head_kv, is_key=False))[None]
            self._cache.update(k, v, li)
        self._ids.extend(ids)

    def close(self) -> None:
        self.clear_kv_cache()
