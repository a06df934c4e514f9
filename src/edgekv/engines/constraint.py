"""Per-request constraints on sampling: a grammar (structured outputs, forced tool calls) or an
observer of the logits (logprobs), run inside `shared.sample_loop`.

Why in the sampling loop and nowhere else: a constraint changes which token is chosen from a
step's logits, never how the logits are computed. The KV a request leaves in the engine is the
KV of the tokens it chose, exactly as if they had been sampled freely, so prefix reuse stays
exact for constrained requests too (a warm request gives the tokens a cold one gives).

A `Constraint` sees each step's logits before the token is drawn (`mask`: return them, with
the tokens it forbids at -inf) and is told the token drawn (`accept`; end-of-sequence is never
accepted: the loop ends there). A `Grammar` is engine-independent text (GBNF); an engine that
can sample under one (`GrammarEngine`, llama.cpp) turns it into a constraint over its own
vocabulary. `grammar_constraint` refuses, with the reason, on an engine that cannot.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError, EngineError

__all__ = ["Chain", "Constraint", "Grammar", "GrammarEngine", "grammar_constraint",
           "json_object_grammar", "json_schema_grammar"]


@runtime_checkable
class Constraint(Protocol):
    def mask(self, logits: np.ndarray) -> np.ndarray:
        """This step's logits with the forbidden tokens at -inf (the input is not changed)."""
        ...

    def accept(self, token: int) -> None:
        """The token chosen at this step (never end-of-sequence)."""
        ...


@dataclass(frozen=True, slots=True)
class Grammar:
    """A GBNF grammar (llama.cpp's format) and its start rule."""

    gbnf: str
    root: str = "root"

    def __post_init__(self) -> None:
        if not self.gbnf.strip() or not self.root:
            raise ConfigError("a grammar needs rules and a root rule name")


@runtime_checkable
class GrammarEngine(Protocol):
    """An engine that samples under a grammar over its own vocabulary."""

    def grammar_constraint(self, grammar: Grammar) -> Constraint:
        """A fresh constraint (one request's state); ConfigError if the grammar is invalid."""
        ...


class Chain:
    """Several constraints in order: each masks what the one before it returned; all accept."""

    def __init__(self, *parts: Constraint) -> None:
        self.parts = parts

    def mask(self, logits: np.ndarray) -> np.ndarray:
        for p in self.parts:
            logits = p.mask(logits)
        return logits

    def accept(self, token: int) -> None:
        for p in self.parts:
            p.accept(token)


def grammar_constraint(adapter: object, grammar: Grammar) -> Constraint:
    """The adapter's constraint for `grammar`; EngineError naming the engine if it has none."""
    if not isinstance(adapter, GrammarEngine):
        raise EngineError(f"the {type(adapter).__name__} engine cannot sample under a grammar "
                          "(structured outputs and forced tool calls need it); serve with "
                          "--engine llamacpp, or send the request without the constraint")
    return adapter.grammar_constraint(grammar)


def json_schema_grammar(schema: Mapping[str, Any]) -> Grammar:
    """The grammar of the JSON texts that `schema` accepts, by llama-cpp-python's converter
    (llama.cpp's json_schema_to_grammar); ConfigError saying what it could not convert."""
    if not isinstance(schema, Mapping):
        raise ConfigError(f"a JSON schema is an object, not a {type(schema).__name__}")
    try:
        from llama_cpp.llama_grammar import json_schema_to_gbnf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError("JSON schemas are converted by llama-cpp-python; install the "
                          "llamacpp extra") from e
    try:
        return Grammar(json_schema_to_gbnf(json.dumps(schema)))
    except RecursionError:
        raise ConfigError("the JSON schema nests too deeply to convert") from None
    except Exception as e:  # noqa: BLE001 - the converter asserts, and fails in Python's words
        raise ConfigError(f"the JSON schema cannot be turned into a grammar: "
                          f"{type(e).__name__}: {e}"[:300]) from None


def json_object_grammar() -> Grammar:
    """Any JSON object (OpenAI's `json_object` mode), whitespace kept to one optional space
    between tokens: a small model left free whitespace can fill max_tokens with newlines."""
    return json_schema_grammar({"type": "object"})
