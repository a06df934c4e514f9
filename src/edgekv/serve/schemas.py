"""The request bodies of the OpenAI API, checked strictly.

Why strict: a field the server silently ignores is a field whose effect the client silently
loses. Unknown fields are refused (400). OpenAI fields that EdgeKV does not implement are
accepted only at the value that leaves greedy output unchanged (`frequency_penalty: 0`,
`logprobs: false`, `tools: []`, ...; see `NEUTRAL`), and fields that never change the output
(`user`, `metadata`, `service_tier`, `parallel_tool_calls`) are accepted and ignored. Types are
not coerced (`"max_tokens": "5"` is a 400, as at OpenAI).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import APIError, bad_request

__all__ = [
    "ChatRequest", "CompletionRequest", "Message", "NEUTRAL", "chat_messages", "parse_request",
]

MAX_STOP = 16  # OpenAI allows 4; a few more cost nothing here (stop strings are scanned per token)

# field -> the values at which an unimplemented OpenAI option changes nothing
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "repetition_penalty": (None, 1),  # vLLM's name
    "logit_bias": (None, {}), "logprobs": (None, False), "top_logprobs": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
    "store": (None, False), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    # "developer" is OpenAI's newer name for "system"; tool turns need tool calling (absent)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str = "default"
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; send 0 for greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=512)  # vLLM's tenant salt
    # accepted and ignored: they never change what is generated
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # accepted at their neutral value only (see NEUTRAL)
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=0)
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    store: Any = None

    def limit(self) -> int | None:
        """`max_completion_tokens` (OpenAI's current name) or the older `max_tokens`."""
        a, b = self.max_completion_tokens, self.max_tokens
        if a is not None and b is not None and a != b:
            raise bad_request(f"max_completion_tokens={a} and max_tokens={b} disagree; send "
                              "only max_completion_tokens", param="max_completion_tokens")
        return a if a is not None else b


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    def limit(self) -> int | None:
        return self.max_tokens

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids (a batch of one is unwrapped)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request(f"{len(p)} prompts in one request; send one prompt per "
                                  "request (batches are not supported)", param="prompt")
            p = p[0]
        if len(p) == 0:
            raise bad_request("the prompt is empty; give at least one character or token",
                              param="prompt")
        return p  # type: ignore[return-value]


R = TypeVar("R", ChatRequest, CompletionRequest)


def parse_request(body: bytes, kind: type[R]) -> R:
    """Validate a raw JSON body; every problem becomes a 400 that names the field."""
    try:
        req = kind.model_validate_json(body)
    except ValidationError as e:
        raise _describe(e) from None
    _check(req)
    return req


def chat_messages(messages: list[Message]) -> list[dict[str, str]]:
    """The messages as a chat template takes them (`developer` is `system`, parts joined);
    tokenized by `chat.ChatTokenizer`, where their text stays text."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
             **({"name": m.name} if m.name else {})} for m in messages]


# -- private helpers ----------------------------------------------------------------------

def _check(req: ChatRequest | CompletionRequest) -> None:
    for name, allowed in NEUTRAL.items():
        if name in type(req).model_fields and not _neutral(getattr(req, name), allowed):
            shown = ", ".join(repr(v) for v in allowed if v is not None)
            raise APIError(400, f"{name}={getattr(req, name)!r} is not supported by edgekv "
                           f"serve (it would change the output); omit it or send {shown}",
                           code="unsupported_parameter", param=name)
    if req.n != 1:
        raise bad_request(f"n={req.n}: one choice per request is supported; send n=1 and "
                          "repeat the request for more", param="n")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true",
                          param="stream_options")
    stops = req.stops()
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise bad_request(f"stop: give at most {MAX_STOP} non-empty strings", param="stop")
    if isinstance(req, ChatRequest):
        if not req.messages:
            raise bad_request("messages is empty; send at least one message",
                              param="messages")
        req.limit()


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    """`value` equals an allowed value of the same kind (0 and 0.0 alike, but not False)."""
    for a in allowed:
        if a is None or value is None:
            if a is value:
                return True
        elif isinstance(a, bool) or isinstance(value, bool):
            if type(a) is type(value) and a == value:
                return True
        elif isinstance(a, (int, float)) and isinstance(value, (int, float)):
            if a == value:
                return True
        elif type(a) is type(value) and a == value:
            return True
    return False


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _describe(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    # of a union's alternatives, the one that got furthest says most ("content.0.type")
    err = max(errors, key=lambda x: len(x["loc"]))
    kind, msg = err["type"], err["msg"]
    if kind == "json_invalid":
        return APIError(400, f"the body is not valid JSON ({err.get('ctx', {}).get('error', msg)})"
                        "; send a JSON object", code="invalid_json")
    path = [p for p in err["loc"] if isinstance(p, int) or (
        "[" not in str(p) and str(p).lower() not in _TYPE_TAGS and not str(p)[:1].isupper())]
    param = ".".join(str(p) for p in path) or None
    if not err["loc"] or kind in ("model_type", "model_attributes_type"):
        return APIError(400, "the body must be a JSON object with the request's fields",
                        code="invalid_type")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}: edgekv serve does not know it; remove "
                        "it (see the OpenAI API reference for the supported fields)",
                        code="unknown_field", param=param)
    if kind == "missing":
        return APIError(400, f"{param!r} is required", code="missing_field", param=param)
    code = "invalid_type" if kind.endswith("_type") or "parsing" in kind else "invalid_value"
    shown = repr(err.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return APIError(400, f"{param}: {msg} (got {shown})", code=code, param=param)
