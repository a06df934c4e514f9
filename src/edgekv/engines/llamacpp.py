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
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EngineError, IncompatibleFragment, UnsupportedLayout
from ..fragment import KVFragment
from ..keys import ModelFingerprint, file_sha256
from .base import EngineCounters, FragmentSpec, Generation, TokenCallback
from .llamacpp_state import SeqState, SeqStateWriter, parse_seq_state
from .models import resolve_model
from .shared import (
    aligned_batches,
    append_length,
    build_fragments,
    check_prefill,
    injection_length,
    sample_loop,
)

__all__ = ["LlamaCppAdapter"]

log = logging.getLogger(__name__)
_KV_TYPES = {0: "f32", 1: "f16"}


def _import_llama() -> Any:
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise EngineError(
            "llama-cpp-python is not installed: run `make setup` (it builds it with the CPU "
            "flags this machine needs) or `pip install 'edgekv[llamacpp]'`") from e
    return llama_cpp


class LlamaCppAdapter:
    """One llama.cpp context over one model, holding one sequence (seq 0)."""

    def __init__(self, model_path: str | Path | None = None, *, n_ctx: int = 2048,
                 n_threads: int | None = None, memo_dir: Path | None = None,
                 **llama_kwargs: Any) -> None:
        """`llama_kwargs` go to `llama_cpp.Llama` (e.g. `flash_attn=True`, `type_k=...`)."""
        self._lib = lib = _import_llama()
        self.model_path = resolve_model(model_path)
        self.n_threads = n_threads or os.cpu_count() or 1
        try:
            self._llm = lib.Llama(
                str(self.model_path), n_ctx=n_ctx, n_batch=2048, n_ubatch=512,
                n_threads=self.n_threads, n_threads_batch=self.n_threads, verbose=False,
                logits_all=False, **llama_kwargs)
        except (ValueError, RuntimeError) as e:
            raise EngineError(f"llama.cpp could not load {self.model_path}: {e}") from e
        self._ctx = self._llm.ctx  # the llama_context the C bindings take
        self._n_vocab = self._llm.n_vocab()
        self.fingerprint = self._make_fingerprint(memo_dir)
        self._v_trans: bool | None = None  # learnt from the first state llama.cpp writes
        self.counters = EngineCounters()
        self.weight_bytes = self.model_path.stat().st_size  # streamed once per forward batch

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
        tpl = self._llm.metadata.get("tokenizer.chat_template")
        return str(tpl) if tpl else None

    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return bytes(self._llm.detokenize(list(tokens))).decode("utf-8", errors="replace")

    def clear_kv_cache(self) -> None:
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
                                        shape=(self._n_vocab,))
        return np.array(logits, dtype=np.float32, copy=True)

    def generate(self, logits: np.ndarray, max_tokens: int, *, temperature: float = 0.0,
                 seed: int = 0, keep_logits: bool = False, top_p: float = 1.0,
                 on_token: TokenCallback | None = None) -> Generation:
        return sample_loop(self, logits, max_tokens, temperature=temperature, seed=seed,
                           keep_logits=keep_logits, top_p=top_p, on_token=on_token)

    # -- fragments -----------------------------------------------------------------------

    def _state_buffer(self) -> ctypes.Array[ctypes.c_uint8]:
        lib = self._lib
        size = lib.llama_state_seq_get_size(self._ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = lib.llama_state_seq_get_data(self._ctx, buf, size, 0)
        if written != size:
            raise EngineError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return buf

    def read_state(self, buf: ctypes.Array[ctypes.c_uint8] | None = None) -> SeqState:
        """The engine's sequence as canonical keys/values (views into one copied blob: `buf`
        if given, as `_state_buffer` returned it)."""
        fp = self.fingerprint
        buf = self._state_buffer() if buf is None else buf
        state = parse_seq_state(memoryview(buf), n_layer=fp.n_layer,
                                n_embd_k=fp.n_embd_k, n_embd_v=fp.n_embd_v)
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
        state = self.read_state()
        return build_fragments(specs, self.fingerprint, self.token_ids,
                               lambda li, tok: (state.keys[li, tok], state.values[li, tok]))

    def inject_fragments(self, fragments: Sequence[KVFragment], limit: int | None = None) -> int:
        n = injection_length(fragments, self.fingerprint, limit)
        if n > self.n_ctx:
            raise IncompatibleFragment(f"prefix of {n} tokens exceeds the context ({self.n_ctx})")
        v_trans = self._v_trans if self._v_trans is not None else self._probe_v_trans()
        return self._restore(n, fragments, v_trans)

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
            return self._restore(end, fragments, state.v_trans, held=(state, ids))
        except EngineError:
            read = self._lib.llama_state_seq_set_data(self._ctx, old, len(old), 0)
            if read == len(old):
                self._llm.input_ids[:held] = ids
                self._llm.n_tokens = held
            raise

    def _restore(self, n: int, fragments: Sequence[KVFragment], v_trans: bool,
                 held: tuple[SeqState, list[int]] | None = None) -> int:
        """Replace the sequence with cells 0..n-1: the `held` state's cells first (if given),
        then the fragments' tokens, written straight into the blob llama.cpp reads."""
        fp = self.fingerprint
        writer = SeqStateWriter(fp.n_layer, n, fp.n_embd_k, fp.n_embd_v,
                                np.dtype(np.float16 if fp.kv_dtype == "f16" else np.float32),
                                v_trans=v_trans)
        ids = np.empty(n, np.int32)
        if held is not None:
            state, held_ids = held
            m = state.n_tokens
            ids[:m] = held_ids
            for layer in range(fp.n_layer):
                writer.k(layer)[:m] = state.keys[layer]
                writer.v(layer)[:m] = state.values[layer]
        for f in fragments:
            if f.token_start >= n:
                continue
            end = min(f.token_end, n)
            tok, m = slice(f.token_start, end), end - f.token_start
            ids[tok] = f.token_ids[:m]
            for i, layer in enumerate(f.layer_indices):
                writer.k(layer)[tok] = f.keys[i, :m]
                writer.v(layer)[tok] = f.values[i, :m]
        blob = writer.blob
        self.clear_kv_cache()
        src = (ctypes.c_uint8 * len(blob)).from_buffer(blob)
        read = self._lib.llama_state_seq_set_data(self._ctx, src, len(blob), 0)
        if read != len(blob):
            self.clear_kv_cache()
            raise EngineError(f"llama.cpp refused the assembled state ({read} of {len(blob)} "
                              "bytes read); the context is cleared, prefill will recompute")
        self._llm.input_ids[:n] = ids
        self._llm.n_tokens = n
        return n

    def _probe_v_trans(self) -> bool:
        """Learn whether llama.cpp stores V transposed by writing a one-token state."""
        saved = self.token_ids
        self.clear_kv_cache()
        bos = self._llm.token_bos()
        self._llm.eval([bos if bos >= 0 else 0])
        v_trans = self.read_state().v_trans
        self.clear_kv_cache()
        if saved:
            log.debug("v_trans probe cleared a context of %d tokens", len(saved))
        return v_trans

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.close()
