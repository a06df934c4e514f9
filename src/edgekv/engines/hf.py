"""What the transformers-based adapters (torch, onnx) share: the GGUF's HF tokenizer and the
sequence bookkeeping around a head-major KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import Generation, sample_loop

__all__ = ["HFTokenizerAdapter"]


class HFTokenizerAdapter:
    _tok: Any
    _ids: list[int]
    _n_ctx: int

    @property
    def n_tokens(self) -> int:
        return len(self._ids)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def eos_token(self) -> int:
        return int(self._tok.eos_token_id)

    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(self._tok(text, add_special_tokens=False)["input_ids"])
        bos = self._tok.bos_token_id
        if add_bos and getattr(self._tok, "add_bos_token", False) and bos is not None:
            ids = [bos] + ids
        return ids

    def detokenize(self, tokens: Sequence[int]) -> str:
        return str(self._tok.decode(list(tokens), skip_special_tokens=True))

    def generate(self, logits: np.ndarray, max_tokens: int, *, temperature: float = 0.0,
                 seed: int = 0, keep_logits: bool = False) -> Generation:
        return sample_loop(self, logits, max_tokens, temperature=temperature, seed=seed,  # type: ignore[arg-type]
                           keep_logits=keep_logits)
