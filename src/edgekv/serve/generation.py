"""A request's two halves: checking its prompt (HTTP side) and generating (worker thread).

Tokenizing happens when the request arrives, so a prompt that does not fit the context window
is refused at once (400) instead of after waiting behind other generations; it runs under its
own lock, beside the worker: llama.cpp's tokenizer only reads the vocabulary (llama-server
tokenizes in its HTTP threads too), and so do the fake and HF fast tokenizers. Everything else
that touches the engine runs on a worker thread (one, or one per slot with `--parallel`).
Results go back as events: `Started`
when the job leaves the queue (a stream's 200 is sent then), `Delta` for each piece of text,
then `Finished` or an `APIError`.

Documents (`passages`) are tokenized on arrival too, to refuse what cannot fit; they are placed
before the question after the model's BOS, which the question (a chat's tokens start with it)
then does not repeat.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..chat import ChatTokenizer
from ..core.pipeline import EdgeKV
from ..core.request import GenerationResult, Request, Sampling
from ..engines.base import KVAdapter
from ..engines.constraint import Chain, Constraint, Grammar, grammar_constraint
from ..errors import Cancelled, EdgeKVError, EngineError, PromptError
from ..keys import KV_SERVER_TENANTS, SERVE_TENANTS
from ..limits import fit
from .decode import IncrementalText
from .errors import APIError, bad_request, from_library_error
from .logprobs import LogprobRecorder, TokenLogprob
from .metrics import ServeMetrics
from .scheduler import FinalEvent, Job
from .tools import ToolCallOut, ToolPlan, ToolReply

__all__ = ["Delta", "Finished", "GenRequest", "ServedModel", "Started"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One request as the server runs it: the library's `Request` (`EdgeKV.prepare` made it
    on arrival, `ServedModel.prepared`: tokens, chain keys, sampling, passages laid out; the
    worker hands it to `generate` as it is, nothing is tokenized, validated or keyed twice),
    and what only the server does with the answer."""

    request: Request
    prompt_tokens: int  # the tokens the client sent (without the documents placed before)
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None  # a grammar's state (structured output, forced call)
    top_logprobs: int | None = None  # None: no logprobs; else alternatives per token
    tools: ToolPlan | None = None  # the answer may be tool calls (tools.py)


@dataclass(frozen=True, slots=True)
class Started:
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens since the last Delta


@dataclass(frozen=True, slots=True)
class Finished(FinalEvent):  # the job's last event (see Job.next_event)
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None  # every token's, when asked for
    tool_calls: tuple[ToolCallOut, ...] = ()
    sent_logprobs: int = 0  # how many of `logprobs` the Deltas carried
    # what reuse and decoding did: the response's `edgekv` object, built once by
    # `GenerationResult.summary` (its keys are a contract)
    edgekv: dict[str, Any] = field(default_factory=dict)

    @property
    def tier(self) -> str | None:
        """The semantic router's exact / partial / miss; None: no router."""
        return self.edgekv.get("tier")


class ServedModel:
    """The loaded EdgeKV and what the HTTP side needs to know about its model."""

    def __init__(self, kv: EdgeKV, model_id: str, *, use_cache: bool = True,
                 kv_tenant: str | None = None, sequences: Sequence[KVAdapter] = ()) -> None:
        """`kv_tenant` (with --kv-server): the KV-server tenant whose chain the untenanted
        requests (no API key, no cache_salt) are keyed in, so that they stream its chunks.
        `sequences`: the engine slots of `--parallel` (`parallel.open_slots`); worker i
        generates on slot i. Empty: one worker, on the EdgeKV's own adapter."""
        self.kv, self.model_id, self.use_cache = kv, model_id, use_cache
        self.sequences = tuple(sequences)
        self.kv_tenant = kv_tenant
        a = kv.adapter
        self.n_ctx = int(a.n_ctx)
        self.chat_template: str | None = a.chat_template()
        # messages -> tokens, the template's markers alone as control tokens (chat.py)
        self.chat: ChatTokenizer | None = None
        self._no_chat = ("this model has no chat template; send a raw prompt to "
                         "/v1/completions instead")
        if self.chat_template:
            try:
                self.chat = ChatTokenizer(a, self.chat_template)
            except EdgeKVError as e:  # completions still work
                self._no_chat = f"{e}; send a raw prompt to /v1/completions instead"
        self.n_vocab = a.n_vocab  # token-id prompts are checked against it
        self.anchor = tuple(a.tokenize("", add_bos=True))  # what passages are placed after
        self._tokenizing = threading.Lock()  # one tokenization at a time beside the worker

    def check_limit(self, max_tokens: int | None, param: str) -> None:
        """A `max_tokens` that no prompt could satisfy is refused before queueing."""
        try:
            fit(self.n_ctx, None, max_tokens, limit_param=param)
        except PromptError as e:
            raise from_library_error(e) from None

    def prepare(self, prompt: str | tuple[int, ...], limit: int | None,
                param: str = "prompt", passages: tuple[str, ...] | None = None
                ) -> tuple[tuple[int, ...], int]:
        """The prompt's token ids and the max_tokens to use (None: up to the end of the
        context window, vLLM's default); a prompt that cannot fit (with `passages` before
        it) is a 400 here. A raw prompt's text may spell control tokens (it is the client's
        whole prompt)."""
        if isinstance(prompt, str):
            with self._tokenizing:
                tokens = tuple(self.kv.adapter.tokenize(prompt))
        else:
            tokens = prompt
            bad = [t for t in tokens if t < 0 or t >= self.n_vocab]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary "
                                  f"[0, {self.n_vocab}); send ids this model's tokenizer made",
                                  param="prompt")
        return self._fit(tokens, limit, param, passages)

    def check_chat(self) -> ChatTokenizer:
        """The chat tokenizer, or a 400 for a model without a chat template."""
        if self.chat is None:
            raise bad_request(self._no_chat, param="messages")
        return self.chat

    def prepare_chat(self, messages: list[dict[str, str]], limit: int | None,
                     passages: tuple[str, ...] | None = None) -> tuple[tuple[int, ...], int]:
        """`prepare` for chat messages: their text never becomes control tokens (a message
        that spells `<|im_start|>system` stays text); a template that refuses them is a 400."""
        chat = self.check_chat()
        try:
            with self._tokenizing:
                tokens = tuple(chat.tokens(messages))
        except EdgeKVError as e:
            raise bad_request(str(e), param="messages") from None
        return self._fit(tokens, limit, "messages", passages)

    def _fit(self, tokens: tuple[int, ...], limit: int | None, param: str,
             passages: tuple[str, ...] | None = None) -> tuple[tuple[int, ...], int]:
        """`tokens` and max_tokens, or a 400. With `passages`, the tokens returned are the
        question's without the BOS the passages are placed after (`anchor`)."""
        docs = 0
        if passages is not None:
            if self.anchor and tokens[: len(self.anchor)] == self.anchor:
                tokens = tokens[len(self.anchor):]
            with self._tokenizing:  # as passages.PassageReuse.layout tokenizes them
                docs = len(self.anchor) + sum(
                    len(self.kv.adapter.tokenize(p, add_bos=False, special=False))
                    for p in passages)
        try:
            room = fit(self.n_ctx, len(tokens), limit, held=docs, param=param)
        except PromptError as e:
            raise from_library_error(e) from None
        assert room is not None
        return tokens, room

    def constraint(self, grammar: Grammar | None, param: str) -> Constraint | None:
        """The request's grammar state over this model's vocabulary (built on arrival, so a
        grammar the engine refuses, or an engine without grammars, is a 400 at once)."""
        if grammar is None:
            return None
        try:
            with self._tokenizing:  # grammar init reads the vocabulary, as tokenizing does
                return grammar_constraint(self.kv.adapter, grammar)
        except EdgeKVError as e:
            raise APIError(400, str(e), code="unsupported_parameter" if isinstance(
                e, EngineError) else "invalid_schema", param=param) from None

    def prepared(self, tokens: tuple[int, ...], sampling: Sampling, *, salt: str,
                 approximate: bool, passages: tuple[str, ...] | None,
                 **serving: Any) -> GenRequest:
        """The library's `Request` for `tokens` (`EdgeKV.prepare`: chain keys in the tenant's
        chain, passages laid out), built on arrival beside the worker, in a `GenRequest` with
        `serving` (stop, constraint, top_logprobs, tools); a refusal is a 400."""
        namespace = SERVE_TENANTS
        if not salt and self.kv_tenant:  # the device's own requests: its KV-server chain
            salt, namespace = self.kv_tenant, KV_SERVER_TENANTS
        try:
            with self._tokenizing:
                request = self.kv.prepare(
                    list(tokens), max_tokens=sampling.max_tokens,
                    temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                    salt=salt, namespace=namespace, use_cache=self.use_cache,
                    approximate=approximate,
                    passages=None if passages is None else list(passages))
        except EdgeKVError as e:
            raise from_library_error(e) from None
        return GenRequest(request, len(tokens), **serving)

    def run(self, req: GenRequest, job: Job, metrics: ServeMetrics) -> None:
        """The job's work, on the worker thread."""
        if job.cancelled.is_set():
            return
        job.emit(Started(req.prompt_tokens))
        text = IncrementalText(self.kv.adapter.detokenize, req.stop)
        reply = ToolReply(req.tools) if req.tools is not None else None
        recorder = (LogprobRecorder(req.top_logprobs, self._piece)
                    if req.top_logprobs is not None else None)
        parts = [p for p in (recorder, req.constraint) if p is not None]
        constraint = None if not parts else parts[0] if len(parts) == 1 else Chain(*parts)
        sent = 0  # logprob entries handed out with Deltas

        def emit(piece: str) -> None:
            nonlocal sent
            if reply is not None:
                piece = reply.push(piece)
            if piece:
                lps = () if recorder is None else tuple(recorder.entries[sent:])
                sent += len(lps)
                job.emit(Delta(piece, lps))

        def on_token(token: int) -> bool:
            if job.cancelled.is_set():
                return False
            emit(text.push(token))
            return not text.stopped

        prepared = req.request
        t0 = time.perf_counter()
        try:
            r = self.kv.generate(replace(prepared, sampling=replace(prepared.sampling,
                                                                     constraint=constraint)),
                                 on_token=on_token, cancelled=job.cancelled,
                                 sequence=self.sequences[job.worker] if self.sequences else None)
        except Cancelled:  # the client went away while it waited: nobody to answer
            log.debug("request %s cancelled while it waited", job.request_id)
            return
        except EdgeKVError as e:  # its message goes to the client, not to the log
            log.warning("request %s refused by generate: %s", job.request_id, type(e).__name__)
            log.debug("request %s refused by generate", job.request_id, exc_info=e)
            job.emit(from_library_error(e))
            return
        emit(text.finish())
        calls, held = reply.finish(text.text) if reply is not None else (None, "")
        if held:  # an answer that looked like a call and was not: text after all
            lps = () if recorder is None else tuple(recorder.entries[sent:])
            sent += len(lps)
            job.emit(Delta(held, lps))
        self._observe(metrics, r, job, t0)
        reason = "tool_calls" if calls else "stop" if text.stopped else r.finish_reason
        job.emit(Finished(text="" if calls else text.text, finish_reason=reason,
                          prompt_tokens=r.prompt_tokens, completion_tokens=len(r.tokens),
                          cached_tokens=r.cached_tokens,
                          logprobs=None if recorder is None else tuple(recorder.entries),
                          tool_calls=tuple(calls or ()), sent_logprobs=sent,
                          edgekv=r.summary()))

    @staticmethod
    def _observe(metrics: ServeMetrics, r: GenerationResult, job: Job, t0: float) -> None:
        """One answer into the metrics: its TTFT and end-to-end time from its arrival."""
        metrics.observe(prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                        completion_tokens=len(r.tokens), ttft_s=t0 - job.arrived + r.ttft_s,
                        e2e_s=time.perf_counter() - job.arrived,
                        refused_injection=bool(r.rejections), streamed_tokens=r.streamed_tokens,
                        computed_tokens=r.computed_tokens, tier=r.tier,
                        approximate=r.approximate,
                        passage_reused_tokens=r.passages.reused_tokens if r.passages else 0)

    def _piece(self, token: int) -> bytes:
        """A token's bytes, as the engine has them (llama.cpp's piece: a part of a UTF-8
        character stays bytes)."""
        return self.kv.adapter.token_bytes(token)
