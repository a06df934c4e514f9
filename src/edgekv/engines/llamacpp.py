"""llama.cpp adapter (llama-cpp-python), through public API only: `Llama` and its `ctx`.

KV leaves and enters llama.cpp as a `llama_state_seq_*` blob; `llamacpp_state` slices it into
token x layer fragments and assembles fragments back into a blob llama.cpp restores with its
cell bookkeeping (positions, sequence ids) intact. Nothing is written behind llama.cpp's back.

What is used, and why: the high-level `Llama` loads the model, tokenizes and evaluates
(`eval`), and its public `input_ids` / `n_tokens` are kept in step with the engine after an
injection. KV and logits go through llama-cpp-python's low-level C bindings on `Llama.ctx`
(`llama_state_seq_get/set_data`, `llama_memory_clear`, `llama_get_logits`): `Llama` keeps no
logits unless it was built with `logits_all=True` (which costs a full vocabulary row per
prompt token), and `Llama.eval` does not return them, so the last token's logits are read
from the context right after `eval`.

The adapter's public llama.cpp surface, which the rest of EdgeKV (passage placement in
`llamacpp_shift`, the batch-invariance probe) uses instead of its llama.cpp objects:
`read_state` / `read_state_blob` (the sequence's KV), `restore_cells` (the one state restore:
injection, append and passage placement all write through it), `rope_info` (how the model
rotates K), `decode` (a raw batch at chosen positions and sequence ids), `shift_cells`
(llama.cpp's own K-shift), `sequence_context` (a second context of the same model for several
sequences), `library_dir` (the native build loaded), and `verify` / `truncate` (drafted tokens
in one batch with every position's logits, and their cells removed again: `spec`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from ..errors import EngineError, IncompatibleFragment, UnsupportedLayout
from ..fragment import KVFragment
from ..keys import ModelFingerprint, file_sha256
from .base import (
    EngineCounters,
    FragmentSpec,
    Generation,
    ModelFile,
    ShiftableKV,
    TokenCallback,
    Twinned,
    WindowedKV,
)
from .constraint import Constraint, Grammar
from .llamacpp_shift import LlamaCppPassages, RopeInfo
from .llamacpp_state import CellBlock, SeqState, SeqStateWriter, parse_seq_state
from .models import resolve_model
from .shared import (
    aligned_batches,
    append_length,
    build_fragments,
    check_prefill,
    injection_length,
    sample_loop,
)
from .spec import Speculation
from .window import window_layout

__all__ = ["BatchItem", "LlamaCppAdapter", "SequenceContext"]

log = logging.getLogger(__name__)
_KV_TYPES = {0: "f32", 1: "f16"}
# Gemma's turn format (the chat template of Google's Gemma 3 tokenizer_config.json, and
# llama.cpp's built-in "gemma" template): the system message opens the first user turn, the
# assistant's role is "model"
_GEMMA_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{{ bos_token }}"
    "{%- for m in turns -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ (first if loop.first else '') + (m['content'] | trim) + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
_FAMILY_TEMPLATES = {"gemma3": _GEMMA_TEMPLATE}


# one token of a raw batch: (token, position, sequence id, wants its logits)
BatchItem = tuple[int, int, int, bool]


def _decode(lib: Any, ctx: Any, items: Sequence[BatchItem], n_vocab: int) -> list[np.ndarray]:
    """`llama_decode` of one batch; the logits of the items that asked for them (copies)."""
    n_seq = max((seq for _, _, seq, _ in items), default=0) + 1
    batch = lib.llama_batch_init(max(1, len(items)), 0, n_seq)
    try:
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, want) in enumerate(items):
            batch.token[i] = int(tok)
            batch.pos[i] = int(pos)
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = int(seq)
            batch.logits[i] = 1 if want else 0
        if (rc := lib.llama_decode(ctx, batch)) != 0:
            raise EngineError(f"llama_decode returned {rc}")
        return [np.array(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i),
                                               shape=(n_vocab,)), dtype=np.float32, copy=True)
                for i, (_, _, _, want) in enumerate(items) if want]
    finally:
        lib.llama_batch_free(batch)


def _read_state(lib: Any, ctx: Any, seq: int) -> ctypes.Array[ctypes.c_uint8]:
    """Sequence `seq`'s state blob (`llama_state_seq_get_data`) in a new buffer. The buffer is
    not zeroed first (numpy.empty, not a ctypes array's memset): a blob is tens of MB at a
    few thousand tokens, and on a server's slots the copy holds the context every slot
    decodes in, so its pages are touched once, by llama.cpp's copy."""
    size = lib.llama_state_seq_get_size(ctx, seq)
    buf = (ctypes.c_uint8 * size).from_buffer(np.empty(size, np.uint8))
    written = lib.llama_state_seq_get_data(ctx, buf, size, seq)
    if written != size:
        raise EngineError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
    return buf


class SequenceContext:
    """A second llama.cpp context over the adapter's model, for several sequences at once
    (`LlamaCppAdapter.sequence_context`); freed by `close` or on leaving a `with` block."""

    def __init__(self, lib: Any, ctx: Any, n_vocab: int) -> None:
        self._lib, self._ctx, self.n_vocab = lib, ctx, n_vocab

    def decode(self, items: Sequence[BatchItem]) -> list[np.ndarray]:
        """One batch (`BatchItem`s, any sequence ids below the context's n_seq_max); the
        logits of the items that asked for them."""
        return _decode(self._lib, self._open(), items, self.n_vocab)

    def read_state(self, seq: int) -> ctypes.Array[ctypes.c_uint8]:
        """Sequence `seq`'s state blob (`llama_state_seq_get_data`), a copy."""
        return _read_state(self._lib, self._open(), seq)

    def write_state(self, seq: int, blob: bytearray | ctypes.Array[ctypes.c_uint8]) -> None:
        """Replace sequence `seq` with the blob's cells; if llama.cpp refuses it the sequence
        is left empty and EngineError raised."""
        ctx = self._open()
        src = (ctypes.c_uint8 * len(blob)).from_buffer(blob)
        read = self._lib.llama_state_seq_set_data(ctx, src, len(blob), seq)
        if read != len(blob):
            self.remove(seq)
            raise EngineError(f"llama.cpp refused the assembled state of sequence {seq} "
                              f"({read} of {len(blob)} bytes read); it is cleared")

    def remove(self, seq: int, start: int = 0) -> None:
        """Drop the cells of sequence `seq` from position `start` on, by default every one
        (`llama_memory_seq_rm`)."""
        lib = self._lib
        lib.llama_memory_seq_rm(lib.llama_get_memory(self._open()), seq,
                                start if start > 0 else -1, -1)

    def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            self._lib.llama_free(ctx)

    def _open(self) -> Any:
        if self._ctx is None:
            raise EngineError("the sequence context is closed")
        return self._ctx

    def __enter__(self) -> SequenceContext:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# EdgeKV's engine is llama.cpp with patches/llama.cpp applied (`make setup` builds it): with its
# batch-invariant mode on (the adapter sets it when it opens a model, unless
# GGML_CPU_BATCH_INVARIANT=0 says otherwise) its CPU kernels compute a token alike whatever batch
# it sits in, with llamafile and flash attention on. A library built without the patches has no
# such mode.
_CPU_BACKEND = ("libggml-cpu.so", "libggml-cpu.dylib", "ggml-cpu.dll")
SWITCH_ENV = "GGML_CPU_BATCH_INVARIANT"


def _import_llama() -> Any:
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise EngineError(
            "llama-cpp-python is not installed: run `make setup` (it builds it with the CPU "
            "flags this machine needs) or `pip install 'edgekv[llamacpp]'`") from e
    _quiet_in_place(llama_cpp)
    return llama_cpp


class _Unredirected:
    """Stands in for llama-cpp-python's `suppress_stdout_stderr`, which points the process's
    file descriptors 1 and 2 at /dev/null while a `Llama` loads its model (verbose=False): in
    a server, whatever any other thread writes meanwhile is lost. A probe loading its second
    context beside a starting kv-server swallowed the "listening on" line its parent waited
    for. llama.cpp's own messages go through the log callback (`_llama_log`) instead."""

    def __init__(self, disable: bool = True) -> None:
        pass

    def __enter__(self) -> _Unredirected:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_GGML_LOG_ERROR, _GGML_LOG_CONT = 4, 5  # ggml.h's enum ggml_log_level
_log_state = {"last": 0}


def _llama_log(level: int, text: bytes | None, _user_data: object) -> None:
    """llama.cpp's messages: its errors to stderr, the rest only where a `Llama` was made with
    verbose=True (llama-cpp-python's own callback maps the levels of an older ggml, so its
    warnings passed as errors and its info was dropped only by the redirect)."""
    if level == _GGML_LOG_CONT:
        level = _log_state["last"]
    _log_state["last"] = level
    verbose = logging.NOTSET < logging.getLogger("llama-cpp-python").level <= logging.DEBUG
    if text and (level >= _GGML_LOG_ERROR or verbose):
        sys.stderr.write(text.decode("utf-8", errors="replace"))


_callback: list[Any] = []  # the ctypes callback, kept alive for as long as llama.cpp holds it


def _quiet_in_place(llama_cpp: Any) -> None:
    """Once per process: llama.cpp's messages through `_llama_log`, and no fd redirect."""
    if _callback:
        return
    import importlib

    for name in ("llama_cpp.llama", "llama_cpp._internals", "llama_cpp.llama_chat_format"):
        module = importlib.import_module(name)  # imported with llama_cpp: found, not loaded
        if hasattr(module, "suppress_stdout_stderr"):
            setattr(module, "suppress_stdout_stderr", _Unredirected)  # noqa: B010
    _callback.append(llama_cpp.llama_log_callback(_llama_log))
    llama_cpp.llama_log_set(_callback[0], ctypes.c_void_p(0))


def wants_invariant_kernels() -> bool:
    """EdgeKV's default is on; GGML_CPU_BATCH_INVARIANT=0 keeps the stock kernels."""
    return os.environ.get(SWITCH_ENV, "1").strip() != "0"


def batch_invariant_kernels(lib_dir: Path | None) -> bool:
    """Switch the CPU backend in `lib_dir` to the patch series' batch-invariant kernels (unless
    GGML_CPU_BATCH_INVARIANT=0) and say whether it runs them. The series' run-time setter
    (patch 0008, `ggml_cpu_set_batch_invariant`) sets the mode whatever the backend read from
    the environment when it started, so a program that loaded llama.cpp before EdgeKV still
    gets exact reuse, and the environment is left alone (child processes keep stock kernels).
    The mode is one flag of the process's backend: a `Llama` made in the same process runs
    the same kernels. A build of the series before the setter only read the variable when it
    started; one without the series has no mode (False)."""
    path = _cpu_backend(lib_dir) if lib_dir is not None else None
    if path is None:
        return False
    try:  # the copy llama_cpp loaded: dlopen of the same file returns its handle
        lib = ctypes.CDLL(str(path))
    except OSError:
        return False
    if not hasattr(lib, "ggml_cpu_batch_invariant"):
        return False
    if hasattr(lib, "ggml_cpu_set_batch_invariant"):
        lib.ggml_cpu_set_batch_invariant.argtypes = [ctypes.c_bool]
        lib.ggml_cpu_set_batch_invariant(wants_invariant_kernels())
    else:
        lib.ggml_cpu_init()  # idempotent: reads the switch only the first time
    lib.ggml_cpu_batch_invariant.restype = ctypes.c_bool
    return bool(lib.ggml_cpu_batch_invariant())


def _cpu_backend(lib_dir: Path) -> Path | None:
    """The CPU backend file of `lib_dir` that this process has loaded (the wheel ships its
    libraries as separate copies under each name, libggml-cpu.so and libggml-cpu.so.0, and
    opening another name would load a second, separate backend), else the first that exists."""
    folder = lib_dir.resolve()
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                f = Path(line.rsplit(None, 1)[-1])
                if f.name.startswith(("libggml-cpu.", "ggml-cpu.")) and f.parent == folder:
                    return f
    except OSError:  # no /proc (macOS)
        pass
    return next((lib_dir / n for n in _CPU_BACKEND if (lib_dir / n).exists()), None)


class LlamaCppAdapter(ShiftableKV, WindowedKV, ModelFile, Twinned):
    """One llama.cpp context over one model, holding one sequence (seq 0)."""

    def __init__(self, model_path: str | Path | None = None, *, n_ctx: int = 2048,
                 n_threads: int | None = None, memo_dir: Path | None = None,
                 **llama_kwargs: Any) -> None:
        """`llama_kwargs` go to `llama_cpp.Llama` (e.g. `flash_attn=True`, `type_k=...`).

        Flash attention is on by default where the library runs the batch-invariant kernels
        (`batch_invariant_kernels`): they make it exact at any batch, and it is the faster
        path; elsewhere it is off (stock flash attention sums a lone row in another order
        than a batch's), unless `flash_attn` says otherwise."""
        self._lib = lib = _import_llama()
        self.model_path = resolve_model(model_path, memo_dir)
        self._opened = (n_ctx, n_threads, memo_dir, dict(llama_kwargs))  # for `twin`
        self.n_threads = n_threads or os.cpu_count() or 1
        self.batch_invariant = batch_invariant_kernels(self.library_path())
        if llama_kwargs.get("flash_attn") is None:
            llama_kwargs["flash_attn"] = self.batch_invariant
        try:
            self._llm = lib.Llama(
                str(self.model_path), n_ctx=n_ctx, n_batch=2048, n_ubatch=512,
                n_threads=self.n_threads, n_threads_batch=self.n_threads, verbose=False,
                logits_all=False, **llama_kwargs)
        except (ValueError, RuntimeError) as e:
            raise EngineError(f"llama.cpp could not load {self.model_path}: {e}") from e
        self._ctx = self._llm.ctx  # the llama_context the C bindings take
        self.n_vocab = int(self._llm.n_vocab())
        self._controls: dict[str, int] | None = None  # control_tokens(), read once
        self._grammar_blocked: np.ndarray | None = None  # grammar_constraint(), read once
        try:
            self.fingerprint = self._make_fingerprint(memo_dir)
            self.window = window_layout(self._llm.metadata, self.fingerprint.n_layer)
        except UnsupportedLayout:
            self.close()
            raise
        # llama-cpp-python's default: the SWA cache keeps every cell, so the whole-cache state
        # (seq -1) holds the local layers' KV of every position, for any later window
        self.swa_full = bool(getattr(self._llm.context_params, "swa_full", True))
        self.counters = EngineCounters()
        self.weight_bytes = self.model_path.stat().st_size  # streamed once per forward batch
        # learnt from a one-token state, which also proves the blob parses as this model's
        # layout: a GGUF whose state EdgeKV cannot read is refused here, never half-used
        self._v_trans: bool | None = None
        # local layers hold real KV from this position on (an injection leaves the cells
        # before its last window zero); never extracted below it
        self._swa_from = 0
        try:
            self._v_trans = self._probe_v_trans()
        except UnsupportedLayout:
            self.close()
            raise

    # -- identity ------------------------------------------------------------------------

    def _make_fingerprint(self, memo_dir: Path | None) -> ModelFingerprint:
        md = self._llm.metadata
        arch = md.get("general.architecture", "unknown")

        def meta(name: str, default: int | None = None) -> int:
            v = md.get(f"{arch}.{name}")
            if v is None:
                if default is None:
                    raise UnsupportedLayout(f"GGUF metadata lacks {arch}.{name}")
                return default
            return int(float(v))

        n_head = meta("attention.head_count")
        head_dim = meta("embedding_length") // n_head
        kv_type = self._llm.context_params.type_k
        if kv_type != self._llm.context_params.type_v or kv_type not in _KV_TYPES:
            raise UnsupportedLayout(
                f"KV cache types K={kv_type} V={self._llm.context_params.type_v}; EdgeKV "
                "needs f16 or f32 for both")
        return ModelFingerprint(
            file_sha256=file_sha256(self.model_path, memo_dir),
            architecture=arch,
            n_layer=meta("block_count"),
            n_head_kv=meta("attention.head_count_kv", n_head),
            head_dim_k=meta("attention.key_length", head_dim),
            head_dim_v=meta("attention.value_length", head_dim),
            kv_dtype=_KV_TYPES[kv_type],
            engine=f"llama.cpp/{self._lib.__version__}",
            rope=f"base={float(md.get(f'{arch}.rope.freq_base', 10000.0)):g},"
                 f"dims={meta('rope.dimension_count', head_dim)}",
        )

    # -- state ---------------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        return int(self._llm.n_tokens)

    @property
    def token_ids(self) -> list[int]:
        return [int(t) for t in self._llm.input_ids[: self._llm.n_tokens]]

    @property
    def n_ctx(self) -> int:
        return int(self._llm.n_ctx())

    @property
    def eos_token(self) -> int:
        return int(self._llm.token_eos())

    def build_info(self) -> str:
        """The kernels compiled in (llama_print_system_info), the attention path and threads."""
        system = self._lib.llama_print_system_info()
        system = system.decode("utf-8", "replace") if isinstance(system, bytes) else str(system)
        p = self._llm.context_params
        return (f"llama.cpp/{self._lib.__version__} [{' '.join(system.split())}] "
                f"flash_attn_type={int(p.flash_attn_type)} type_k={int(p.type_k)} "
                f"n_ubatch={int(p.n_ubatch)} threads={self.n_threads}")

    def chat_template(self) -> str | None:
        """The GGUF's template; for an architecture whose GGUF was converted without one (the
        packaged Gemma 3 270M), the model family's own turn format (`_FAMILY_TEMPLATES`)."""
        tpl = self._llm.metadata.get("tokenizer.chat_template")
        if tpl:
            return str(tpl)
        return _FAMILY_TEMPLATES.get(self.fingerprint.architecture)

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def control_tokens(self) -> dict[str, int]:
        """Tokens llama.cpp parses from text only with `special=True`: CONTROL and UNKNOWN
        attributes (`llama_vocab::tokenizer_st_partition`; USER_DEFINED ones are parsed either
        way). Read from the vocabulary once."""
        if self._controls is None:
            lib = self._lib
            vocab = lib.llama_model_get_vocab(self._llm.model)
            wanted = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_UNKNOWN
            found: dict[str, int] = {}
            for i in range(self.n_vocab):
                if lib.llama_vocab_get_attr(vocab, i) & wanted:
                    text = lib.llama_vocab_get_text(vocab, i)
                    if text:
                        found.setdefault(bytes(text).decode("utf-8", "replace"), i)
            self._controls = found
        return self._controls

    def detokenize(self, tokens: Sequence[int]) -> str:
        return bytes(self._llm.detokenize(list(tokens))).decode("utf-8", errors="replace")

    def clear_kv_cache(self) -> None:
        self._swa_from = 0
        self._llm.reset()
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx), True)

    def prefill(self, tokens: Sequence[int], *, align: int) -> np.ndarray:
        check_prefill(self.n_tokens, len(tokens), self.n_ctx)
        toks = list(tokens)
        base = self.n_tokens
        for lo, hi in aligned_batches(base, len(toks), align):
            self._llm.eval(toks[lo - base : hi - base])
            self.counters.add_batch(lo, hi)
        logits = np.ctypeslib.as_array(self._lib.llama_get_logits(self._ctx),
                                        shape=(self.n_vocab,))
        return np.array(logits, dtype=np.float32, copy=True)

    def verify(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """`base.DraftVerifier`: `tokens` after the context in one batch (`decode`), the
        logits of every position; the token bookkeeping follows, as after `prefill`."""
        check_prefill(self.n_tokens, len(tokens), self.n_ctx)
        base = self.n_tokens
        out = _decode(self._lib, self._ctx, [(t, base + i, 0, True)
                                             for i, t in enumerate(tokens)], self.n_vocab)
        self._llm.input_ids[base : base + len(tokens)] = list(tokens)
        self._llm.n_tokens = base + len(tokens)
        self.counters.add_batch(base, base + len(tokens))
        return out

    def truncate(self, n: int) -> None:
        """`base.DraftVerifier`: remove the cells of positions n.. (`llama_memory_seq_rm`)."""
        if not 0 <= n <= self.n_tokens:
            raise EngineError(f"cannot keep {n} of {self.n_tokens} tokens")
        lib = self._lib
        if not lib.llama_memory_seq_rm(lib.llama_get_memory(self._ctx), 0, n, -1):
            raise EngineError(f"llama.cpp could not remove the cells from position {n}")
        self._llm.n_tokens = n

    def generate(self, logits: np.ndarray, max_tokens: int, *, temperature: float = 0.0,
                 seed: int = 0, keep_logits: bool = False, top_p: float = 1.0,
                 on_token: TokenCallback | None = None,
                 constraint: Constraint | None = None,
                 speculation: Speculation | None = None) -> Generation:
        return sample_loop(self, logits, max_tokens, temperature=temperature, seed=seed,
                           keep_logits=keep_logits, top_p=top_p, on_token=on_token,
                           constraint=constraint, speculation=speculation)

    def grammar_constraint(self, grammar: Grammar) -> Constraint:
        """`constraint.GrammarEngine`: llama.cpp's grammar sampler over this vocabulary."""
        from .llamacpp_grammar import LlamaGrammarConstraint, blocked_tokens

        if self._grammar_blocked is None:
            self._grammar_blocked = blocked_tokens(self._lib, self._llm.model, self.n_vocab,
                                                   self.eos_token)
        return LlamaGrammarConstraint(self._lib, self._llm.model, grammar,
                                      n_vocab=self.n_vocab, blocked=self._grammar_blocked)

    def token_bytes(self, token: int) -> bytes:
        """The token's piece as bytes (half a UTF-8 character, where it holds one)."""
        return bytes(self._llm.detokenize([int(token)]))

    # -- fragments -----------------------------------------------------------------------

    def _state_buffer(self) -> ctypes.Array[ctypes.c_uint8]:
        """The sequence's state blob. With sliding-window layers, the whole cache's (seq -1:
        the only sequence here is 0): per sequence, llama.cpp leaves out the local layers'
        cells outside the last window, which older chunks' fragments need."""
        return _read_state(self._lib, self._ctx, -1 if self.window.swa_layers else 0)

    def read_state(self, buf: ctypes.Array[ctypes.c_uint8] | None = None) -> SeqState:
        """The engine's sequence as canonical keys/values (views into one copied blob: `buf`
        if given, as `_state_buffer` returned it)."""
        fp = self.fingerprint
        buf = self._state_buffer() if buf is None else buf
        state = parse_seq_state(memoryview(buf), n_layer=fp.n_layer, n_embd_k=fp.n_embd_k,
                                n_embd_v=fp.n_embd_v, swa_layers=self.window.swa_layers)
        if state.n_tokens != self.n_tokens:
            raise UnsupportedLayout(f"engine state holds {state.n_tokens} cells for "
                                    f"{self.n_tokens} evaluated tokens (SWA or context shift)")
        if state.n_tokens:  # an empty state says nothing about the V layout
            self._v_trans = state.v_trans
        return state

    def read_state_blob(self) -> bytes:
        return bytes(self._state_buffer())

    def extract_fragments(self, specs: Sequence[FragmentSpec]) -> list[KVFragment]:
        if not specs:
            return []
        below = [s for s in specs if s.token_start < self._swa_from]
        if below and self.window.swa_layers:
            raise EngineError(
                f"tokens [{below[0].token_start}, {below[0].token_end}) were injected without "
                f"their sliding-window layers (held only from {self._swa_from}); not extracted")
        state = self.read_state()
        try:
            return build_fragments(specs, self.fingerprint, self.token_ids, state.layer_kv)
        except UnsupportedLayout as e:  # a local layer's old cells are gone (swa_full=False)
            raise EngineError(f"cannot extract {specs[0].token_start}..: {e}") from e

    def inject_fragments(self, fragments: Sequence[KVFragment], limit: int | None = None) -> int:
        n = injection_length(fragments, self.fingerprint, limit, self.window)
        if n > self.n_ctx:
            raise IncompatibleFragment(f"prefix of {n} tokens exceeds the context ({self.n_ctx})")
        return self.restore_cells(fragments, n)

    def append_fragments(self, fragments: Sequence[KVFragment]) -> int:
        """llama.cpp restores a sequence whole (`llama_state_seq_set_data`), so the held cells
        are copied from the engine's own state blob into the new one, beside the fragments;
        if llama.cpp refuses the new blob, the old one is restored."""
        held = self.n_tokens
        end = append_length(fragments, self.fingerprint, held, self.n_ctx)
        if not held:
            return self.inject_fragments(fragments)
        old = self._state_buffer()
        state, ids = self.read_state(old), self.token_ids
        try:
            return self.restore_cells(fragments, end, keep=state)
        except EngineError:
            read = self._lib.llama_state_seq_set_data(self._ctx, old, len(old), 0)
            if read == len(old):
                self._llm.input_ids[:held] = ids
                self._llm.n_tokens = held
            raise

    def restore_cells(self, blocks: Sequence[CellBlock], n: int, *,
                      keep: SeqState | None = None) -> int:
        """Replace the sequence with cells 0..n-1: the cells of `keep` first (what the engine
        holds, as `read_state` returned it, with its token ids), then the blocks' cells (a
        `KVFragment` is a block), written straight into the blob llama.cpp reads
        (`assemble_cells`); blocks past n are cut. Returns n. If llama.cpp refuses the blob
        the context is cleared and EngineError raised. Every state restore of the adapter
        goes through here (injection, append, passage placement)."""
        blob, ids = self.assemble_cells(blocks, n, keep=keep,
                                        keep_ids=None if keep is None else self.token_ids)
        self.clear_kv_cache()
        src = (ctypes.c_uint8 * len(blob)).from_buffer(blob)
        read = self._lib.llama_state_seq_set_data(self._ctx, src, len(blob), 0)
        if read != len(blob):
            self.clear_kv_cache()
            raise EngineError(f"llama.cpp refused the assembled state ({read} of {len(blob)} "
                              "bytes read); the context is cleared, prefill will recompute")
        self._llm.input_ids[:n] = ids
        self._llm.n_tokens = n
        win = self.window
        if win.swa_layers:
            self._swa_from = win.needed_from(win.swa_layers[0], n)
        return n

    def assemble_cells(self, blocks: Sequence[CellBlock], n: int, *,
                       keep: SeqState | None = None, keep_ids: Sequence[int] | None = None,
                       seq_id: int = 0, n_stream: int = 1) -> tuple[bytearray, np.ndarray]:
        """The state blob of one sequence holding cells 0..n-1, and their token ids: the
        cells of `keep` (with its `keep_ids`) first, then the blocks', cut at n; for sequence
        `seq_id` of a context with `n_stream` KV streams (`llamacpp_slots`). Nothing in the
        context changes.

        Local (sliding-window) layers get only the last window, [n - n_swa, n): that is all the
        tokens after n attend to. With `swa_full` their cache still gets cells for every
        position, the older ones left zero: they are masked (-inf before the softmax, so they
        weigh exactly 0), and the cells sit where a cold run puts them, so attention sums in
        the same order as cold."""
        fp, win = self.fingerprint, self.window
        if keep is not None and keep.n_tokens:
            v_trans = keep.v_trans
        else:
            v_trans = self._v_trans if self._v_trans is not None else self._probe_v_trans()
        swa_start = 0 if self.swa_full else max(0, n - win.n_swa)
        sections = ([(win.global_layers, 0), (win.swa_layers, swa_start)] if win.swa_layers
                    else None)
        writer = SeqStateWriter(fp.n_layer, n, fp.n_embd_k, fp.n_embd_v,
                                np.dtype(np.float16 if fp.kv_dtype == "f16" else np.float32),
                                v_trans=v_trans, seq_id=seq_id, n_stream=n_stream,
                                sections=sections)

        def put(layer: int, lo: int, k: np.ndarray, v: np.ndarray) -> None:
            need = win.needed_from(layer, n)
            if need > lo:  # before the window: not needed
                k, v, lo = k[need - lo :], v[need - lo :], need
            at = lo - writer.start(layer)
            writer.k(layer)[at : at + len(k)] = k
            writer.v(layer)[at : at + len(v)] = v

        ids = np.empty(n, np.int32)
        if keep is not None:
            m = keep.n_tokens
            if keep_ids is None or len(keep_ids) < m:
                raise EngineError(f"the {m} cells kept need their token ids")
            ids[:m] = keep_ids[:m]
            for layer in range(fp.n_layer):
                lo = min(m, win.needed_from(layer, n))
                put(layer, lo, *keep.layer_kv(layer, slice(lo, m)))
        for f in blocks:
            if f.token_start >= n:
                continue
            end = min(f.token_end, n)
            m = end - f.token_start
            ids[f.token_start : end] = f.token_ids[:m]
            for i, layer in enumerate(f.layer_indices):
                put(layer, f.token_start, f.keys[i, :m], f.values[i, :m])
        return writer.blob, ids

    def _probe_v_trans(self) -> bool:
        """Learn whether llama.cpp stores V transposed by writing a one-token state."""
        saved = self.token_ids
        self.clear_kv_cache()
        bos = self._llm.token_bos()
        self._llm.eval([bos if bos >= 0 else 0])
        try:
            v_trans = self.read_state().v_trans
        except UnsupportedLayout as e:
            self.clear_kv_cache()
            raise UnsupportedLayout(
                f"{self.model_path.name} ({self.fingerprint.architecture}): llama.cpp's KV state "
                f"for this model is not in a layout EdgeKV understands ({e}); KV reuse is "
                "refused for it (run it with llama.cpp directly)") from e
        self.clear_kv_cache()
        if saved:
            log.debug("v_trans probe cleared a context of %d tokens", len(saved))
        return v_trans

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.close()

    # -- the public llama.cpp surface beyond KVAdapter (module doc) ------------------------

    def twin(self) -> LlamaCppAdapter:
        """`Twinned`: another context of this model (its weights mapped once), opened with
        the same settings, so what runs there computes what this one would."""
        n_ctx, n_threads, memo_dir, kwargs = self._opened
        return LlamaCppAdapter(self.model_path, n_ctx=n_ctx, n_threads=n_threads,
                               memo_dir=memo_dir, **kwargs)

    def passage_engine(self) -> LlamaCppPassages:
        """`ShiftableKV`: passage reuse's engine side (`llamacpp_shift.LlamaCppPassages`): K
        re-rotated to new positions, contexts built from cached and computed runs. Raises
        UnsupportedLayout with the reason where the model's RoPE or attention cannot be
        shifted (SWA, M-RoPE)."""
        return LlamaCppPassages(self)

    def rope_info(self) -> RopeInfo:
        """How the model rotates K, as llama.cpp loaded it (`llamacpp_shift.rope_spec` says
        whether that can be shifted)."""
        lib, model, md = self._lib, self._llm.model, self._llm.metadata
        arch = md.get("general.architecture", "unknown")
        return RopeInfo(
            architecture=arch, n_swa=int(lib.llama_model_n_swa(model)),
            rope_type=int(lib.llama_model_rope_type(model)),
            scaling=str(md.get(f"{arch}.rope.scaling.type", "none")).lower(),
            n_rot=int(md.get(f"{arch}.rope.dimension_count", self.fingerprint.head_dim_k)),
            freq_base=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            freq_scale=float(lib.llama_model_rope_freq_scale_train(model)))

    def decode(self, items: Sequence[BatchItem]) -> list[np.ndarray]:
        """One raw batch in this context, at the positions and sequence ids given (llama.cpp
        takes any first position in an empty context, then only the next one); the logits
        of the items that asked for them. The token bookkeeping (`n_tokens`, `token_ids`)
        is not kept: a reference for tests and probes, not a way to extend the context."""
        return _decode(self._lib, self._ctx, items, self.n_vocab)

    def shift_cells(self, delta: int) -> None:
        """llama.cpp's own K-shift: every cell of seq 0 moved by `delta` positions
        (`llama_memory_seq_add`; K is re-rotated at the next decode)."""
        lib = self._lib
        mem = lib.llama_get_memory(self._ctx)
        if not lib.llama_memory_can_shift(mem):
            raise UnsupportedLayout("this llama.cpp context cannot shift its KV cells")
        lib.llama_memory_seq_add(mem, 0, -1, -1, delta)

    def sequence_context(self, n_seq: int, n_tokens: int, *, unified: bool,
                         per_sequence: int | None = None,
                         n_batch: int | None = None) -> SequenceContext:
        """A second context of this model (this one's parameters) holding `n_seq` sequences
        and `n_tokens` tokens in all, in one batch if need be; `unified`: one KV cache for
        every sequence (llama.cpp's kv_unified), else one KV stream per sequence.
        `per_sequence`: instead, exactly that many cells for each sequence (a server's slots:
        this context's n_ctx each), decoded in batches of up to `n_batch` tokens."""
        src = self._llm.context_params
        params = type(src)()
        ctypes.memmove(ctypes.byref(params), ctypes.byref(src), ctypes.sizeof(src))
        params.n_seq_max = n_seq
        if per_sequence is not None:
            if unified or per_sequence % 256:
                raise EngineError(f"per_sequence={per_sequence} needs a KV stream per "
                                  "sequence and a multiple of 256 cells (llama.cpp pads to it)")
            params.n_ctx = n_seq * per_sequence
            params.n_batch = n_batch or int(src.n_batch)
        else:
            params.n_ctx = max(1024, n_tokens + 64)
            params.n_batch = max(int(src.n_batch), n_tokens)
        params.kv_unified = unified
        ctx = self._lib.llama_init_from_model(self._llm.model, params)
        if not ctx:
            raise EngineError("llama.cpp could not create a second context for "
                              f"{n_seq} sequences")
        return SequenceContext(self._lib, ctx, self.n_vocab)

    def library_dir(self) -> Path | None:
        """The folder of the llama-cpp-python package's native libraries (where
        LLAMA_CPP_LIB_PATH is not set), None if the package has no file."""
        f = getattr(self._lib, "__file__", None)
        return Path(f).parent / "lib" if f else None

    def library_path(self) -> Path | None:
        """The folder of the native libraries loaded: LLAMA_CPP_LIB_PATH, else the package's."""
        folder = os.environ.get("LLAMA_CPP_LIB_PATH")
        return Path(folder) if folder else self.library_dir()

    @property
    def flash_attn(self) -> bool:
        return int(self._llm.context_params.flash_attn_type) != 0
