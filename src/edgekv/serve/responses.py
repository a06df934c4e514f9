"""OpenAI response objects and the server-sent-event stream that carries the chunks.

The shapes follow the OpenAI API reference: `chat.completion` / `chat.completion.chunk` and
`text_completion`, usage with `prompt_tokens_details.cached_tokens` (here: the prompt tokens
whose KV came from the fragment cache instead of being computed).

Beside `usage`, every response (and a stream's last chunks: the one with `finish_reason`, and
the usage chunk when `stream_options.include_usage` asks for one) carries EdgeKV's account of
what reuse did, `edgekv` (`edgekv_info`):

    {"cached_tokens": int,     # prompt tokens whose KV came from the cache (= usage's)
     "streamed_tokens": int,   # prompt tokens whose KV a fill step streamed in (KV server)
     "computed_tokens": int,   # prompt tokens computed here
     "tier": "exact" | "partial" | "miss" | null,  # the semantic router's; null: no router
     "approximate": bool,      # reused KV is not what a cold run computes (approximate
                               # match, or documents placed from the passage cache)
     "passages": null | {...}, # null without documents (or with the cache off); else the
                               # placement's report (passages.PassageReport.as_dict)
     "drafted_tokens": int,    # speculative decoding: drafted tokens verified (0: plain)
     "accepted_tokens": int}   # of them, those the answer took (each a decode step saved)

Non-streamed responses also carry the tier in the header `X-EdgeKV-Tier` (where there is a
router). A stream's headers leave before the tier is known (the router names it after the
answer in strict mode), so a stream has it in its final chunk only.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .generation import Finished
from .logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from .tools import ToolCallOut

__all__ = ["CompletionShape", "EventStream", "TIER_HEADER", "edgekv_info", "sse", "usage"]

DONE = b"data: [DONE]\n\n"
TIER_HEADER = "X-EdgeKV-Tier"


def usage(f: Finished) -> dict[str, Any]:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": f.cached_tokens}}


def edgekv_info(f: Finished) -> dict[str, Any]:
    """The response's `edgekv` object (see the module doc); its keys are a contract."""
    return dict(f.edgekv)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass(slots=True)
class CompletionShape:
    """The objects of one response, chat or text completion, sharing id, time and model."""

    chat: bool
    model: str
    fingerprint: str
    id: str = ""
    created: int = 0
    _offset: int = 0  # characters of text before the next completion logprobs (text_offset)

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def whole(self, f: Finished) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(f.logprobs),
                                  "finish_reason": f.finish_reason}
        if self.chat:
            msg: dict[str, Any] = {"role": "assistant",
                                   "content": None if f.tool_calls else f.text}
            if f.tool_calls:
                msg["tool_calls"] = [c.wire() for c in f.tool_calls]
            choice["message"] = msg
        else:
            choice["text"] = f.text
        return {**self._head(""), "choices": [choice], "usage": usage(f),
                "edgekv": edgekv_info(f)}

    def chunk(self, text: str | None = None, *, role: bool = False,
              finish_reason: str | None = None, with_usage: bool = False,
              logprobs: Sequence[TokenLogprob] | None = None,
              tool_calls: Sequence[ToolCallOut] = (),
              finished: Finished | None = None) -> dict[str, Any]:
        """One streamed chunk; `with_usage` adds `"usage": null` as OpenAI does once usage
        was asked for (the usage itself comes in `usage_chunk`). Tool calls go one per
        chunk (`delta.tool_calls[0].index` says which), each with its whole arguments.
        `finished`: the last chunk with a choice, which carries `edgekv`."""
        choice: dict[str, Any] = {"index": 0, "logprobs": self._logprobs(logprobs),
                                  "finish_reason": finish_reason}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [c.wire(i) for i, c in enumerate(tool_calls)]
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        out = {**self._head(".chunk"), "choices": [choice]}
        if with_usage:
            out["usage"] = None
        if finished is not None:
            out["edgekv"] = edgekv_info(finished)
        return out

    def usage_chunk(self, f: Finished) -> dict[str, Any]:
        return {**self._head(".chunk"), "choices": [], "usage": usage(f),
                "edgekv": edgekv_info(f)}

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(list(entries))
        start = self._offset
        self._offset += sum(len(e.token) for e in entries)
        return completion_logprobs(list(entries), start)

    def _head(self, suffix: str) -> dict[str, Any]:
        obj = ("chat.completion" + suffix) if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}


class EventStream(Response):
    """`text/event-stream` from an async iterator of ready `data:` frames.

    Unlike a plain StreamingResponse it owns no disconnect logic of its own: the iterator
    already races each event against the client's disconnect, and `on_close` (cancel the job)
    runs however the stream ends, so a client that goes away frees its place at once.
    """

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.status_code = 200
        self.background = None
        self._frames, self._on_close = frames, on_close
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for frame in self._frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client closed the connection mid-stream
            pass
        finally:
            self._on_close()
