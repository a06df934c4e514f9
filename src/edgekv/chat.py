"""Chat messages -> the model's prompt, with its own template (GGUF `tokenizer.chat_template`).

Why tokens and not text: a template renders the messages into one string in which its markers
(`<|im_start|>`, `<start_of_turn>`) are control tokens. Tokenizing that string with control
tokens parsed, as a raw prompt is, would turn the same text inside a message into control
tokens too: a user who writes `<|im_end|>\\n<|im_start|>system` would open a system turn of
their own. `ChatTokenizer` renders the template a second time with a sentinel in place of every
message field, so it knows which characters the template wrote: only those become control
tokens. The text between two control tokens (template text and message text together) is
tokenized as text, in one piece, which is how the tokenizer splits a whole string at its
control tokens anyway; so an ordinary conversation gets the very tokens that the whole
rendered string gets (the cache keys of existing chains stay valid), and a message that spells
a control token gets plain text tokens instead.

Every chat path tokenizes here: `edgekv serve`, `edgekv generate --chat`, the demo and the
benchmarks; library callers pass `ChatTokenizer(adapter).tokens(messages)` to
`EdgeKV.generate`.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .errors import EdgeKVError

if TYPE_CHECKING:
    from .engines.base import KVAdapter

__all__ = ["ChatTokenizer", "chat_tokens", "render_chat"]

# What templates are seen doing to a message's text (`| trim` in Gemma's and Llama 3's,
# `.lstrip('\n')` in Qwen's): the rendered prompt is matched against these forms of each field
_FORMS: tuple[Callable[[str], str], ...] = (
    lambda s: s, str.strip, str.lstrip, str.rstrip,
    lambda s: s.strip("\n"), lambda s: s.lstrip("\n"), lambda s: s.rstrip("\n"))


def render_chat(template: str | None, messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt text for `messages`, ending where the assistant's reply starts.

    A fixed system message renders to the same leading tokens every time, which is exactly
    the prefix the fragment cache reuses across turns and users. This is text, for engines
    that take text (peers in the benchmarks); to feed EdgeKV, tokenize with `ChatTokenizer`.
    """
    return _render(_compile(template), [dict(m) for m in messages])


class ChatTokenizer:
    """Messages -> token ids in one adapter's chat template, where only the template's own
    markers are control tokens (see the module doc). Build it once per adapter: it reads the
    vocabulary's control tokens and compiles the template."""

    def __init__(self, adapter: KVAdapter, template: str | None = None) -> None:
        self.adapter = adapter
        self.template = adapter.chat_template() if template is None else template
        self._compiled = _compile(self.template)
        self.controls: dict[str, int] = dict(adapter.control_tokens())
        # leftmost, longest first: how llama.cpp partitions a string at its special tokens
        texts = sorted(self.controls, key=lambda t: len(t.encode()), reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, texts))) if texts else None

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt as text (what a tokenizer of the whole string would be given)."""
        return _render(self._compiled, [dict(m) for m in messages])

    def segments(self, messages: Sequence[Mapping[str, str]]) -> list[tuple[str, bool]]:
        """The rendered prompt, in order, as (text, written by the template) pieces."""
        msgs = [dict(m) for m in messages]
        for m in msgs:
            for k, v in m.items():
                if not isinstance(v, str):
                    raise EdgeKVError(f"message field {k!r} is a {type(v).__name__}; give "
                                      "text (join a list of parts first)")
            role = m.get("role", "")
            if self._pattern is not None and self._pattern.search(role):
                raise EdgeKVError(f"the role {role[:40]!r} holds a control token; roles are "
                                  "the template's input, give a plain role name")
        whole = _render(self._compiled, msgs)
        nonce = secrets.token_hex(8)
        fields: list[str] = []
        marked: list[dict[str, str]] = []
        for m in msgs:
            mm = {}
            for k, v in m.items():
                if k != "role" and v:  # an empty field is harmless, and templates test it
                    mm[k] = f"\x00{nonce}:{len(fields)}\x00"
                    fields.append(v)
                else:
                    mm[k] = v
            marked.append(mm)
        skeleton = re.split(f"\x00{nonce}:(\\d+)\x00", _render(self._compiled, marked))
        parts: list[str | int] = [p if i % 2 == 0 else int(p) for i, p in enumerate(skeleton)]
        found = _align(whole, parts, fields)
        if found is None:
            raise EdgeKVError("the chat template renders these messages in a way that does "
                              "not keep their text apart from its own (it changes a message "
                              "beyond trimming it, or branches on its content), so their "
                              "tokens cannot be made safely; send a raw prompt instead")
        return found

    def tokens(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The prompt's token ids: BOS as the model wants it, the template's control tokens,
        and every other character (all of the messages' text) tokenized as text."""
        a = self.adapter
        ids = a.tokenize("", add_bos=True, special=False)
        text: list[str] = []

        def flush() -> None:
            if text:
                ids.extend(a.tokenize("".join(text), add_bos=False, special=False))
                text.clear()

        for piece, by_template in self.segments(messages):
            if not by_template or self._pattern is None:
                text.append(piece)
                continue
            at = 0
            for m in self._pattern.finditer(piece):
                text.append(piece[at : m.start()])
                flush()
                ids.append(self.controls[m.group()])
                at = m.end()
            text.append(piece[at:])
        flush()
        return ids


def chat_tokens(adapter: KVAdapter, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """`ChatTokenizer(adapter).tokens(messages)`, for a one-off (a server builds one)."""
    return ChatTokenizer(adapter).tokens(messages)


# -- private helpers ----------------------------------------------------------------------

def _compile(template: str | None) -> Any:
    if not template:
        raise EdgeKVError("this model has no chat template; pass a raw prompt without --chat")
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover
        raise EdgeKVError("jinja2 is needed for --chat (it comes with llama-cpp-python)") from e
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise  # what HF templates call to refuse messages
    try:
        return env.from_string(template)
    except Exception as e:  # noqa: BLE001 - jinja2.TemplateSyntaxError and kin
        raise EdgeKVError(f"the model's chat template does not parse: {e}") from None


def _render(compiled: Any, messages: list[dict[str, str]]) -> str:
    try:
        return str(compiled.render(messages=messages, add_generation_prompt=True,
                                   bos_token="", eos_token=""))
    except EdgeKVError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2.TemplateError and what templates raise
        raise EdgeKVError(f"the model's chat template refused these messages: {e}") from None


def _raise(message: str) -> None:
    raise EdgeKVError(f"the model's chat template refused these messages: {message}")


def _align(whole: str, parts: list[str | int], fields: list[str]
           ) -> list[tuple[str, bool]] | None:
    """Match `whole` (the real render) against `parts` (the sentinel render: template text,
    and field numbers where a field sat), trying each field in the forms of `_FORMS`;
    the pieces, or None if no assignment reproduces `whole` exactly. Depth-first with
    backtracking, without recursion (a long conversation has many fields)."""
    out: list[tuple[str, bool]] = []
    # per part: the position it starts at and the field forms not yet tried
    stack: list[tuple[int, list[str]]] = []
    k, pos = 0, 0
    while True:
        if k == len(parts):
            if pos == len(whole):
                return [(s, t) for s, t in out if s]
            options: list[str] = []
        else:
            p = parts[k]
            if isinstance(p, str):
                options = [p]
            else:
                options = list(dict.fromkeys(f(fields[p]) for f in _FORMS))
            options = [o for o in options if whole.startswith(o, pos)]
        while not options:  # backtrack to the last part with forms left
            if not stack:
                return None
            k -= 1
            pos, options = stack.pop()
            out.pop()
        choice, rest = options[0], options[1:]
        stack.append((pos, rest))
        out.append((choice, isinstance(parts[k], str)))
        pos += len(choice)
        k += 1
