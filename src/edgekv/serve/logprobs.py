"""`logprobs` / `top_logprobs`: each sampled token's log-probability and its top alternatives.

Which distribution: the log-softmax of the engine's raw logits at that step (temperature 1, no
top_p cut, and before any grammar mask: a `response_format` or forced tool call does not
renormalize them), as OpenAI reports the model's own distribution. The recorder is a
`Constraint` that masks nothing and sits first in the chain, so it sees the logits the
engine returned; it records when the loop accepts the token, so end-of-sequence (never
accepted) gets no entry, and neither does anything after the answer ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["LogprobRecorder", "TokenLogprob", "chat_logprobs", "completion_logprobs"]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[tuple[str, float, tuple[int, ...]], ...]  # best first (ties: lower id first)


class LogprobRecorder:
    """`engines.constraint.Constraint` that records; `piece(token)` gives a token's bytes."""

    def __init__(self, top: int, piece: Callable[[int], bytes]) -> None:
        self.top, self._piece = top, piece
        self._row: np.ndarray | None = None
        self.entries: list[TokenLogprob] = []

    def mask(self, logits: np.ndarray) -> np.ndarray:
        self._row = logits
        return logits

    def accept(self, token: int) -> None:
        if self._row is None:
            return
        z = self._row.astype(np.float64)
        z -= z.max()
        lp = z - np.log(np.exp(z).sum())
        best: list[int] = []
        if self.top:
            k = min(self.top, lp.size)
            cand = np.argpartition(-lp, k - 1)[:k]
            best = sorted(cand.tolist(), key=lambda t: (-lp[t], t))
        text, raw = self._text(token)
        self.entries.append(TokenLogprob(text, float(lp[token]), raw, tuple(
            (t_text, float(lp[t]), t_raw) for t in best for t_text, t_raw in [self._text(t)])))
        self._row = None

    def _text(self, token: int) -> tuple[str, tuple[int, ...]]:
        raw = self._piece(int(token))
        return raw.decode("utf-8", "replace"), tuple(raw)


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """`choice.logprobs` of a chat completion (or of one chunk)."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)}
                                          for t, lp, b in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """`choice.logprobs` of a text completion (the legacy shape); `offset`: the characters
    of text before these tokens (for `text_offset`)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: lp for t, lp, _ in e.top} for e in entries],
            "text_offset": offsets}
