"""The context rule, in one place: what fits a model's context window. The library's
`prepare`, passage placement and the server's checks before queueing all ask `fit`, so a
refusal reads the same wherever it is made, and carries OpenAI's code (`PromptError`)."""

from __future__ import annotations

from .errors import PromptError

__all__ = ["fit"]


def fit(n_ctx: int, n_tokens: int | None, max_tokens: int | None, *, held: int = 0,
        param: str = "prompt", limit_param: str = "max_tokens") -> int | None:
    """The context rule, written once: a prompt of `n_tokens` placed after `held` tokens (the
    passages of passage reuse) and `max_tokens` more must fit the context window (`n_ctx`).
    Returns the max_tokens to use: `max_tokens`, or with None (vLLM's default) the room left
    to the end of the window. `n_tokens` None: the prompt is not known yet, and only a
    `max_tokens` that no prompt could satisfy is refused (a server checks it before queueing).

    Every refusal is a `PromptError` carrying OpenAI's code and the field at fault:
    `invalid_value` (a negative or impossible `max_tokens`, an empty prompt),
    `context_length_exceeded` (the prompt does not fit; `param` is the documents where they
    are the larger part)."""
    if max_tokens is not None and max_tokens < 0:
        raise PromptError(f"{limit_param}={max_tokens} must be >= 0", "invalid_value",
                          limit_param)
    if n_tokens is None:
        if max_tokens is not None and max_tokens >= n_ctx:
            raise PromptError(f"{limit_param}={max_tokens} does not fit the context window "
                              f"({n_ctx} tokens, prompt included); ask for fewer tokens",
                              "invalid_value", limit_param)
        return max_tokens
    if n_tokens < 1:
        raise PromptError("the prompt is empty; give at least one token", "invalid_value",
                          param)
    room = n_ctx - held - n_tokens
    if room < 1 or (max_tokens is not None and max_tokens > room):
        docs = f" after the documents ({held} tokens)" if held else ""
        asked = f" + max_tokens ({max_tokens})" if max_tokens is not None else ""
        raise PromptError(
            f"the {param} ({n_tokens} tokens){docs}{asked} exceeds the context window "
            f"({n_ctx} tokens): shorten the {'documents or the ' if held else ''}prompt, ask "
            "for fewer tokens or raise --n-ctx", "context_length_exceeded",
            "documents" if held > n_tokens else param)
    return room if max_tokens is None else max_tokens
