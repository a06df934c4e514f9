"""What the adapters share in code: prefill checks and batching, sampling, fragment
assembly and checks, and the token bookkeeping of adapters that keep their own token list.

The protocol and its value types are in `base.py`; these helpers are written against them, so
an adapter is its engine's specifics plus calls into this module.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import ConfigError, EngineError, IncompatibleFragment
from ..fragment import KVFragment
from ..keys import ModelFingerprint
from .base import DraftVerifier, FragmentSpec, Generation, KVAdapter, TokenCallback
from .constraint import Constraint
from .spec import NGramDrafter, Speculation
from .window import WindowLayout

__all__ = ["SequenceAdapter", "aligned_batches", "append_length", "build_fragments",
           "check_injectable", "check_prefill", "check_sampling", "injection_length",
           "sample_loop", "sample_token", "speculative_loop", "stack_prefix"]


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


def check_sampling(adapter: KVAdapter, max_tokens: int, top_p: float) -> None:
    """Refuse a negative `max_tokens`, a `top_p` outside (0, 1], or an answer that cannot fit
    the context window after what the engine holds."""
    if max_tokens < 0:
        raise ConfigError(f"max_tokens={max_tokens} must be >= 0")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p={top_p} must be in (0, 1]")
    if adapter.n_tokens + max_tokens > adapter.n_ctx:
        raise ConfigError(
            f"prompt ({adapter.n_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context "
            f"window ({adapter.n_ctx}); shorten the prompt or raise --n-ctx"
        )


def sample_loop(adapter: KVAdapter, logits: np.ndarray, max_tokens: int, *, temperature: float,
                seed: int, keep_logits: bool, top_p: float = 1.0,
                on_token: TokenCallback | None = None,
                constraint: Constraint | None = None,
                speculation: Speculation | None = None) -> Generation:
    """Sample one token at a time (`sample_token`); each token but the last is evaluated, so
    the engine then holds the prompt and the answer less its last token. A `constraint`
    masks each step's logits before the draw and is told the token drawn (before `on_token`
    sees it); the logits kept with `keep_logits` are the raw ones, before its mask.
    `speculation`: the same tokens through `speculative_loop` (drafts verified in one
    batch), where the adapter can verify drafts (`DraftVerifier`); elsewhere ignored."""
    if speculation is not None and isinstance(adapter, DraftVerifier):
        return speculative_loop(adapter, logits, max_tokens, temperature=temperature,
                                seed=seed, keep_logits=keep_logits, top_p=top_p,
                                on_token=on_token, constraint=constraint,
                                speculation=speculation)
    check_sampling(adapter, max_tokens, top_p)
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    kept: list[np.ndarray] = []
    eos = stopped = False
    for i in range(max_tokens):
        if keep_logits:
            kept.append(logits)
        tok = sample_token(logits if constraint is None else constraint.mask(logits),
                           temperature, top_p, rng)
        tokens.append(tok)
        if tok == adapter.eos_token:
            eos = True
            break
        if constraint is not None:
            constraint.accept(tok)
        if on_token is not None and on_token(tok) is False:
            stopped = True
            break
        if i + 1 < max_tokens:
            logits = adapter.prefill([tok], align=1)
    return Generation(tuple(tokens), tuple(kept), eos, stopped)


class _Drafter:
    """The drafts of one answer: the n-gram index over the prompt and the answer, built at the
    first step that asks for drafts (most answers never draft) and fed what was sampled since."""

    def __init__(self, prompt: list[int], speculation: Speculation) -> None:
        self.prompt, self.config = prompt, speculation.config
        self.index: NGramDrafter | None = None
        self.fed = 0  # answer tokens the index has seen

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if not k:
            return []
        if self.index is None:
            self.index = NGramDrafter(self.prompt, self.config)
        self.index.extend(tokens[self.fed:])
        self.fed = len(tokens)
        return self.index.propose(k)


def speculative_loop(adapter: KVAdapter, logits: np.ndarray, max_tokens: int, *,
                     temperature: float, seed: int, keep_logits: bool, top_p: float = 1.0,
                     on_token: TokenCallback | None = None,
                     constraint: Constraint | None = None,
                     speculation: Speculation) -> Generation:
    """`sample_loop`'s tokens, with drafts verified in one batch (`spec`'s module doc). The
    adapter must be a `DraftVerifier`; the engine is left holding the prompt and the answer
    less its last token, as after `sample_loop`."""
    if not isinstance(adapter, DraftVerifier):
        raise ConfigError(f"the {type(adapter).__name__} engine cannot verify drafts")
    check_sampling(adapter, max_tokens, top_p)
    rng, base = np.random.default_rng(seed), adapter.n_tokens  # base: the prompt, held
    drafter = _Drafter(list(adapter.token_ids), speculation)
    policy, costs = speculation.policy(), speculation.costs
    assert costs is not None
    tokens, kept, eos, stopped = list[int](), list[np.ndarray](), False, False
    drafted = accepted = steps = 0
    step_logits, drafts = [logits], list[int]()
    while True:
        done = False
        took = 0  # this step's drafts equal to the tokens sampled at their positions
        for j, lg in enumerate(step_logits):
            if keep_logits:
                kept.append(lg)
            tok = sample_token(lg if constraint is None else constraint.mask(lg),
                               temperature, top_p, rng)
            tokens.append(tok)
            match = j < len(drafts) and tok == drafts[j]
            took += match
            if tok == adapter.eos_token:
                eos = done = True
            else:
                if constraint is not None:
                    constraint.accept(tok)
                if on_token is not None and on_token(tok) is False:
                    stopped = done = True
            if done or len(tokens) >= max_tokens or not match:
                done = done or len(tokens) >= max_tokens
                break
        if drafts:
            policy.observe(len(drafts), took)
            accepted += took
        # the engine holds the drafts' cells too: keep the answer's, less its last token
        if adapter.n_tokens > base + len(tokens) - 1:
            adapter.truncate(base + len(tokens) - 1)
        if done or not tokens:
            break
        room = max_tokens - len(tokens) - 1
        drafts = drafter.propose(tokens, policy.length(room) if room > 0 else 0)
        t0 = time.perf_counter()
        if drafts:
            step_logits = adapter.verify([tokens[-1], *drafts])
            drafted, steps = drafted + len(drafts), steps + 1
        else:
            step_logits = [adapter.prefill([tokens[-1]], align=1)]
        costs.observe(len(drafts) + 1, time.perf_counter() - t0)
    speculation.count(drafted, accepted, steps)
    return Generation(tuple(tokens), tuple(kept), eos, stopped, drafted=drafted,
                      accepted=accepted)



def injection_length(fragments: Sequence[KVFragment], fp: ModelFingerprint,
                     limit: int | None, window: WindowLayout | None = None) -> int:
    """`check_injectable`, then the number of tokens to restore given `limit`."""
    n = check_injectable(fragments, fp, window=window, until=limit)
    if limit is None:
        return n
    if not 0 < limit <= n:
        raise IncompatibleFragment(f"limit={limit} must be in [1, {n}] (the tokens covered)")
    return limit


def append_length(fragments: Sequence[KVFragment], fp: ModelFingerprint, held: int,
                  n_ctx: int) -> int:
    """`check_injectable` from position `held` (what the engine holds), then the context
    length once the fragments are appended, refused past `n_ctx`."""
    end = check_injectable(fragments, fp, start=held)
    if end > n_ctx:
        raise IncompatibleFragment(f"appending up to token {end} exceeds the context ({n_ctx})")
    return end


def check_injectable(fragments: Sequence[KVFragment], fp: ModelFingerprint,
                     start: int = 0, *, window: WindowLayout | None = None,
                     until: int | None = None) -> int:
    """Check fragments form a complete range [start, n) with every layer (from 0: a prefix;
    from what the engine holds: an append); return n.

    Raises IncompatibleFragment naming the first problem. llama.cpp (and any engine) needs
    every layer of every cell to resume, so a partial-layer prefix is not injectable; with a
    sliding-window `window`, a token range that ends before the last window of the prefix
    (which ends at `until`, else at n) needs only the global layers.
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
    pos = start
    for (lo, hi) in sorted(covered):
        if lo != pos:
            raise IncompatibleFragment(
                f"token ranges leave a gap or overlap at {pos} (next starts at {lo})")
        pos = hi
    end = pos if until is None else min(until, pos)
    for (lo, hi), layers in covered.items():
        if lo >= end:
            continue
        needed = (range(fp.n_layer) if window is None
                  else [i for i in range(fp.n_layer) if window.needed_from(i, end) < hi])
        missing = set(needed) - layers
        if missing:
            raise IncompatibleFragment(
                f"tokens [{lo}, {hi}) lack layers {sorted(missing)[:5]}...; every layer is needed")
    return pos


def stack_prefix(fragments: Sequence[KVFragment], fp: ModelFingerprint, n: int,
                 dtype: type = np.float32,
                 start: int = 0) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Canonical keys/values [layer, token, width] and token ids of positions [start, n) from
    fragments that `check_injectable` accepted from `start` (cut at `n`)."""
    keys: np.ndarray = np.empty((fp.n_layer, n - start, fp.n_embd_k), dtype)
    values: np.ndarray = np.empty((fp.n_layer, n - start, fp.n_embd_v), dtype)
    ids = [0] * (n - start)
    for f in fragments:
        if f.token_start >= n:
            continue
        end = min(f.token_end, n)
        m, lo, hi = end - f.token_start, f.token_start - start, end - start
        keys[f.layer_start : f.layer_end, lo:hi] = f.keys[:, :m]
        values[f.layer_start : f.layer_end, lo:hi] = f.values[:, :m]
        ids[lo:hi] = f.token_ids[:m].tolist()
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


class SequenceAdapter(ABC):
    """Bookkeeping shared by adapters that keep their own token list (fake, torch, onnx), and
    `token_bytes`'s default (from each adapter's own `detokenize`)."""

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

    @abstractmethod
    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of `tokens` (`KVAdapter.detokenize`)."""

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 of the token's text (`KVAdapter.token_bytes`)."""
        return self.detokenize([int(token)]).encode("utf-8")

    def generate(self, logits: np.ndarray, max_tokens: int, *, temperature: float = 0.0,
                 seed: int = 0, keep_logits: bool = False, top_p: float = 1.0,
                 on_token: TokenCallback | None = None,
                 constraint: Constraint | None = None,
                 speculation: Speculation | None = None) -> Generation:
        return sample_loop(self, logits, max_tokens, temperature=temperature, seed=seed,  # type: ignore[arg-type]
                           keep_logits=keep_logits, top_p=top_p, on_token=on_token,
                           constraint=constraint, speculation=speculation)
