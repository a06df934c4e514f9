"""`KVFragment`: the atomic unit of the cache (the seed's `cache/fragment.go`, in Python).

A fragment holds the K and V of one token range `[token_start, token_end)` for a range of
layers, in EdgeKV's canonical layout: `keys[layer, token, n_head_kv * head_dim]` and the same
for `values` (token-major; engines convert to and from it). It is bound to the model
fingerprint, to its own token ids and to the chain key of its prefix: the KV of a token
depends on every token before it, so `chain_key` (which hashes the whole prefix) is what makes a
fragment valid for a request, and `content_hash` (the seed's hash of its own token ids) is what
deduplicates it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass

import numpy as np

from .errors import FragmentError
from .keys import token_bytes

__all__ = ["KVFragment", "MAX_SPAN", "MIN_SPAN", "PASSAGE_MIN_SPAN", "PASSAGE_PARENT",
           "TAIL_MIN_SPAN", "common_prefix", "content_hash", "next_expiry"]

# a full chunk's span (`CacheConfig.chunk_size`): the seed's [64, 2048] tokens
MIN_SPAN = 64
MAX_SPAN = 2048
# a chain's trailing partial chunk (the tokens after its last full chunk, `Writeback`) hangs
# off that chunk on its own, however short: stored beside the chunk before it instead, it
# would hold that chunk's KV twice. A fragment does not know its chunk size, so a chain
# fragment's span is checked against this minimum; chunk sizes are checked by the config.
TAIL_MIN_SPAN = 1
# passage reuse's fragments (`passages`: one passage's own KV, never part of a chain) carry
# this parent key and have a minimum of their own: a RAG passage is often a sentence or two
PASSAGE_PARENT = "passages"
PASSAGE_MIN_SPAN = 1
KV_DTYPES = {"f16": np.float16, "f32": np.float32}


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading token ids of `a` and `b` are equal."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


def content_hash(fingerprint: str, token_ids: np.ndarray) -> str:
    """SHA-256 of the token ids, bound to the model fingerprint."""
    return hashlib.sha256(fingerprint.encode() + b"\0" + token_bytes(token_ids)).hexdigest()


def _fail(field: str, value: object, allowed: str) -> FragmentError:
    return FragmentError(f"KVFragment.{field}={value!r} is invalid: allowed {allowed}")


@dataclass(frozen=True, slots=True, eq=False)
class KVFragment:
    model_fingerprint: str
    chain_key: str
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int
    layer_stride: int
    n_layer_model: int
    token_ids: np.ndarray  # int32 [span]
    keys: np.ndarray  # [n_layers, span, n_embd_k]
    values: np.ndarray  # [n_layers, span, n_embd_v]
    embedding: np.ndarray | None = None  # float32 [384], optional here
    created_at: float = 0.0
    expires_at: float = 0.0
    hit_count: int = 0
    content_hash: str = ""
    parent_key: str = ""  # chain key of the chunk before this one ("" for the first chunk)
    head_start: int = 0  # KV heads [head_start, head_end); head_end 0 means all heads
    head_end: int = 0

    def __post_init__(self) -> None:
        span = self.token_end - self.token_start
        if self.token_start < 0:
            raise _fail("token_start", self.token_start, ">= 0")
        if self.parent_key == PASSAGE_PARENT:
            lo, what = PASSAGE_MIN_SPAN, "a passage"
        else:
            lo, what = TAIL_MIN_SPAN, (f"a chain's full chunk spans the chunk size "
                                       f"[{MIN_SPAN}, {MAX_SPAN}], its trailing partial chunk "
                                       f"at least {TAIL_MIN_SPAN}")
        if not lo <= span <= MAX_SPAN:
            raise _fail("token_end - token_start", span, f"[{lo}, {MAX_SPAN}] tokens ({what})")
        if self.layer_stride < 1:
            raise _fail("layer_stride", self.layer_stride, ">= 1")
        if self.n_layer_model < 1:
            raise _fail("n_layer_model", self.n_layer_model, ">= 1")
        if not 0 <= self.layer_start < self.layer_end:
            raise _fail("layer_start", self.layer_start, f"[0, layer_end={self.layer_end})")
        if self.layer_end > self.n_layer_model:
            raise _fail("layer_end", self.layer_end, f"<= model layers ({self.n_layer_model})")
        ids = np.asarray(self.token_ids)
        if ids.ndim != 1 or len(ids) != span:
            raise _fail("token_ids", f"length {ids.size}", f"exactly the span ({span})")
        object.__setattr__(self, "token_ids", ids.astype(np.int32, copy=False))
        n_sel = len(self.layer_indices)
        for name in ("keys", "values"):
            t = getattr(self, name)
            if not isinstance(t, np.ndarray) or t.size == 0:
                raise _fail(name, "empty", "a non-empty array")
            if t.dtype not in (np.float16, np.float32):
                raise _fail(f"{name}.dtype", str(t.dtype), "float16 or float32")
            if t.ndim != 3 or t.shape[0] != n_sel or t.shape[1] != span:
                raise _fail(
                    f"{name}.shape", t.shape, f"({n_sel} layers, {span} tokens, embedding width)"
                )
        if self.keys.dtype != self.values.dtype:
            raise _fail("values.dtype", str(self.values.dtype), f"same as keys ({self.keys.dtype})")
        if self.embedding is not None:
            emb = np.asarray(self.embedding, dtype=np.float32)
            if emb.ndim != 1 or emb.size == 0:
                raise _fail("embedding", f"shape {emb.shape}", "a 1-d vector (384-d for MiniLM)")
            object.__setattr__(self, "embedding", emb)
        if self.hit_count < 0:
            raise _fail("hit_count", self.hit_count, ">= 0")
        if self.head_end:
            n_heads = self.head_end - self.head_start
            if self.head_start < 0 or n_heads < 1:
                raise _fail("head_start", self.head_start, f"[0, head_end={self.head_end})")
            for name in ("keys", "values"):
                if getattr(self, name).shape[2] % n_heads:
                    raise _fail(f"{name}.shape[2]", getattr(self, name).shape[2],
                                f"a multiple of the {n_heads} heads it holds")
        expected = content_hash(self.model_fingerprint, self.token_ids)
        if not self.content_hash:
            object.__setattr__(self, "content_hash", expected)
        elif self.content_hash != expected:
            raise _fail("content_hash", self.content_hash, f"the hash of token_ids ({expected})")

    # -- derived -------------------------------------------------------------------------

    @property
    def span(self) -> int:
        return self.token_end - self.token_start

    @property
    def layer_indices(self) -> range:
        return range(self.layer_start, self.layer_end, self.layer_stride)

    @property
    def kv_dtype(self) -> str:
        return "f16" if self.keys.dtype == np.float16 else "f32"

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes + self.token_ids.nbytes)

    @property
    def all_heads(self) -> bool:
        return self.head_end == 0

    @property
    def is_dense(self) -> bool:
        """True when every layer in [layer_start, layer_end) is present (stride 1)."""
        return self.layer_stride == 1

    def is_expired(self, now: float | None = None) -> bool:
        return self.expires_at > 0 and (time.time() if now is None else now) >= self.expires_at

    # -- lifecycle -----------------------------------------------------------------------

    def stamped(self, now: float, ttl_s: float) -> KVFragment:
        """A copy with created_at/expires_at set for a fresh store."""
        return dataclasses.replace(self, created_at=now, expires_at=now + ttl_s)

    def with_lifecycle(self, hit_count: int, expires_at: float) -> KVFragment:
        return dataclasses.replace(self, hit_count=hit_count, expires_at=expires_at)

    def prefix_len(self, token_ids: np.ndarray) -> int:
        """How many leading tokens of this fragment equal `token_ids` (compared position-wise)."""
        return common_prefix(self.token_ids, token_ids)

    def layer_slice(self, layer_start: int, layer_end: int) -> KVFragment:
        """The sub-fragment holding layers [layer_start, layer_end) (dense fragments only)."""
        if not self.is_dense:
            raise _fail("layer_stride", self.layer_stride, "1 to slice layers")
        if not self.layer_start <= layer_start < layer_end <= self.layer_end:
            raise _fail(
                "layer range", (layer_start, layer_end),
                f"within [{self.layer_start}, {self.layer_end})"
            )
        a, b = layer_start - self.layer_start, layer_end - self.layer_start
        return dataclasses.replace(
            self, layer_start=layer_start, layer_end=layer_end,
            keys=self.keys[a:b], values=self.values[a:b],
        )


def next_expiry(hit_count: int, now: float, ttl_s: float, promoted_ttl_s: float,
                promote_hits: int) -> float:
    """Seed rule: a fragment hit `promote_hits` times or more lives `promoted_ttl_s`, else
    `ttl_s`."""
    return now + (promoted_ttl_s if hit_count >= promote_hits else ttl_s)
