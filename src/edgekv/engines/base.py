"""The `KVAdapter` protocol and the value types it speaks in (`FragmentSpec`, `Generation`,
`EngineCounters`); what adapters share in code is in `shared.py`.

The protocol: the seed's six operations, plus what prefill reuse needs.

Seed (EdgeSync-LLM): ExtractFragment / InjectFragment / Generate / Tokenize / ClearKVCache /
Close. EdgeKV adds `prefill` (evaluate tokens after what the engine holds) because reuse means
"inject a prefix, then compute only the rest", and `fingerprint`, which binds KV to a model.

Prefill is *aligned*: tokens are evaluated in batches whose boundaries fall on multiples of
`align` (the cache's chunk size) in absolute position. The KV of chunk i is then computed by
the same batch of the same shape whether the request was cold or warm, so strict reuse gives
the same numbers as a cold run instead of "close enough".

Capabilities beyond the protocol are explicit protocols too, each checked once, by
`isinstance`, by whoever needs it, when it is constructed (never probed with `getattr`):

- `ShiftableKV`: the adapter can place cached KV at another position (RoPE re-rotation), which
  passage reuse needs; its `passage_engine()` builds a `PassageEngine` or raises
  `UnsupportedLayout` with the model's reason (llama.cpp).
- `WindowedKV`: the adapter knows each layer's attention span (`window`, a `WindowLayout`); a
  hit then reads only the last window of sliding-window layers (llama.cpp).
- `DraftVerifier`: the adapter evaluates several tokens with every position's logits and drops
  cells from the end, so drafts can be verified in one batch (`spec`; llama.cpp, its slots and
  the fake engine).
- `SharedCPU`: the adapter's steps share the CPU with its caller's threads; `aside()` marks
  the caller's own work beside them, which the steps plan for (a server's slots).
- `ModelFile`: the adapter runs a model file (`model_path`), whose stem names the served model
  (llama.cpp, torch, onnx; not the fake engine).

Every adapter has `n_vocab` (token ids are checked against it) and `token_bytes(token)` (a
token's bytes, for streaming text that splits a UTF-8 character), besides `chat_template()`.
`SequenceAdapter` (shared.py) gives `token_bytes` its default: the detokenized text's UTF-8.
The capability protocols are `runtime_checkable`: structural, like `KVAdapter` (a test's
adapter has a capability by having its members); the engines that have one also name it
among their bases, so the type checker holds them to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from ..fragment import KVFragment
from ..keys import ModelFingerprint
from .window import WindowLayout

if TYPE_CHECKING:
    from .constraint import Constraint
    from .spec import Speculation

__all__ = ["DraftVerifier", "EngineCounters", "FragmentSpec", "Generation", "KVAdapter", "KVRun",
           "KernelSettings", "ModelFile", "PassageEngine", "SharedCPU", "ShiftableKV",
           "TokenCallback", "Twinned", "WindowedKV"]


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
    # speculative decoding (`spec.speculative_loop`): drafted tokens verified, and how many of
    # them the answer took; 0 and 0 for plain decoding
    drafted: int = 0
    accepted: int = 0

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
    # bytes of weights a forward batch streams (the model file, or the de-quantized tensors):
    # the memory-traffic count in `EngineCounters.traffic_bytes`
    weight_bytes: int
    # threads the engine computes with (recorded beside every measurement)
    n_threads: int

    @property
    def n_tokens(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def eos_token(self) -> int: ...

    @property
    def n_vocab(self) -> int:
        """The vocabulary size: every token id is in [0, n_vocab)."""
        ...

    def build_info(self) -> str:
        """What the engine's numerics depend on beyond the model: build, kernels, threads,
        attention path. The batch-invariance probe's answer is recorded under it."""
        ...

    def chat_template(self) -> str | None:
        """The model's chat template (Jinja, from the GGUF), None if it has none."""
        ...

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        """`text`'s token ids. `special=True` turns the text of a control token
        (`<|im_start|>`) into that token, as a raw prompt wants; `special=False` keeps all of
        it text, as a chat message's contents must stay (`chat.ChatTokenizer`)."""
        ...

    def control_tokens(self) -> Mapping[str, int]:
        """The texts that `tokenize(special=True)` turns into control tokens (and only it),
        with their ids: what a chat template's markers may be, and message text never."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes:
        """One token's bytes (llama.cpp: its piece, which may be half a UTF-8 character;
        elsewhere the UTF-8 of its text), so streamed text is decoded across tokens."""
        ...

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

    def append_fragments(self, fragments: Sequence[KVFragment]) -> int:
        """Extend the context with fragments that cover [n_tokens, end) with every layer
        (e.g. chunks streamed from a KV server after chunks computed here): what the engine
        holds stays as it is. Return the new length; refused (IncompatibleFragment) without
        touching the context if they do not continue it."""
        ...

    def generate(self, logits: np.ndarray, max_tokens: int, *, temperature: float = 0.0,
                 seed: int = 0, keep_logits: bool = False, top_p: float = 1.0,
                 on_token: TokenCallback | None = None,
                 constraint: Constraint | None = None,
                 speculation: Speculation | None = None) -> Generation:
        """Sample up to `max_tokens` from `logits` on (`shared.sample_loop`); `constraint`
        masks each step's logits (a grammar, `engines.constraint`), never the KV;
        `speculation`: verify n-gram drafts in one batch where the adapter is a
        `DraftVerifier` (`spec.speculative_loop`: the same tokens, fewer steps)."""
        ...

    def close(self) -> None: ...


# -- capabilities beyond the protocol (module doc) -----------------------------------------


class KVRun(Protocol):
    """A run of a request's tokens for `PassageEngine.build`: cached KV, K already moved to
    its new position, to restore, or, with `keys` None, tokens to compute
    (`passages.PlacedRun`)."""

    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def keys(self) -> np.ndarray | None: ...  # [layer, token, n_embd_k]

    @property
    def values(self) -> np.ndarray | None: ...


class PassageEngine(Protocol):
    """What a `ShiftableKV` adapter offers passage reuse (`llamacpp_shift.LlamaCppPassages`)."""

    # state restores done so far (each copies the whole context): reported per request
    restores: int

    def shift_keys(self, keys: np.ndarray, delta: int) -> np.ndarray:
        """`keys[layer, token, width]` moved by `delta` positions."""
        ...

    def build(self, runs: Sequence[KVRun]) -> int:
        """Extend the context by `runs` in order; return its new length."""
        ...

    def layer_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V [token, width] of one layer of what the engine holds."""
        ...


@runtime_checkable
class ShiftableKV(Protocol):
    """The adapter can place cached KV at another position (K re-rotated: RoPE shift)."""

    def passage_engine(self) -> PassageEngine:
        """The engine side of passage reuse; raises UnsupportedLayout with the reason where
        this model's KV cannot be moved (sliding-window layers, M-RoPE, scaled RoPE)."""
        ...


@runtime_checkable
class KernelSettings(Protocol):
    """The adapter reports the kernel settings its exactness depends on (llama.cpp): whether
    its build's batch-invariant kernels are on, and whether flash attention runs."""

    batch_invariant: bool

    @property
    def flash_attn(self) -> bool: ...


@runtime_checkable
class DraftVerifier(Protocol):
    """The adapter can evaluate several tokens in one batch with the logits of every position,
    and drop cells from the end: what exact speculative decoding needs (`spec`)."""

    def verify(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """Evaluate `tokens` after the context in one batch; the logits at each of them."""
        ...

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens' cells, drop the rest (rejected drafts leave no trace)."""
        ...


@runtime_checkable
class SharedCPU(Protocol):
    """The adapter's computation shares the CPU with its caller's threads (a server's slot,
    whose steps the other slots' generations ride in): `aside` marks a stretch of the
    caller's own CPU work beside it (the cache's lookup and injection, its stores), so the
    engine plans its steps for the slower cores meanwhile."""

    def aside(self) -> AbstractContextManager[None]:
        """A context manager around the caller's work."""
        ...


@runtime_checkable
class WindowedKV(Protocol):
    """The adapter knows which layers attend through a sliding window, and how far."""

    # each layer's attention span (no sliding-window layers: every layer global)
    window: WindowLayout


@runtime_checkable
class Twinned(Protocol):
    """The adapter can open a second context of its model with its own settings, for work
    beside the one it serves (the probe's later stages, `engines.probe.finish_later`)."""

    def twin(self) -> KVAdapter:
        """A new adapter over the same model, build and settings; the caller closes it."""
        ...


@runtime_checkable
class ModelFile(Protocol):
    """The adapter runs a model file; its stem is the model's name where none is given."""

    model_path: Path
