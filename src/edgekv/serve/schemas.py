"""The request bodies of the OpenAI API, checked strictly.

Why strict: a field the server silently ignores is a field whose effect the client silently
loses. Unknown fields are refused (400). OpenAI fields that EdgeKV does not implement are
accepted only at the value that leaves greedy output unchanged (`frequency_penalty: 0`,
`functions: []`, ...; see `NEUTRAL`), and fields that never change the output (`user`,
`metadata`, `service_tier`) are accepted and ignored. Types are not coerced (`"max_tokens": "5"`
is a 400, as at OpenAI). Here the shapes are checked; what a schema or a tool list means
(does it convert to a grammar, does `tool_choice` name a tool) is checked in `structured.py`
and `tools.py`, still before the request is queued.

EdgeKV's own fields, beside vLLM's `cache_salt`:
- `documents` (chat and text completions): RAG documents, as vLLM passes them to chat
  templates: strings, or objects `{"text": ..., "title": optional}`. Each one is one passage
  (`Document.passage`: `"title\n\ntext\n\n"`, or `"text\n\n"` without a title), placed
  before the conversation (or the raw prompt), after the model's BOS; its KV is cached alone
  and reused wherever it sits (`--passage-reuse`, `passages.py`), so the answer is labelled
  approximate once a passage's KV is reused. `[]` is the same as no documents.
- `approximate: true`: reuse a cached prefix that differs in a few tokens (the seed's
  similarity injection); refused unless the server was started with `--approximate`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import APIError, bad_request

__all__ = [
    "ChatRequest", "CompletionRequest", "Document", "JSONObjectFormat", "JSONSchemaFormat",
    "Message", "NEUTRAL", "NamedToolChoice", "TextFormat", "Tool", "ToolCall", "chat_messages",
    "parse_request",
]

MAX_STOP = 16  # OpenAI allows 4; a few more cost nothing here (stop strings are scanned per token)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat (5 for completions; 20 costs nothing more here)
MAX_DOCUMENTS = 64  # passages per request: more is refused (the context holds no more anyway)

# field -> the values at which an unimplemented OpenAI option changes nothing
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "repetition_penalty": (None, 1),  # vLLM's name
    "logit_bias": (None, {}),
    "functions": (None, []), "function_call": (None, "none", "auto"),  # legacy: send tools
    "modalities": (None, ["text"]),
    "store": (None, False), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(_Strict):
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Strict):
    # "developer" is OpenAI's newer name for "system"; "tool" carries a tool's result
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only beside an assistant's tool_calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    refusal: str | None = None  # echoed back by clients that resend a whole message

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


class FunctionDef(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JSONSchemaSpec(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON object
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat,
                           Field(discriminator="type")]


class Document(_Strict):
    """A RAG document (vLLM's chat-template `documents` item): its text, optionally a title."""

    text: str
    title: str | None = None

    def passage(self) -> str:
        """The passage it becomes: the title, a blank line, the text, a blank line (which
        parts the passages, and the last one from the conversation)."""
        head = f"{self.title}\n\n" if self.title else ""
        return f"{head}{self.text}\n\n"


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
    # EdgeKV's extensions (see the module doc): RAG passages, approximate reuse
    documents: list[str | Document] | None = None
    approximate: bool | None = None
    # accepted and ignored: they never change what is generated
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # the JSON the answer must be (structured.py): chat's field, taken by completions too
    response_format: ResponseFormat | None = None
    # accepted at their neutral value only (see NEUTRAL)
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def passages(self) -> tuple[str, ...] | None:
        """The documents as passage texts (`Document.passage`); None without documents."""
        if not self.documents:
            return None
        return tuple(Document(text=d).passage() if isinstance(d, str) else d.passage()
                     for d in self.documents)


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    store: Any = None

    def limit(self) -> int | None:
        """`max_completion_tokens` (OpenAI's current name) or the older `max_tokens`."""
        a, b = self.max_completion_tokens, self.max_tokens
        if a is not None and b is not None and a != b:
            raise bad_request(f"max_completion_tokens={a} and max_tokens={b} disagree; send "
                              "only max_completion_tokens", param="max_completion_tokens")
        return a if a is not None else b

    def top_k(self) -> int | None:
        """How many alternatives each token's logprob entry lists; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    def limit(self) -> int | None:
        return self.max_tokens

    def top_k(self) -> int | None:
        return self.logprobs

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
    _check_documents(req.documents)
    if isinstance(req, ChatRequest):
        if not req.messages:
            raise bad_request("messages is empty; send at least one message",
                              param="messages")
        req.limit()
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true; send both",
                              param="top_logprobs")
        for i, m in enumerate(req.messages):
            _check_message(i, m)


def _check_documents(docs: list[str | Document] | None) -> None:
    if not docs:
        return
    if len(docs) > MAX_DOCUMENTS:
        raise APIError(400, f"{len(docs)} documents: at most {MAX_DOCUMENTS} per request; send "
                       "fewer (the ones retrieved first)", code="context_length_exceeded",
                       param="documents")
    for i, d in enumerate(docs):
        text = d if isinstance(d, str) else d.text
        if not text.strip():
            raise bad_request(f"documents[{i}] has no text; give each document its text or "
                              "leave it out", param=f"documents.{i}" + (
                                  "" if isinstance(d, str) else ".text"))


def _check_message(i: int, m: Message) -> None:
    """What each role may carry: tool_calls on an assistant turn, tool_call_id on a tool's."""
    param = f"messages.{i}"
    if m.tool_calls is not None and m.role != "assistant":
        raise bad_request(f"messages[{i}] ({m.role}) has tool_calls; only an assistant message "
                          "may carry them", param=param + ".tool_calls")
    if (m.tool_call_id is None) == (m.role == "tool"):
        raise bad_request(f"messages[{i}]: a tool message needs tool_call_id (the id of the "
                          "call it answers), and only a tool message may carry one",
                          param=param + ".tool_call_id")
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise bad_request(f"messages[{i}] ({m.role}) has no content; give its text",
                          param=param + ".content")


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
