"""A GBNF grammar as a sampling constraint on llama.cpp, by llama.cpp's own grammar sampler.

`llama_sampler_init_grammar(vocab, grammar, root)` builds the grammar's state over the model's
vocabulary; `llama_sampler_apply` sets the logit of every token the grammar rejects here to
-inf; `llama_sampler_accept` advances the state by the token chosen. Only the masking is taken
from llama.cpp: the token is still drawn by EdgeKV's `sample_token`, from the raw logits of
the tokens that are left, so a constrained request samples as an unconstrained one does.

Control tokens other than end-of-sequence are always forbidden: llama.cpp's grammar matches a
token by its piece, and the piece of `<|im_start|>` is characters a JSON string admits, but
its text never reaches the answer (detokenizing drops control tokens). The model's other
end-of-generation tokens (`<|endoftext|>` beside `<|im_end|>`) would not end the loop, which
stops only at `eos_token`; once the grammar is complete, that token is the one way out.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import numpy as np

from ..errors import ConfigError, EngineError
from .constraint import Grammar

__all__ = ["LlamaGrammarConstraint", "blocked_tokens"]

# llama_token_data {int32 id; float logit; float p}: 12 bytes, no padding
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class LlamaGrammarConstraint:
    """One request's grammar state (`engines.constraint.Constraint`); freed with the object."""

    def __init__(self, lib: Any, model: Any, grammar: Grammar, *, n_vocab: int,
                 blocked: np.ndarray) -> None:
        """`blocked`: token ids never allowed (`blocked_tokens`)."""
        vocab = lib.llama_model_get_vocab(model)
        sampler = lib.llama_sampler_init_grammar(vocab, grammar.gbnf.encode("utf-8"),
                                                 grammar.root.encode("utf-8"))
        if not sampler:  # llama.cpp logged the parse error to stderr; say what it refuses
            raise ConfigError("llama.cpp refused the grammar (an undefined or left-recursive "
                              f"rule, or no rule {grammar.root!r}); check its GBNF")
        self._lib, self._sampler = lib, sampler
        self._free = weakref.finalize(self, lib.llama_sampler_free, sampler)
        self._cells = np.zeros(n_vocab, _TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._blocked = blocked

    def mask(self, logits: np.ndarray) -> np.ndarray:
        cells = self._cells
        cells["id"] = self._ids
        cells["logit"] = logits
        cells["p"] = 0.0
        arr = self._lib.llama_token_data_array(
            cells.ctypes.data_as(self._lib.llama_token_data_p), cells.size, -1, False)
        self._lib.llama_sampler_apply(self._sampler, ctypes.byref(arr))
        if arr.size != cells.size:  # the grammar sampler masks in place; anything else is new
            raise EngineError(f"llama.cpp's grammar sampler left {arr.size} of {cells.size} "
                              "candidates; this build's sampler is not supported")
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        out[cells["id"]] = cells["logit"]
        out[self._blocked] = -np.inf
        if not np.isfinite(out).any():
            raise EngineError("the grammar allows no token here (nothing continues the text "
                              "it has accepted, and end-of-sequence is not allowed yet)")
        return out

    def accept(self, token: int) -> None:
        self._lib.llama_sampler_accept(self._sampler, int(token))

    def close(self) -> None:
        self._free()


def blocked_tokens(lib: Any, model: Any, n_vocab: int, eos_token: int) -> np.ndarray:
    """The control and end-of-generation tokens other than `eos_token` (see the module doc);
    a walk over the vocabulary, done once per adapter."""
    vocab = lib.llama_model_get_vocab(model)
    control = lib.LLAMA_TOKEN_ATTR_CONTROL
    return np.array([i for i in range(n_vocab) if i != eos_token and (
        lib.llama_vocab_is_eog(vocab, i) or lib.llama_vocab_get_attr(vocab, i) & control)],
        dtype=np.int64)
