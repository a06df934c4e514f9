"""A tiny deterministic engine for fast tests (the way httpx ships MockTransport).

Its KV for a position is a pseudo-random function of the *whole prefix* up to that token, and
its logits depend on every K and V in the context, so injecting KV computed for another prefix
changes the output, exactly the failure strict reuse must never allow. It counts the tokens it
computes, so tests can assert how much prefill a warm request skipped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ..errors import EngineError
from ..fragment import KVFragment
from ..keys import ModelFingerprint
from .base import (EngineCounters, FragmentSpec, Generation, aligned_batches, injection_length,
                   sample_loop, stack_prefix)

__all__ = ["FakeAdapter"]


class FakeAdapter:
    def __init__(self, *, n_layer: int = 4, n_head_kv: int = 2, head_dim: int = 4,
                 vocab: int = 257, n_ctx: int = 4096, tag: str = "fake-model") -> None:
        self.fingerprint = ModelFingerprint(
            file_sha256=hashlib.sha256(tag.encode()).hexdigest(), architecture="fake",
            n_layer=n_layer, n_head_kv=n_head_kv, head_dim_k=head_dim, head_dim_v=head_dim,
            kv_dtype="f16", engine="fake/1")
        self.vocab = vocab
        self._n_ctx = n_ctx
        self._w = np.random.default_rng(7).standard_normal((n_head_kv * head_dim, vocab))
        self._ids: list[int] = []
        self._hash: list[bytes] = []
        self._k: list[np.ndarray] = []  # per position: [n_layer, width]
        self._v: list[np.ndarray] = []
        self.computed_tokens = 0  # tokens run through "prefill" since construction
        self.counters = EngineCounters()
        self.weight_bytes = int(self._w.nbytes)

    @property
    def n_tokens(self) -> int:
        return len(self._ids)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def eos_token(self) -> int:
        return 0

    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = [1 + (b % (self.vocab - 1)) for b in text.encode("utf-8")]
        return ([1] if add_bos else []) + ids

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(chr(32 + (t % 95)) for t in tokens)

    def clear_kv_cache(self) -> None:
        self._ids, self._hash, self._k, self._v = [], [], [], []

    def prefill(self, tokens: Sequence[int], *, align: int) -> np.ndarray:
        if not tokens:
            raise EngineError("prefill needs at least one token")
        if self.n_tokens + len(tokens) > self._n_ctx:
            raise EngineError(f"context window ({self._n_ctx}) exceeded")
        fp = self.fingerprint
        for t in tokens:
            parent = self._hash[-1] if self._hash else b"root"
            h = hashlib.sha256(parent + int(t).to_bytes(4, "little")).digest()
            rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
            self._ids.append(int(t))
            self._hash.append(h)
            self._k.append(rng.standard_normal((fp.n_layer, fp.n_embd_k)).astype(np.float16))
            self._v.append(rng.standard_normal((fp.n_layer, fp.n_embd_v)).astype(np.float16))
        self.computed_tokens += len(tokens)
        for lo, hi in aligned_batches(self.n_tokens - len(tokens), len(tokens), align):
            self.counters.add_batch(lo, hi)
        return self._logits()

    def _logits(self) -> np.ndarray:
        k, v = np.stack(self._k).astype(np.float32), np.stack(self._v).astype(np.float32)
        att = np.tanh(k[-1] @ k.mean(axis=0).T).sum() + v.mean(axis=(0, 1))
        return (att @ self._w).astype(np.float32)

    def generate(self, logits: np.ndarray, max_tokens: int, *, temperature: float = 0.0,
                 seed: int = 0, keep_logits: bool = False) -> Generation:
        return sample_loop(self, logits, max_tokens, temperature=temperature, seed=seed,
                           keep_logits=keep_logits)

    def extract_fragments(self, specs: Sequence[FragmentSpec]) -> list[KVFragment]:
        fp = self.fingerprint
        k, v = np.stack(self._k, axis=1), np.stack(self._v, axis=1)
        out = []
        for s in specs:
            if s.token_end > self.n_tokens:
                raise EngineError(f"cannot extract up to {s.token_end}: engine holds {self.n_tokens}")
            le = fp.n_layer if s.layer_end is None else s.layer_end
            lay, tok = slice(s.layer_start, le, s.layer_stride), slice(s.token_start, s.token_end)
            out.append(KVFragment(
                model_fingerprint=fp.digest, chain_key=s.chain_key, token_start=s.token_start,
                token_end=s.token_end, layer_start=s.layer_start, layer_end=le,
                layer_stride=s.layer_stride, parent_key=s.parent_key, n_layer_model=fp.n_layer,
                token_ids=np.asarray(self._ids[tok], np.int32),
                keys=k[lay, tok].copy(), values=v[lay, tok].copy()))
        return out

    def inject_fragments(self, fragments: Sequence[KVFragment], limit: int | None = None) -> int:
        n = injection_length(fragments, self.fingerprint, limit)
        k, v, ids = stack_prefix(fragments, self.fingerprint, n, np.float16)
        self.clear_kv_cache()
        self._ids = ids
        # the prefix hash chain is recomputed from the token ids (cheap, no KV involved)
        parent = b"root"
        for t in ids:
            parent = hashlib.sha256(parent + int(t).to_bytes(4, "little")).digest()
            self._hash.append(parent)
        self._k = [k[:, i] for i in range(n)]
        self._v = [v[:, i] for i in range(n)]
        return n

    def close(self) -> None:
        self.clear_kv_cache()
