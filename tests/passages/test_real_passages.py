"""Passage reuse on the real engine and model (SmolLM2, llama.cpp): the shift is exact where
it must be, a passage where it was cached is exact, moved passages are labelled and never
written back, and models whose RoPE or attention cannot be shifted are refused.

Tolerances, measured on llama.cpp 0.3.36 (AVX2 CPU build, f16 KV) with SmolLM2-135M:
the K rotated here and llama.cpp's own K-shift (`llama_memory_seq_add`) differ by at most one
f16 ulp of the largest |K| in the same head vector (under 1% of the values differ at all, for
shifts of 37, 137 and 400 positions: float32 angles against float64 ones);
layer 0's K of a passage computed alone and rotated to position p, against the same passage
computed at p after other text, by at most one such ulp (layer 0's K depends on the token
alone, so only the rotation can differ; deeper layers see the context and may not match)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekv import CacheConfig, EdgeKV, UnsupportedLayout, open_store
from edgekv.engines.models import default_model_path

from ..conftest import real_stack, skip_or_fail

real_stack("real engine", "llama_cpp", check=default_model_path)

from edgekv.engines.llamacpp import LlamaCppAdapter  # noqa: E402
from edgekv.engines.llamacpp_shift import LlamaCppPassages  # noqa: E402

pytestmark = pytest.mark.real

PASSAGES = [
    "The zlib module allows compression and decompression using the zlib library. The "
    "compress function returns a bytes object containing compressed data, and decompress "
    "undoes it. The default compression level is 6, a compromise between speed and size; "
    "level 9 compresses most and level 1 is fastest. The crc32 and adler32 functions compute "
    "checksums of data, and compressobj returns an object for streams too large for memory.",
    "The json module encodes and decodes JSON documents. json.dumps turns a Python object "
    "into a string, and json.loads parses a string back into Python objects such as dicts, "
    "lists, strings, numbers, True, False and None. The indent argument pretty-prints the "
    "output with that many spaces per level. A JSONDecodeError is raised, with the position "
    "of the problem, when the text is not a valid JSON document.",
]
QUESTION = "\nQuestion: What is the default zlib compression level?\nAnswer:"


@pytest.fixture(scope="module")
def adapter():
    a = LlamaCppAdapter(default_model_path(), n_ctx=512)
    yield a
    a.close()


@pytest.fixture
def kv(adapter, tmp_path):
    cfg = CacheConfig(cache_dir=tmp_path, reuse_granularity="chunk", passage_reuse=True,
                      passage_budget=16)
    cache = EdgeKV(adapter, open_store(cfg), cfg)
    yield cache
    cache.store.close()


def _head_ulp(k: np.ndarray, head_dim: int) -> np.ndarray:
    """One f16 ulp of the largest |K| of each head vector, broadcast back to K's shape."""
    heads = np.abs(k.astype(np.float32)).reshape(*k.shape[:-1], -1, head_dim)
    ulp = np.spacing(heads.max(axis=-1).astype(np.float16)).astype(np.float32)
    return np.repeat(ulp, head_dim, axis=-1).reshape(k.shape)


def test_rotation_equals_llama_cpp_k_shift_on_every_layer(adapter):
    shift = LlamaCppPassages(adapter)
    ids = adapter.tokenize(PASSAGES[0], add_bos=False)
    adapter.clear_kv_cache()
    adapter.prefill(ids, align=adapter.n_ctx)
    k0 = np.array(adapter.read_state().keys)
    p = 137
    shift.llama_shift(p)  # llama.cpp re-rotates K at the next decode
    shift.decode_at(adapter.tokenize(" x", add_bos=False), p + len(ids), clear=False)
    pos, k = shift.positions_kv()
    assert pos[0] == p and pos[len(ids) - 1] == p + len(ids) - 1
    theirs = k[:, : len(ids)].astype(np.float32)
    ours = shift.shift_keys(k0, p).astype(np.float32)
    diff = np.abs(ours - theirs)
    assert np.all(diff <= _head_ulp(theirs, adapter.fingerprint.head_dim_k))
    assert (diff > 0).mean() < 0.01
    assert np.abs(k0.astype(np.float32) - theirs).max() > 1.0  # the shift did move K
    adapter.clear_kv_cache()


def test_passage_cached_at_0_and_moved_to_p_has_the_k_computed_at_p(adapter):
    shift = LlamaCppPassages(adapter)
    before = adapter.tokenize(PASSAGES[1], add_bos=False)
    ids = adapter.tokenize(PASSAGES[0], add_bos=False)
    adapter.clear_kv_cache()
    adapter.prefill(ids, align=adapter.n_ctx)
    alone = np.array(adapter.read_state().keys[0])  # layer 0
    adapter.clear_kv_cache()
    adapter.prefill(before + ids, align=adapter.n_ctx)
    at_p = np.array(adapter.read_state().keys[0, len(before):]).astype(np.float32)
    adapter.clear_kv_cache()
    moved = shift.shift_keys(alone[None], len(before))[0].astype(np.float32)
    assert np.all(np.abs(moved - at_p) <= _head_ulp(at_p, adapter.fingerprint.head_dim_k))
    assert np.abs(alone.astype(np.float32) - at_p).max() > 1.0  # unmoved, it would not match


def test_a_passage_where_it_was_cached_gives_the_cold_logits(kv):
    a = kv.adapter
    assert kv.warm_passages(PASSAGES[:1]) == 1
    warm = kv.generate(QUESTION, passages=PASSAGES[:1], max_tokens=4)
    rep = warm.passages
    assert rep is not None and rep.exact_passages == 1 and not rep.approximate
    assert rep.reused_tokens == rep.passage_tokens and rep.recomputed_tokens == 0
    # the same tokens computed in the same batches (the passage, then the question): bit-exact
    a.clear_kv_cache()
    a.prefill(a.tokenize(PASSAGES[0], add_bos=False), align=a.n_ctx)
    cold = a.prefill(a.tokenize(QUESTION, add_bos=False), align=a.n_ctx)
    assert np.array_equal(warm.first_logits, cold)
    plain = kv.generate(QUESTION, passages=PASSAGES[:1], max_tokens=4, use_cache=False)
    assert plain.tokens == warm.tokens


def test_moved_passages_are_labelled_and_never_written_back(kv):
    kv.warm_passages(PASSAGES)
    stored = set(kv.store.keys())
    assert all(k.startswith("p") for k in stored) and len(stored) == 2
    moved = kv.generate(QUESTION, passages=PASSAGES[::-1], max_tokens=4)
    rep = moved.passages
    assert rep is not None and rep.approximate and rep.policy == "epic/k16"
    # the passage now first sits where it was cached (position 0, nothing before): exact
    assert rep.exact_passages == 1 and rep.recomputed_tokens == 16
    assert moved.stored_fragments == 0 and set(kv.store.keys()) == stored
    assert kv.lookup(moved_tokens := kv.adapter.token_ids[: moved.prompt_tokens]).n_tokens == 0
    assert len(moved_tokens) == moved.prompt_tokens


def test_sliding_window_models_are_refused(tmp_path):
    try:
        from edgekv.engines.models import gemma3_model_path

        path = gemma3_model_path()
    except Exception as e:  # noqa: BLE001 - the Gemma package is optional
        skip_or_fail(f"Gemma 3 unavailable: {e}")
    gemma = LlamaCppAdapter(path, n_ctx=256)
    try:
        cfg = CacheConfig(cache_dir=tmp_path, reuse_granularity="chunk", passage_reuse=True)
        with pytest.raises(UnsupportedLayout, match="sliding-window"):
            EdgeKV(gemma, open_store(cfg), cfg)
    finally:
        gemma.close()


def test_the_cli_marks_passages_with_the_separator(tmp_path: Path):
    from edgekv.core.passages import PASSAGE_SEPARATOR, split_passages

    passages, question = split_passages(PASSAGE_SEPARATOR.join([*PASSAGES, QUESTION]))
    assert passages == PASSAGES and question == QUESTION
