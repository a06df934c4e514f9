"""The sequence-state parser/assembler on synthetic blobs (no engine needed)."""

import struct

import numpy as np
import pytest

from edgekv import UnsupportedLayout
from edgekv.engines.llamacpp_state import SeqStateWriter, assemble_seq_state, parse_seq_state
from edgekv.engines.window import WindowLayout, window_layout

L, N, EK, EV = 3, 5, 6, 4


def kv(dtype=np.float16):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((L, N, EK)).astype(dtype),
            rng.standard_normal((L, N, EV)).astype(dtype))


@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_round_trip(v_trans, dtype):
    k, v = kv(dtype)
    blob = assemble_seq_state(k, v, v_trans=v_trans)
    st = parse_seq_state(blob, n_layer=L, n_embd_k=EK, n_embd_v=EV)
    assert st.v_trans == v_trans and st.n_tokens == N
    assert np.array_equal(st.keys, k) and np.array_equal(st.values, v)
    assert bytes(assemble_seq_state(st.keys, st.values, v_trans=v_trans)) == bytes(blob)


def test_cells_out_of_position_order_are_sorted():
    k, v = kv()
    blob = bytearray(assemble_seq_state(k, v, v_trans=False))
    # swap the pos of cells 0 and 1 -> their rows now belong to positions 1 and 0
    base = 16
    blob[base : base + 4], blob[base + 12 : base + 16] = struct.pack("<i", 1), struct.pack("<i", 0)
    st = parse_seq_state(blob, n_layer=L, n_embd_k=EK, n_embd_v=EV)
    assert np.array_equal(st.keys[:, 0], k[:, 1]) and np.array_equal(st.keys[:, 1], k[:, 0])


def _patch_k_type(blob: bytearray, type_id: int) -> bytearray:
    off = 16 + N * 12 + 8  # header, cells, v_trans + n_layer
    blob[off : off + 4] = struct.pack("<i", type_id)
    return blob


@pytest.mark.parametrize("mutate, match", [
    (lambda b: b[:4].__class__(b"\0\0\0\0") + b[4:], "magic"),
    (lambda b: _patch_k_type(b, 8), "ggml type 8"),  # q8_0: quantized KV is refused
    (lambda b: b + b"\0", "trailing"),
    (lambda b: b[:-3], "ends early"),
])
def test_unsupported_or_damaged_layouts_are_refused(mutate, match):
    k, v = kv()
    blob = mutate(bytearray(assemble_seq_state(k, v, v_trans=True)))
    with pytest.raises(UnsupportedLayout, match=match):
        parse_seq_state(bytes(blob), n_layer=L, n_embd_k=EK, n_embd_v=EV)


def test_layer_count_mismatch_is_refused():
    k, v = kv()
    with pytest.raises(UnsupportedLayout, match="layers"):
        parse_seq_state(assemble_seq_state(k, v, v_trans=True), n_layer=L + 1, n_embd_k=EK,
                        n_embd_v=EV)


@pytest.mark.parametrize("v_trans", [True, False])
def test_one_sequence_of_a_context_with_a_stream_per_sequence(v_trans):
    """llama.cpp with kv_unified=false writes every stream's cell count, the others 0: the
    writer makes such a blob and the parser reads the one stream back."""
    k, v = kv()
    w = SeqStateWriter(L, N, EK, EV, np.float16, v_trans=v_trans, seq_id=2, n_stream=4)
    for il in range(L):
        w.k(il)[:] = k[il]
        w.v(il)[:] = v[il]
    one = assemble_seq_state(k, v, v_trans=v_trans)
    assert len(w.blob) == len(one) + 3 * 4  # three more streams, an empty cell count each
    assert w.blob[8:12] == struct.pack("<I", 4) and w.blob[-12:] == bytes(12)
    st = parse_seq_state(w.blob, n_layer=L, n_embd_k=EK, n_embd_v=EV)
    assert st.n_tokens == N and np.array_equal(st.keys, k) and np.array_equal(st.values, v)
    empty = SeqStateWriter(L, 0, EK, EV, np.float16, v_trans=v_trans, n_stream=4).blob
    assert parse_seq_state(empty, n_layer=L, n_embd_k=EK, n_embd_v=EV).n_tokens == 0


def test_cells_in_two_streams_are_refused():
    """A whole multi-sequence context (cells in two streams) is not one sequence."""
    k, v = kv()
    one = assemble_seq_state(k, v, v_trans=True)
    body = bytes(one[12:])  # a stream: cell count, cells, K, V
    two = bytes(one[:8]) + struct.pack("<I", 2) + body + body
    with pytest.raises(UnsupportedLayout, match="several KV streams"):
        parse_seq_state(two, n_layer=L, n_embd_k=EK, n_embd_v=EV)


def test_a_stream_count_that_is_not_llamacpp_is_refused():
    k, v = kv()
    blob = bytearray(assemble_seq_state(k, v, v_trans=True))
    blob[8:12] = struct.pack("<I", 0)
    with pytest.raises(UnsupportedLayout, match="streams"):
        parse_seq_state(bytes(blob), n_layer=L, n_embd_k=EK, n_embd_v=EV)


# -- sliding-window (iSWA) states: the global cache, then the SWA cache, in one blob --------

NL, SWA, W = 6, (0, 1, 3, 4), 3  # layers 2 and 5 global (pattern 3), window of 3 positions


def swa_blob(n=N, swa_start=N - W, v_trans=True, dtype=np.float16, seq_id=0):
    """A two-cache blob as llama.cpp writes it for one sequence, and the KV written into it."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((NL, n, EK)).astype(dtype)
    v = rng.standard_normal((NL, n, EV)).astype(dtype)
    glob = tuple(i for i in range(NL) if i not in SWA)
    w = SeqStateWriter(NL, n, EK, EV, dtype, v_trans=v_trans, seq_id=seq_id,
                       sections=[(glob, 0), (SWA, swa_start)])
    for il in range(NL):
        lo = w.start(il)
        w.k(il)[:] = k[il, lo:]
        w.v(il)[:] = v[il, lo:]
    return w.blob, k, v


@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("swa_start", [0, N - W])
def test_swa_round_trip(v_trans, swa_start):
    blob, k, v = swa_blob(swa_start=swa_start, v_trans=v_trans)
    st = parse_seq_state(blob, n_layer=NL, n_embd_k=EK, n_embd_v=EV, swa_layers=SWA)
    assert st.n_tokens == N and st.v_trans == v_trans
    assert [s.layers for s in st.sections] == [(2, 5), SWA]
    assert [(s.start, s.end) for s in st.sections] == [(0, N), (swa_start, N)]
    for il in range(NL):
        lo = swa_start if il in SWA else 0
        sk, sv = st.layer_kv(il, slice(lo, N))
        assert np.array_equal(sk, k[il, lo:]) and np.array_equal(sv, v[il, lo:])


def test_swa_layer_outside_its_window_is_refused():
    blob, _, _ = swa_blob(swa_start=N - W)
    st = parse_seq_state(blob, n_layer=NL, n_embd_k=EK, n_embd_v=EV, swa_layers=SWA)
    st.layer_kv(2, slice(0, N))  # a global layer holds every position
    with pytest.raises(UnsupportedLayout, match="sliding window dropped"):
        st.layer_kv(0, slice(0, N))
    with pytest.raises(UnsupportedLayout, match="no single keys array"):
        _ = st.keys


def test_swa_blob_read_with_the_wrong_layout_is_refused():
    blob, _, _ = swa_blob()
    with pytest.raises(UnsupportedLayout, match="trailing"):  # read as one full-attention cache
        parse_seq_state(blob, n_layer=2, n_embd_k=EK, n_embd_v=EV)
    with pytest.raises(UnsupportedLayout, match="layers"):  # another SWA pattern
        parse_seq_state(blob, n_layer=NL, n_embd_k=EK, n_embd_v=EV, swa_layers=(0, 1, 3))
    k, v = kv()  # a one-cache blob read as a sliding-window model's
    with pytest.raises(UnsupportedLayout, match="ends early|layers"):
        parse_seq_state(assemble_seq_state(k, v, v_trans=True), n_layer=L, n_embd_k=EK,
                        n_embd_v=EV, swa_layers=(0,))


def test_swa_cache_that_ends_elsewhere_is_refused():
    blob, _, _ = swa_blob()
    glob_cells = 8 + 8  # magic, seq_id, n_stream, cell_count of the global cache
    # the global cache's last cell claims position N + 7: a gap in the global cache
    bad = bytearray(blob)
    bad[glob_cells + (N - 1) * 12 : glob_cells + (N - 1) * 12 + 4] = struct.pack("<i", N + 7)
    with pytest.raises(UnsupportedLayout, match="gap-free"):
        parse_seq_state(bytes(bad), n_layer=NL, n_embd_k=EK, n_embd_v=EV, swa_layers=SWA)


def test_swa_empty_state_and_empty_window_for_tokens():
    w = SeqStateWriter(NL, 0, EK, EV, np.float16, v_trans=True,
                       sections=[((2, 5), 0), (SWA, 0)])
    st = parse_seq_state(w.blob, n_layer=NL, n_embd_k=EK, n_embd_v=EV, swa_layers=SWA)
    assert st.n_tokens == 0
    blob, _, _ = swa_blob()
    # cut the SWA cache to zero cells while the global cache holds N
    glob = parse_seq_state(blob, n_layer=NL, n_embd_k=EK, n_embd_v=EV, swa_layers=SWA)
    head = bytes(blob)[: len(blob) - _swa_section_bytes(glob)] + struct.pack("<II", 1, 0)
    with pytest.raises(UnsupportedLayout, match="no cells"):
        parse_seq_state(head, n_layer=NL, n_embd_k=EK, n_embd_v=EV, swa_layers=SWA)


def _swa_section_bytes(st):
    s = st.sections[1]
    m = s.end - s.start
    return 8 + m * 12 + 8 + len(s.layers) * (12 + 12 + m * (EK + EV) * 2)


# -- which KV a prefix needs, and which layers slide ---------------------------------------

def test_window_layout_needs_global_from_zero_and_local_only_the_window():
    win = WindowLayout(18, tuple(i for i in range(18) if i % 6 < 5), 512)
    assert win.global_layers == (5, 11, 17)
    assert win.needed_from(5, 1500) == 0 and win.needed_from(0, 1500) == 988
    assert win.needed_from(0, 300) == 0
    # 1,500 tokens: 3 global layers x 1,500 + 15 local layers x 512 rows
    assert win.rows_needed(1500) == 3 * 1500 + 15 * 512
    assert WindowLayout(30).rows_needed(100) == 3000  # full attention: every layer, every token


@pytest.mark.parametrize("meta, swa", [
    ({"general.architecture": "gemma3", "gemma3.attention.sliding_window": "512"},
     tuple(i for i in range(18) if i % 6 < 5)),
    ({"general.architecture": "x", "x.attention.sliding_window": "64",
      "x.attention.sliding_window_pattern": "4"}, tuple(i for i in range(18) if i % 4 < 3)),
    ({"general.architecture": "llama"}, ()),
])
def test_window_layout_from_gguf_metadata(meta, swa):
    assert window_layout(meta, 18).swa_layers == swa


def test_unknown_sliding_window_pattern_is_refused():
    meta = {"general.architecture": "mystery", "mystery.attention.sliding_window": "256"}
    with pytest.raises(UnsupportedLayout, match="mystery.*not known"):
        window_layout(meta, 12)
