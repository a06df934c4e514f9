"""A request's two halves: checking its prompt (HTTP side) and generating (worker thread).

Tokenizing happens when the request arrives, so a prompt that does not fit the context window
is refused at once (400) instead of after waiting behind other generations; it runs under its
own lock, beside the worker: llama.cpp's tokenizer only reads the vocabulary (llama-server
tokenizes in its HTTP threads too), and so do the fake and HF fast tokenizers. Everything else
that touches the engine runs on the one worker thread. Results go back as events: `Started`
when the job leaves the queue (a stream's 200 is sent then), `Delta` for each piece of text,
then `Finished` or an `APIError`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ..cache import EdgeKV
from ..chat import ChatTokenizer
from ..errors import EdgeKVError
from ..keys import SERVE_TENANTS
from .decode import IncrementalText
from .errors import APIError, bad_request, from_library_error
from .metrics import ServeMetrics
from .scheduler import Job

__all__ = ["Delta", "Finished", "GenRequest", "ServedModel", "Started"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenRequest:
    tokens: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    salt: str  # the tenant's cache chain (see app.tenant_salt)


@dataclass(frozen=True, slots=True)
class Started:
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Delta:
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    final = True  # the job's last event (see Job.next_event)
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class ServedModel:
    """The loaded EdgeKV and what the HTTP side needs to know about its model."""

    def __init__(self, kv: EdgeKV, model_id: str, *, use_cache: bool = True) -> None:
        self.kv, self.model_id, self.use_cache = kv, model_id, use_cache
        a = kv.adapter
        self.n_ctx = int(a.n_ctx)
        template = getattr(a, "chat_template", None)
        self.chat_template: str | None = template() if callable(template) else None
        # messages -> tokens, the template's markers alone as control tokens (chat.py)
        self.chat: ChatTokenizer | None = None
        self._no_chat = ("this model has no chat template; send a raw prompt to "
                         "/v1/completions instead")
        if self.chat_template:
            try:
                self.chat = ChatTokenizer(a, self.chat_template)
            except EdgeKVError as e:  # completions still work
                self._no_chat = f"{e}; send a raw prompt to /v1/completions instead"
        self.n_vocab = _vocab_size(a)
        self._tokenizing = threading.Lock()  # one tokenization at a time beside the worker

    def check_limit(self, max_tokens: int | None, param: str) -> None:
        """A `max_tokens` that no prompt could satisfy is refused before queueing."""
        if max_tokens is not None and max_tokens >= self.n_ctx:
            raise bad_request(f"{param}={max_tokens} does not fit the context window "
                              f"({self.n_ctx} tokens, prompt included); ask for fewer tokens",
                              param=param)

    def prepare(self, prompt: str | tuple[int, ...], limit: int | None,
                param: str = "prompt") -> tuple[tuple[int, ...], int]:
        """The prompt's token ids and the max_tokens to use (None: up to the end of the
        context window, vLLM's default); a prompt that cannot fit is a 400 here. A raw
        prompt's text may spell control tokens (it is the client's whole prompt)."""
        if isinstance(prompt, str):
            with self._tokenizing:
                tokens = tuple(self.kv.adapter.tokenize(prompt))
        else:
            tokens = prompt
            bad = [t for t in tokens if t < 0 or (self.n_vocab and t >= self.n_vocab)]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary "
                                  f"[0, {self.n_vocab}); send ids this model's tokenizer made",
                                  param="prompt")
        return self._fit(tokens, limit, param)

    def check_chat(self) -> ChatTokenizer:
        """The chat tokenizer, or a 400 for a model without a chat template."""
        if self.chat is None:
            raise bad_request(self._no_chat, param="messages")
        return self.chat

    def prepare_chat(self, messages: list[dict[str, str]],
                     limit: int | None) -> tuple[tuple[int, ...], int]:
        """`prepare` for chat messages: their text never becomes control tokens (a message
        that spells `<|im_start|>system` stays text); a template that refuses them is a 400."""
        chat = self.check_chat()
        try:
            with self._tokenizing:
                tokens = tuple(chat.tokens(messages))
        except EdgeKVError as e:
            raise bad_request(str(e), param="messages") from None
        return self._fit(tokens, limit, "messages")

    def _fit(self, tokens: tuple[int, ...], limit: int | None,
             param: str) -> tuple[tuple[int, ...], int]:
        if not tokens:
            raise bad_request("the prompt is empty; give at least one token", param="prompt")
        room = self.n_ctx - len(tokens)
        if room < 1 or (limit is not None and limit > room):
            asked = f" + max_tokens ({limit})" if limit is not None else ""
            raise APIError(400, f"this model's context window is {self.n_ctx} tokens; the "
                           f"prompt has {len(tokens)}{asked}. Shorten the prompt or ask for "
                           "fewer tokens", code="context_length_exceeded", param=param)
        return tokens, room if limit is None else limit

    def run(self, req: GenRequest, job: Job, metrics: ServeMetrics) -> None:
        """The job's work, on the worker thread."""
        if job.cancelled.is_set():
            return
        job.emit(Started(len(req.tokens)))
        text = IncrementalText(self.kv.adapter.detokenize, req.stop)

        def on_token(token: int) -> bool:
            if job.cancelled.is_set():
                return False
            piece = text.push(token)
            if piece:
                job.emit(Delta(piece))
            return not text.stopped

        t0 = time.perf_counter()
        try:
            r = self.kv.generate(list(req.tokens), max_tokens=req.max_tokens,
                                 temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                 on_token=on_token, salt=req.salt, namespace=SERVE_TENANTS,
                                 use_cache=self.use_cache)
        except EdgeKVError as e:  # its message goes to the client, not to the log
            log.warning("request %s refused by generate: %s", job.request_id, type(e).__name__)
            log.debug("request %s refused by generate", job.request_id, exc_info=e)
            job.emit(from_library_error(e))
            return
        rest = text.finish()
        if rest:
            job.emit(Delta(rest))
        done = time.perf_counter()
        metrics.observe(prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                        completion_tokens=len(r.tokens), ttft_s=t0 - job.arrived + r.ttft_s,
                        e2e_s=done - job.arrived, refused_injection=bool(r.rejections))
        job.emit(Finished(text=text.text, finish_reason="stop" if text.stopped else
                          r.finish_reason, prompt_tokens=r.prompt_tokens,
                          completion_tokens=len(r.tokens), cached_tokens=r.cached_tokens))


def _vocab_size(adapter: object) -> int | None:
    """The vocabulary size, where the adapter tells it (token-id prompts are checked then)."""
    for name in ("n_vocab", "vocab", "_n_vocab"):
        v = getattr(adapter, name, None)
        v = v() if callable(v) else v
        if isinstance(v, int) and v > 0:
            return v
    return None
