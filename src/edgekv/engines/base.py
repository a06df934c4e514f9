"""The `KVAdapter` protocol: the seed's six operations, plus what prefill reuse needs.

Seed (EdgeSync-LLM): ExtractFragment / InjectFragment / Generate / Tokenize / ClearKVCache /
Close. EdgeKV adds `prefill` (evaluate tokens after what the engine holds) because reuse means
"inject a prefix, then compute only the rest", and `fingerprint`, which binds KV to a model.

Prefill is *aligned*: tokens are evaluated in batches whose boundaries fall on multiples of
`align` (the cache's chunk size) in absolute position. The KV of chunk i is then computed by
the same batch of the same shape whether the request was cold or warm, so strict reuse gives
the same numbers as a cold run instead of "close enough".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError, EngineError, IncompatibleFragment
from ..fragment import KVFragment
from ..keys import ModelFingerprint

__all__ = ["TokenCallback", "sample_token", "EngineCounters", "check_prefill", "FragmentSpec", "Generation", "KVAdapter", "aligned_batches", "check_injectable",
           "injection_length", "sample_loop", "stack_prefix", "build_fragments", "SequenceAdapter"]


@dataclass(frozen=True, slots=True)
class FragmentSpec:
    """What to extract: a token range, a layer range and the chain key binding its prefix."""

    chain_key: str
    token_start: int
    token_end: int
    layer_start: int = 0
    layer_end: int | None = None  # None: all layers
    layer_stride: int = 1
    parent_key: str = ""


# called with each sampled token that is not end-of-sequence; returning False stops the
# generation there (a stop string was seen, the client went away)
TokenCallback = Callable[[int], bool]


@dataclass(frozen=True, slots=True)
class Generation:
    tokens: tuple[int, ...]
    logits: tuple[np.ndarray, ...]  # logits that chose each token (kept only when asked)
    stopped_by_eos: bool
    stopped_by_callback: bool = False

    @property
    def finish_reason(self) -> str:
        """OpenAI's words: "stop" (end of sequence or a stop condition), else "length"."""
        return "stop" if self.stopped_by_eos or self.stopped_by_callback else "length"


@dataclass(slots=True)
class EngineCounters:
    """What the engine computed, for the memory-traffic count in benchmarks: every forward
    batch streams the weights once, writes the KV of its tokens and reads the KV of every
    cell it attends to."""

    batches: int = 0
    tokens: int = 0
    kv_cells_read: int = 0

    def snapshot(self) -> EngineCounters:
        return EngineCounters(self.batches, self.tokens, self.kv_cells_read)

    def since(self, before: EngineCounters) -> EngineCounters:
        """What was computed after `before` (a snapshot)."""
        return EngineCounters(self.batches - before.batches, self.tokens - before.tokens,
                              self.kv_cells_read - before.kv_cells_read)

    def add_batch(self, lo: int, hi: int) -> None:
        self.batches += 1
        self.tokens += hi - lo
        self.kv_cells_read += hi

    def traffic_bytes(self, weight_bytes: int, kv_bytes_per_token: int) -> int:
        return (self.batches * weight_bytes
                + (self.tokens + self.kv_cells_read) * kv_bytes_per_token)


@runtime_checkable
class KVAdapter(Protocol):
    fingerprint: ModelFingerprint
    counters: EngineCounters

    @property
    def n_tokens(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def eos_token(self) -> int: ...

    def build_info(self) -> str:
        """What the engine's numerics depend on beyond the model: build, kernels, threads,
        attention path. The batch-invariance probe's answer is recorded under it."""
        ...

    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

    def clear_kv_cache(self) -> None: ...

    def prefill(self, tokens: Sequence[int], *, align: int) -> np.ndarray:
        """Evaluate `tokens` after the current context; return the last token's logits."""
        ...

    def extract_fragments(self, specs: Sequence[FragmentSpec]) -> list[KVFragment]: ...

    def inject_fragments(self, fragments: Sequence[KVFragment], limit: int | None = None) -> int:
        """Replace the context with the prefix the fragments cover (cut to its first `limit`
        tokens if given, e.g. where a verified common prefix ends inside a fragment); return
        its length."""
        ...

    def generate(self, logits: np.ndarray, max_tokens: int, *, temperature: float = 0.0,
                 seed: int = 0, keep_logits: bool = False, top_p: float = 1.0,
                 on_token: TokenCallback | None = None) -> Generation: ...

    def close(self) -> None: ...


def check_prefill(held: int, new: int, n_ctx: int) -> None:
    """Refuse an empty prefill or one that would overflow the context window."""
    if new < 1:
        raise EngineError("prefill needs at least one token")
    if held + new > n_ctx:
        raise EngineError(f"{held + new} tokens exceed the context window ({n_ctx}); raise "
                          "--n-ctx or shorten the prompt")


def aligned_batches(start: int, n: int, align: int) -> list[tuple[int, int]]:
    """Split positions [start, start+n) at multiples of `align`: [(lo, hi), ...]."""
    if align < 1:
        raise ConfigError(f"align={align} must be >= 1")
    out = []
    pos, end = start, start + n
    while pos < end:
        hi = min(end, (pos // align + 1) * align)
        out.append((pos, hi))
        pos = hi
    return out


def sample_token(logits: np.ndarray, temperature: float, top_p: float,
                 rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else softmax(logits / temperature) cut to the smallest set of
    tokens whose probability reaches `top_p` (nucleus sampling), drawn from a seeded RNG."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = (logits.astype(np.float64) - float(logits.max())) / temperature
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1
        idx = order[:keep]
        q = p[idx] / p[idx].sum()
        return int(idx[rng.choice(len(idx), p=q)])
    return int(rng.choice(len(p), p=p))


def sample_loop(adapter: KVAdapter, logits: np.ndarray, max_tokens: int, *, temperature: float,
                seed: int, keep_logits: bool, top_p: float = 1.0,
                on_token: TokenCallback | None = None) -> Generation:
    """Sample one token at a time (`sample_token`); each token but the last is evaluated, so
    the engine then holds the prompt and the answer less its last token."""
    if max_tokens < 0:
        raise ConfigError(f"max_tokens={max_tokens} must be >= 0")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p={top_p} must be in (0, 1]")
    if adapter.n_tokens + max_tokens > adapter.n_ctx:
        raise ConfigError(
            f"prompt ({adapter.n_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context "
            f"window ({adapter.n_ctx}); shorten the prompt or raise --n-ctx"
        )
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    kept: list[np.ndarray] = []
    eos = stopped = False
    for i in range(max_tokens):
        if keep_logits:
            kept.append(logits)
        tok = sample_token(logits, temperature, top_p, rng)
        tokens.append(tok)
        if tok == adapter.eos_token:
            eos = True
            break
        if on_token is not None and on_token(tok) is False:
            stopped = True
            break
        if i + 1 < max_tokens:
            logits = adapter.prefill([tok], align=1)
    return Generation(tuple(tokens), tuple(kept), eos, stopped)


def injection_length(fragments: Sequence[KVFragment], fp: ModelFingerprint,
                     limit: int | None) -> int:
    """`check_injectable`, then the number of tokens to restore given `limit`."""
    n = check_injectable(fragments, fp)
    if limit is None:
        return n
    if not 0 < limit <= n:
        raise IncompatibleFragment(f"limit={limit} must be in [1, {n}] (the tokens covered)")
    return limit


def check_injectable(fragments: Sequence[KVFragment], fp: ModelFingerprint) -> int:
    """Check fragments form a complete prefix [0, n) with every layer; return n.

    Raises IncompatibleFragment naming the first problem. llama.cpp (and any engine) needs
    every layer of every cell to resume, so a partial-layer prefix is not injectable.
    """
    digest = fp.digest
    covered: dict[tuple[int, int], set[int]] = {}
    for f in fragments:
        if f.model_fingerprint != digest:
            raise IncompatibleFragment(
                f"fragment {f.chain_key[:12]} was made by another model/engine "
                f"({f.model_fingerprint[:12]} != {digest[:12]})")
        if f.n_layer_model != fp.n_layer:
            raise IncompatibleFragment(
                f"fragment has {f.n_layer_model} model layers, this model {fp.n_layer}")
        if not f.all_heads:
            raise IncompatibleFragment(
                f"fragment {f.chain_key[:12]} holds KV heads [{f.head_start}, {f.head_end}) only; "
                "merge head groups (compactor) before injecting")
        if not f.is_dense:
            raise IncompatibleFragment(
                f"fragment {f.chain_key[:12]} samples layers with stride {f.layer_stride}; "
                "only dense (stride 1) fragments can be injected")
        if f.keys.shape[2] != fp.n_embd_k or f.values.shape[2] != fp.n_embd_v:
            raise IncompatibleFragment(
                f"fragment widths K={f.keys.shape[2]} V={f.values.shape[2]}, model expects "
                f"K={fp.n_embd_k} V={fp.n_embd_v}")
        if f.kv_dtype != fp.kv_dtype:
            raise IncompatibleFragment(f"fragment KV is {f.kv_dtype}, engine holds {fp.kv_dtype}")
        layers = covered.setdefault((f.token_start, f.token_end), set())
        overlap = layers.intersection(f.layer_indices)
        if overlap:
            raise IncompatibleFragment(f"layers {sorted(overlap)} given twice for tokens "
                                       f"[{f.token_start}, {f.token_end})")
        layers.update(f.layer_indices)
    pos = 0
    for (lo, hi) in sorted(covered):
        if lo != pos:
            raise IncompatibleFragment(f"token ranges leave a gap or overlap at {pos} (next starts at {lo})")
        missing = set(range(fp.n_layer)) - covered[(lo, hi)]
        if missing:
            raise IncompatibleFragment(
                f"tokens [{lo}, {hi}) lack layers {sorted(missing)[:5]}...; every layer is needed")
        pos = hi
    return pos


def stack_prefix(fragments: Sequence[KVFragment], fp: ModelFingerprint, n: int,
                 dtype: type = np.float32) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Canonical keys/values [layer, token, width] and token ids of positions [0, n) from
    fragments that `check_injectable` accepted (cut at `n`)."""
    keys = np.empty((fp.n_layer, n, fp.n_embd_k), dtype)
    values = np.empty((fp.n_layer, n, fp.n_embd_v), dtype)
    ids = [0] * n
    for f in fragments:
        if f.token_start >= n:
            continue
        end = min(f.token_end, n)
        m = end - f.token_start
        keys[f.layer_start : f.layer_end, f.token_start : end] = f.keys[:, :m]
        values[f.layer_start : f.layer_end, f.token_start : end] = f.values[:, :m]
        ids[f.token_start : end] = f.token_ids[:m].tolist()
    return keys, values, ids


def build_fragments(specs: Sequence[FragmentSpec], fp: ModelFingerprint, ids: Sequence[int],
                    layer_kv: Callable[[int, slice], tuple[np.ndarray, np.ndarray]],
                    dtype: type | None = None) -> list[KVFragment]:
    """Fragments for `specs` from an engine's state: `layer_kv(layer, token_slice)` returns
    that layer's canonical K and V [token, width]; `ids` are the engine's token ids."""
    out = []
    for s in specs:
        if s.token_end > len(ids):
            raise EngineError(f"cannot extract tokens [{s.token_start}, {s.token_end}): the "
                              f"engine holds {len(ids)}")
        le = fp.n_layer if s.layer_end is None else s.layer_end
        tok = slice(s.token_start, s.token_end)
        kv = [layer_kv(li, tok) for li in range(s.layer_start, le, s.layer_stride)]
        keys, values = np.stack([k for k, _ in kv]), np.stack([v for _, v in kv])
        if dtype is not None:
            keys, values = keys.astype(dtype, copy=False), values.astype(dtype, copy=False)
        out.append(KVFragment(
            model_fingerprint=fp.digest, chain_key=s.chain_key, token_start=s.token_start,
            token_end=s.token_end, layer_start=s.layer_start, layer_end=le,
            layer_stride=s.layer_stride, parent_key=s.parent_key, n_layer_model=fp.n_layer,
            token_ids=np.asarray(ids[tok], np.int32), keys=keys, values=values))
    return out


class SequenceAdapter:
    """Bookkeeping shared by adapters that keep their own token list (fake, torch, onnx)."""

    _ids: list[int]
    _n_ctx: int

    @property
    def n_tokens(self) -> int:
        return len(self._ids)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    def generate(self, logits: np.ndarray, max_tokens: int, *, temperature: float = 0.0,
                 seed: int = 0, keep_logits: bool = False, top_p: float = 1.0,
                 on_token: TokenCallback | None = None) -> Generation:
        return sample_loop(self, logits, max_tokens, temperature=temperature, seed=seed,  # type: ignore[arg-type]
                           keep_logits=keep_logits, top_p=top_p, on_token=on_token)
