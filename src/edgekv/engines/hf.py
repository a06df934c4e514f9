"""What the transformers-based adapters (torch, onnx) share: the GGUF's HF tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .shared import SequenceAdapter

__all__ = ["HFTokenizerAdapter"]


class HFTokenizerAdapter(SequenceAdapter):
    _tok: Any

    @property
    def eos_token(self) -> int:
        return int(self._tok.eos_token_id)

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        ids = list(self._tok(text, add_special_tokens=False,
                             split_special_tokens=not special)["input_ids"])
        bos = self._tok.bos_token_id
        if add_bos and getattr(self._tok, "add_bos_token", False) and bos is not None:
            ids = [bos] + ids
        return ids

    def control_tokens(self) -> dict[str, int]:
        """The tokenizer's special added tokens (what `split_special_tokens` keeps text)."""
        return {str(t.content): int(i) for i, t in self._tok.added_tokens_decoder.items()
                if getattr(t, "special", False) and t.content}

    def chat_template(self) -> str | None:
        """The GGUF's chat template, as the tokenizer read it."""
        tpl = getattr(self._tok, "chat_template", None)
        return str(tpl) if tpl else None

    def detokenize(self, tokens: Sequence[int]) -> str:
        return str(self._tok.decode(list(tokens), skip_special_tokens=True))
