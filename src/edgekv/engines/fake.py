"""A tiny deterministic engine for fast tests (the way httpx ships MockTransport).

Its KV for a position is a pseudo-random function of the *whole prefix* up to that token, and
its logits depend on every K and V in the context, so injecting KV computed for another prefix
changes the output, exactly the failure strict reuse must never allow. It counts the tokens it
computes, so tests can assert how much prefill a warm request skipped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..fragment import KVFragment
from ..keys import ModelFingerprint
from .base import EngineCounters, FragmentSpec, KVRun
from .shared import (
    SequenceAdapter,
    aligned_batches,
    append_length,
    build_fragments,
    check_prefill,
    injection_length,
    stack_prefix,
)

__all__ = ["FakeAdapter"]


class FakeAdapter(SequenceAdapter):
    def __init__(self, *, n_layer: int = 4, n_head_kv: int = 2, head_dim: int = 4,
                 vocab: int = 257, n_ctx: int = 4096, tag: str = "fake-model",
                 batch_variant: bool = False) -> None:
        """`batch_variant=True` makes the KV of a token depend slightly on where its batch
        started, the way some real kernels do: the batch-invariance probe must catch it."""
        self._settings: dict[str, Any] = dict(
            n_layer=n_layer, n_head_kv=n_head_kv, head_dim=head_dim, vocab=vocab, n_ctx=n_ctx,
            tag=tag, batch_variant=batch_variant)
        self.fingerprint = ModelFingerprint(
            file_sha256=hashlib.sha256(tag.encode()).hexdigest(), architecture="fake",
            n_layer=n_layer, n_head_kv=n_head_kv, head_dim_k=head_dim, head_dim_v=head_dim,
            kv_dtype="f16", engine="fake/1")
        self.vocab = vocab
        self.batch_variant = batch_variant
        self._n_ctx = n_ctx
        self._w = np.random.default_rng(7).standard_normal((n_head_kv * head_dim, vocab))
        self._ids: list[int] = []
        self._hash: list[bytes] = []
        self._k: list[np.ndarray] = []  # per position: [n_layer, width]
        self._v: list[np.ndarray] = []
        self.computed_tokens = 0  # tokens run through "prefill" since construction
        self.counters = EngineCounters()
        self.weight_bytes = int(self._w.nbytes)
        self.n_threads = 1  # numpy's own; the fake engine has no thread setting

    def twin(self) -> FakeAdapter:
        """`Twinned`: another fake engine with the same weights and settings."""
        return FakeAdapter(**self._settings)

    @property
    def eos_token(self) -> int:
        return 0

    @property
    def n_vocab(self) -> int:
        return self.vocab

    def build_info(self) -> str:
        return f"fake/1 batch_variant={self.batch_variant}"

    def chat_template(self) -> str | None:
        return None  # the fake model has no chat format

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        ids = [1 + (b % (self.vocab - 1)) for b in text.encode("utf-8")]
        return ([1] if add_bos else []) + ids

    def control_tokens(self) -> dict[str, int]:
        return {}  # byte-level: no text is ever a control token

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(chr(32 + (t % 95)) for t in tokens)

    def clear_kv_cache(self) -> None:
        self._ids, self._hash, self._k, self._v = [], [], [], []

    def prefill(self, tokens: Sequence[int], *, align: int) -> np.ndarray:
        check_prefill(self.n_tokens, len(tokens), self._n_ctx)
        base = self.n_tokens
        for lo, hi in aligned_batches(base, len(tokens), align):
            for t in tokens[lo - base : hi - base]:
                self._compute(t, lo, hi)
            self.counters.add_batch(lo, hi)
        self.computed_tokens += len(tokens)
        return self._logits()

    def verify(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """`base.DraftVerifier`: `tokens` as one batch, the logits after each (a batch-variant
        fake computes them with the batch's shape, so verified drafts differ from decode)."""
        check_prefill(self.n_tokens, len(tokens), self._n_ctx)
        lo = self.n_tokens
        out = []
        for t in tokens:
            self._compute(t, lo, lo + len(tokens))
            out.append(self._logits())
        self.counters.add_batch(lo, lo + len(tokens))
        self.computed_tokens += len(tokens)
        return out

    def truncate(self, n: int) -> None:
        """`base.DraftVerifier`: keep the first `n` positions."""
        del self._ids[n:], self._hash[n:], self._k[n:], self._v[n:]

    def _compute(self, t: int, lo: int, hi: int) -> None:
        """The KV of token `t` after what is held, in a batch [lo, hi)."""
        fp = self.fingerprint
        parent = self._hash[-1] if self._hash else b"root"
        h = hashlib.sha256(parent + int(t).to_bytes(4, "little")).digest()
        rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
        self._ids.append(int(t))
        self._hash.append(h)
        k = rng.standard_normal((fp.n_layer, fp.n_embd_k))
        if self.batch_variant:  # numbers that depend on the batch's start and size
            k = k + 1e-2 * ((lo % 7) + ((hi - lo) % 5))
        self._k.append(k.astype(np.float16))
        self._v.append(rng.standard_normal((fp.n_layer, fp.n_embd_v)).astype(np.float16))

    def _logits(self) -> np.ndarray:
        k, v = np.stack(self._k).astype(np.float32), np.stack(self._v).astype(np.float32)
        att = np.tanh(k[-1] @ k.mean(axis=0).T).sum() + v.mean(axis=(0, 1))
        return (att @ self._w).astype(np.float32)

    def extract_fragments(self, specs: Sequence[FragmentSpec]) -> list[KVFragment]:
        k, v = np.stack(self._k, axis=1), np.stack(self._v, axis=1)
        return build_fragments(specs, self.fingerprint, self._ids,
                               lambda li, tok: (k[li, tok], v[li, tok]))

    def inject_fragments(self, fragments: Sequence[KVFragment], limit: int | None = None) -> int:
        n = injection_length(fragments, self.fingerprint, limit)
        k, v, ids = stack_prefix(fragments, self.fingerprint, n, np.float16)
        self.clear_kv_cache()
        self.extend(k, v, ids)
        return n

    def append_fragments(self, fragments: Sequence[KVFragment]) -> int:
        held = self.n_tokens
        end = append_length(fragments, self.fingerprint, held, self._n_ctx)
        self.extend(*stack_prefix(fragments, self.fingerprint, end, np.float16, start=held))
        return end

    def layer_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The K and V the engine holds for one layer, [token, width], as float32."""
        return (np.stack(self._k)[:, layer].astype(np.float32),
                np.stack(self._v)[:, layer].astype(np.float32))

    def extend(self, k: np.ndarray, v: np.ndarray, ids: list[int]) -> None:
        """Append KV [layer, token, width] for `ids` after what the engine holds."""
        """Hold KV [layer, token, width] for `ids` after what is held. The prefix hash chain
        is continued from the token ids (cheap, no KV involved)."""
        parent = self._hash[-1] if self._hash else b"root"
        for i, t in enumerate(ids):
            parent = hashlib.sha256(parent + int(t).to_bytes(4, "little")).digest()
            self._ids.append(int(t))
            self._hash.append(parent)
            self._k.append(k[:, i])
            self._v.append(v[:, i])

    def close(self) -> None:
        self.clear_kv_cache()


class FakePassages:
    """A passage engine (`base.PassageEngine`) for the fake model: it has no RoPE, so a shift
    changes nothing, and cached runs are appended as they are (the fake's KV then differs
    from a cold run's, as a real placement's does)."""

    def __init__(self, adapter: FakeAdapter) -> None:
        self.adapter = adapter
        self.restores = 0

    def shift_keys(self, keys: np.ndarray, delta: int) -> np.ndarray:
        return keys

    def build(self, runs: Sequence[KVRun]) -> int:
        for r in runs:
            if r.keys is None:
                self.adapter.prefill(r.tokens, align=self.adapter.n_ctx)
            else:
                assert r.values is not None
                self.adapter.extend(r.keys, r.values, list(r.tokens))
                self.restores += 1
        return self.adapter.n_tokens

    def layer_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.adapter.layer_kv(layer)


class ShiftingFakeAdapter(FakeAdapter):
    """The fake engine that can place cached KV elsewhere (`base.ShiftableKV`): passage reuse
    runs on it."""

    def passage_engine(self) -> FakePassages:
        return FakePassages(self)
