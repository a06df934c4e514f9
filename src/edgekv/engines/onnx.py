"""ONNX Runtime adapter: the same weights exported once to ONNX with explicit KV inputs/outputs.

The graph takes `input_ids [1, t]`, `past_keys/past_values [layers, 1, heads, p, dim]` and
returns the last position's logits and `present_keys/present_values [layers, 1, heads, p+t,
dim]`. It is exported from the transformers model (GGUF de-quantized, eager attention) at
first use, with a progress message, and cached under the cache directory (outside git); after
that only onnxruntime and the tokenizer run. KV fragments convert through the same canonical
layout as the torch adapter (head-major, RoPE channel-pair permutation of K).
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

__all__ = ["OnnxAdapter", "export_onnx"]

# EdgeKV converts HF KV to its canonical layout by undoing the q/k permutation llama.cpp's
# GGUF converter applies to llama-family models only, and keeps every layer's KV whole:
# sliding-window models (Gemma 3: local layers in windowed caches, two RoPE bases) and
# unpermuted architectures would be converted wrongly, so they are refused
SUPPORTED_ARCHITECTURES = ("llama",)

log = logging.getLogger(__name__)


def export_onnx(model_path: Path, out: Path) -> dict[str, Any]:
    """Export the GGUF's model with explicit past/present KV; return its shape facts."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    log.warning("exporting %s to ONNX with KV inputs (once, ~40 s): %s", model_path.name, out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32,
            attn_implementation="eager").eval()
    cfg = model.config
    n_layer, n_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    class Step(torch.nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids: Any, past_keys: Any, past_values: Any) -> Any:
            cache = DynamicCache()
            for li in range(n_layer):
                cache.update(past_keys[li], past_values[li], li)
            p, t = past_keys.shape[3], input_ids.shape[1]
            pos = torch.arange(t, dtype=torch.long)[None] + p
            mask = torch.ones((1, p + t), dtype=torch.long)
            o = self.m(input_ids=input_ids, position_ids=pos, attention_mask=mask, cache=cache,
                       use_cache=True)
            return (o.logits[:, -1], torch.stack([cache.layers[i].keys for i in range(n_layer)]),
                    torch.stack([cache.layers[i].values for i in range(n_layer)]))

    ex = (torch.tensor([[1, 2, 3]]), torch.zeros(n_layer, 1, n_kv, 4, head_dim),
          torch.zeros(n_layer, 1, n_kv, 4, head_dim))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Step(model).eval(), ex, str(tmp), input_names=["input_ids", "past_keys", "past_values"],
            output_names=["logits", "present_keys", "present_values"],
            dynamic_axes={"input_ids": {1: "t"}, "past_keys": {3: "p"}, "past_values": {3: "p"},
                          "present_keys": {3: "pt"}, "present_values": {3: "pt"}},
            opset_version=17, dynamo=False)
    os.replace(tmp, out)
    rope = getattr(cfg, "rope_parameters", None) or {}
    return {"model_type": cfg.model_type, "n_layer": n_layer, "n_head_kv": n_kv,
            "head_dim": head_dim, "vocab_size": int(cfg.vocab_size),
            "rope_theta": rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))}


class OnnxAdapter(HFTokenizerAdapter, ModelFile):
    def __init__(self, model_path: str | Path | None = None, *, n_ctx: int = 2048,
                 n_threads: int | None = None, memo_dir: Path | None = None) -> None:
        self.model_path = resolve_model(model_path, memo_dir)
        require_architecture(self.model_path, "onnx", SUPPORTED_ARCHITECTURES,
                             "its KV layout (RoPE channel order, sliding-window caches) is "
                             "converted only for llama-family full-attention models")
        try:
            import onnxruntime as ort
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover
            raise EngineError("the onnx engine needs onnxruntime and transformers") from e
        import json

        sha = file_sha256(self.model_path, memo_dir)
        root = Path(memo_dir) if memo_dir else Path.home() / ".cache" / "edgekv"
        onnx_path = root / "models" / f"{sha[:16]}-kv.onnx"
        meta_path = onnx_path.with_suffix(".json")
        if not onnx_path.is_file() or not meta_path.is_file():
            meta_path.parent.mkdir(parents=True, exist_ok=True)
            meta_path.write_text(json.dumps(export_onnx(self.model_path, onnx_path)))
        meta = json.loads(meta_path.read_text())
        so = ort.SessionOptions()
        self.n_threads = so.intra_op_num_threads = n_threads or os.cpu_count() or 1
        so.log_severity_level = 3
        self._sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._tok = AutoTokenizer.from_pretrained(str(self.model_path.parent),
                                                      gguf_file=self.model_path.name)
        d = int(meta["head_dim"])
        self.fingerprint = ModelFingerprint(
            file_sha256=sha, architecture=meta["model_type"], n_layer=int(meta["n_layer"]),
            n_head_kv=int(meta["n_head_kv"]), head_dim_k=d, head_dim_v=d, kv_dtype="f32",
            engine=f"onnxruntime/{ort.__version__}",
            rope=f"base={float(meta['rope_theta']):g},dims={d}")
        self._n_ctx = n_ctx
        # the embedding's rows; an export made before they were recorded: the tokenizer's
        self.n_vocab = int(meta.get("vocab_size") or len(self._tok))
        self.counters = EngineCounters()
        self.weight_bytes = onnx_path.stat().st_size
        self.clear_kv_cache()

    def build_info(self) -> str:
        import onnxruntime as ort

        return (f"onnxruntime/{ort.__version__} threads={self.n_threads} "
                f"providers={self._sess.get_providers()}")

    def clear_kv_cache(self) -> None:
        fp = self.fingerprint
        self._ids: list[int] = []
        shape = (fp.n_layer, 1, fp.n_head_kv, 0, fp.head_dim_k)
        self._k = np.zeros(shape, np.float32)
        self._v = np.zeros(shape, np.float32)

    def prefill(self, tokens: Sequence[int], *, align: int) -> np.ndarray:
        check_prefill(self.n_tokens, len(tokens), self._n_ctx)
        toks, base = list(tokens), self.n_tokens
        logits = None
        for lo, hi in aligned_batches(base, len(toks), align):
            logits, self._k, self._v = self._sess.run(None, {
                "input_ids": np.array([toks[lo - base : hi - base]], np.int64),
                "past_keys": self._k, "past_values": self._v})
            self._ids.extend(toks[lo - base : hi - base])
            self.counters.add_batch(lo, hi)
        assert logits is not None
        return np.asarray(logits[0], np.float32).copy()

    def extract_fragments(self, specs: Sequence[FragmentSpec]) -> list[KVFragment]:
        def layer_kv(li: int, tok: slice) -> tuple[np.ndarray, np.ndarray]:
            return (from_head_major(self._k[li, 0, :, tok], is_key=True),
                    from_head_major(self._v[li, 0, :, tok], is_key=False))

        return build_fragments(specs, self.fingerprint, self._ids, layer_kv)

    def inject_fragments(self, fragments: Sequence[KVFragment], limit: int | None = None) -> int:
        n = injection_length(fragments, self.fingerprint, limit)
        if n > self._n_ctx:
            raise IncompatibleFragment(f"prefix of {n} tokens exceeds the context ({self._n_ctx})")
        k, v, ids = self._head_major(fragments, n)
        self._k, self._v, self._ids = k, v, ids
        return n

    def append_fragments(self, fragments: Sequence[KVFragment]) -> int:
        held = self.n_tokens
        end = append_length(fragments, self.fingerprint, held, self._n_ctx)
        k, v, ids = self._head_major(fragments, end, held)
        self._k = np.concatenate([self._k, k], axis=3)
        self._v = np.concatenate([self._v, v], axis=3)
        self._ids.extend(ids)
        return end

    def _head_major(self, fragments: Sequence[KVFragment], n: int,
                    start: int = 0) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Positions [start, n) of the fragments as the graph's past_keys/past_values
        [layers, 1, heads, tokens, dim], and their token ids."""
        fp = self.fingerprint
        keys, values, ids = stack_prefix(fragments, fp, n, start=start)
        layers = range(fp.n_layer)
        k = np.stack([to_head_major(keys[li], fp.n_head_kv, is_key=True) for li in layers])
        v = np.stack([to_head_major(values[li], fp.n_head_kv, is_key=False) for li in layers])
        return k[:, None], v[:, None], ids

    def close(self) -> None:
        self.clear_kv_cache()
