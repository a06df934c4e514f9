"""Token ids in, text deltas out, with OpenAI's `stop` strings honoured.

Why not detokenize each token alone: a token can hold half of a UTF-8 character, and some
tokenizers render a token's leading space only after a preceding token. So each step decodes a
short window that starts a token before the new ones (vLLM's incremental detokenizer) and keeps
back a trailing partial character. Stop strings are matched on the decoded text; the text that
might be the start of a stop string is held back from the stream until it is known not to be,
so a streamed answer never shows a stop string that the final text leaves out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalText"]

REPLACEMENT = "\ufffd"  # what a detokenizer makes of an incomplete UTF-8 sequence


class IncrementalText:
    """Feed each generated token to `push`; `finish` flushes what is held back. `text` is the
    answer so far (cut before the first stop string once one is seen)."""

    def __init__(self, detokenize: Callable[[Sequence[int]], str],
                 stop: Sequence[str] = ()) -> None:
        self._detok = detokenize
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._prefix = self._read = 0  # window [prefix, read) is decoded already
        self._scanned = 0  # text before this index holds no stop string
        self._sent = 0  # characters of `text` handed out so far
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """The text that `token` makes safe to show (often "", never past a stop string)."""
        if self.stopped:
            return ""
        self._ids.append(int(token))
        self._decode(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Everything still held back (partial characters, possible stop-string starts)."""
        if not self.stopped:
            self._decode(final=True)
        return self._release(final=True)

    # -- private helpers -----------------------------------------------------------------

    def _decode(self, *, final: bool) -> None:
        before = self._detok(self._ids[self._prefix:self._read])
        now = self._detok(self._ids[self._prefix:])
        if len(now) > len(before) and (final or not now.endswith(REPLACEMENT)):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        if self._stop:
            self._find_stop()

    def _find_stop(self) -> None:
        start = max(0, self._scanned - self._longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
        self._scanned = len(self.text)

    def _held(self) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        for n in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _release(self, *, final: bool) -> str:
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        out = self.text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out
