"""Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`) by a JSON convention.

Why a convention: SmolLM2's and Gemma 3's chat templates have no tool format (no `tools`
variable, no tool role), so there is nothing of the model's own to follow. The convention:

- The tools are described at the end of the system turn (one is opened if the request has
  none): one line per function, `{"name", "description", "parameters"}` as JSON, then how to
  call them: answer with only `{"tool_calls": [{"name": ..., "arguments": {...}}]}`.
- An assistant turn that called tools is rendered as that JSON (compact, arguments parsed);
  the results that follow (`role: tool`, with the `tool_call_id` of a call) become one user
  turn, `{"tool_results": [{"name": ..., "content": ...}]}`, in the order they were sent.
- `tool_choice` "required" or a named function: the answer is sampled under the grammar of
  that JSON (llama.cpp's, from a JSON schema whose items are the allowed functions, each
  `arguments` constrained by the function's own `parameters` schema), so it always parses,
  unless `max_tokens` cuts it ("length", and the text is returned as content). "auto": free
  sampling; a reply that is such JSON (naming only listed functions, arguments an object)
  becomes tool calls, anything else is text. "none": the tools are not described, and the
  answer is text.
- `parallel_tool_calls: false`: at most one call (the grammar's array holds one item; with
  "auto", calls after the first are dropped).

A call comes back as OpenAI's `message.tool_calls` (`call_...` ids, `type: function`,
arguments as JSON text) with finish_reason "tool_calls"; streamed, as `delta.tool_calls`
chunks, one per call with its whole arguments. With tools in play a streamed answer that may
be a call (its first character is `{`) is held back until it is known; text is streamed as
usual.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..engines.constraint import Grammar, json_schema_grammar
from ..errors import ConfigError
from .errors import APIError, bad_request
from .schemas import ChatRequest, Message, chat_messages

__all__ = ["ToolCallOut", "ToolPlan", "ToolReply", "chat_prompt", "plan_tools"]

_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolCallOut:
    """One parsed call, as the response carries it."""

    id: str
    name: str
    arguments: str  # JSON text

    def wire(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """The request's tools and what it lets the model do with them."""

    functions: tuple[tuple[str, str, dict[str, Any]], ...]  # name, description, parameters
    choice: str  # "auto", "required", or the one function's name
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def grammar(self) -> Grammar:
        """The grammar of a call's JSON, with the calls `choice` allows."""
        allowed = [f for f in self.functions if self.choice in ("auto", "required", f[0])]
        items = [{"type": "object", "properties": {"name": {"const": name},
                                                   "arguments": params},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, _, params in allowed]
        calls: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel or self.choice not in ("auto", "required"):
            calls["maxItems"] = 1
        return json_schema_grammar({"type": "object", "properties": {"tool_calls": calls},
                                    "required": ["tool_calls"], "additionalProperties": False})

    def system_text(self) -> str:
        lines = ["You can call functions. Each line below is one function: its name, what it "
                 "does, and the JSON Schema of its arguments."]
        lines += [json.dumps({"name": n, "description": d, "parameters": p}) if d else
                  json.dumps({"name": n, "parameters": p}) for n, d, p in self.functions]
        lines.append('To call functions, answer with only this JSON: {"tool_calls": [{"name": '
                     '"<function name>", "arguments": {<its arguments>}}]}'
                     + ("" if self.parallel else " with one call."))
        return "\n".join(lines)

    def parse(self, text: str) -> list[ToolCallOut] | None:
        """The calls `text` makes under the convention, or None if it is not one."""
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or set(obj) != {"tool_calls"}:
            return None
        raw = obj["tool_calls"]
        names = {n for n, _, _ in self.functions}
        if not isinstance(raw, list) or not raw:
            return None
        calls = []
        for c in raw:
            if (not isinstance(c, dict) or c.get("name") not in names
                    or not isinstance(c.get("arguments", {}), dict)):
                return None
            calls.append(ToolCallOut("call_" + secrets.token_hex(12), c["name"],
                                     json.dumps(c.get("arguments", {}), ensure_ascii=False)))
        return calls if self.parallel else calls[:1]


def plan_tools(req: ChatRequest) -> ToolPlan | None:
    """The request's tool plan (None: no tools, or tool_choice "none"); a 400 for tools that
    cannot be used: a duplicate name, parameters that are not a JSON schema the grammar
    converter takes, a tool_choice that names no tool or comes without tools."""
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice forces a tool call, but tools is empty; send the "
                              "tools, or omit tool_choice", param="tool_choice")
        return None
    if choice == "none":
        return None
    functions: list[tuple[str, str, dict[str, Any]]] = []
    for i, t in enumerate(tools):
        f = t.function
        if any(f.name == n for n, _, _ in functions):
            raise bad_request(f"tools[{i}]: the function name {f.name!r} is given twice; "
                              "names must be unique", param=f"tools.{i}.function.name")
        params = _NO_ARGUMENTS if f.parameters is None else f.parameters
        if params.get("type", "object") != "object":
            raise bad_request(f"tools[{i}] ({f.name}): parameters must be a JSON schema of "
                              f"type object (the arguments), not {params.get('type')!r}",
                              param=f"tools.{i}.function.parameters")
        try:
            json_schema_grammar(params)
        except ConfigError as e:
            raise APIError(400, f"tools[{i}] ({f.name}): parameters: {e}; send a JSON "
                           "schema of supported keywords", code="invalid_schema",
                           param=f"tools.{i}.function.parameters") from None
        functions.append((f.name, f.description or "", params))
    name: str
    if choice is None or isinstance(choice, str):
        name = choice or "auto"
    else:
        name = choice.function.name
        if all(name != n for n, _, _ in functions):
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools "
                              f"({', '.join(n for n, _, _ in functions)})",
                              param="tool_choice")
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    return ToolPlan(tuple(functions), name, parallel)


def chat_prompt(messages: Sequence[Message], plan: ToolPlan | None) -> list[dict[str, str]]:
    """The messages as the chat template takes them, the tool convention applied: tools in
    the system turn (if `plan`), earlier calls and their results as JSON turns."""
    names: dict[str, str] = {}  # call id -> function name, from the assistant turns seen
    out: list[dict[str, str]] = []
    results: list[dict[str, str]] = []

    def flush() -> None:
        if results:
            out.append({"role": "user", "content": json.dumps({"tool_results": results},
                                                              ensure_ascii=False)})
            results.clear()

    for i, m in enumerate(messages):
        if m.role == "tool":
            name = names.get(m.tool_call_id or "")
            if name is None:
                raise bad_request(f"messages[{i}] answers tool call {m.tool_call_id!r}, which "
                                  "no earlier assistant message made; send the assistant "
                                  "message with its tool_calls first",
                                  param=f"messages.{i}.tool_call_id")
            results.append({"name": name, "content": m.text()})
            continue
        flush()
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for c in m.tool_calls:
                names[c.id] = c.function.name
                calls.append({"name": c.function.name,
                              "arguments": _arguments(c.function.arguments, i)})
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            out.append({"role": "assistant", "content": (m.text() + "\n" + text).lstrip()})
            continue
        out.extend(chat_messages([m]))
    flush()
    if plan is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + plan.system_text()}
        else:
            out.insert(0, {"role": "system", "content": plan.system_text()})
    return out


class ToolReply:
    """Holds back a streamed answer that may be a tool call, until it is known."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._held: list[str] = []
        self._free = False  # known to be text: pieces pass straight through

    def push(self, piece: str) -> str:
        """The text to stream now ("" while the answer may still be a call)."""
        if self._free or not piece:
            return piece
        self._held.append(piece)
        head = "".join(self._held).lstrip()
        if self.plan.forced or not head or head.startswith("{"):
            return ""
        self._free = True
        out = "".join(self._held)
        self._held.clear()
        return out

    def finish(self, text: str) -> tuple[list[ToolCallOut] | None, str]:
        """The calls `text` (the whole answer) makes, and the held text left to send."""
        if self._free:
            return None, ""
        calls = self.plan.parse(text)
        return (calls, "") if calls else (None, "".join(self._held))


def _arguments(text: str, i: int) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise bad_request(f"messages[{i}]: a tool call's arguments are not JSON ({text[:40]!r}"
                          "); send them as the JSON text the call returned",
                          param=f"messages.{i}.tool_calls") from None
