"""Render chat messages with the model's own template (GGUF `tokenizer.chat_template`)."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import EdgeKVError

__all__ = ["render_chat"]


def render_chat(template: str | None, messages: Sequence[dict[str, str]]) -> str:
    """The prompt text for `messages`, ending where the assistant's reply starts.

    A fixed system message renders to the same leading tokens every time, which is exactly
    the prefix the fragment cache reuses across turns and users.
    """
    if not template:
        raise EdgeKVError("this model has no chat template; pass a raw prompt without --chat")
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover
        raise EdgeKVError("jinja2 is needed for --chat (it comes with llama-cpp-python)") from e
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=list(messages), add_generation_prompt=True, bos_token="", eos_token="")
