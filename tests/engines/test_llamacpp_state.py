"""The sequence-state parser/assembler on synthetic blobs (no engine needed)."""

import struct

import numpy as np
import pytest

from edgekv import UnsupportedLayout
from edgekv.engines.llamacpp_state import assemble_seq_state, parse_seq_state

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


def test_multi_stream_is_refused():
    k, v = kv()
    blob = bytearray(assemble_seq_state(k, v, v_trans=True))
    blob[8:12] = struct.pack("<I", 2)
    with pytest.raises(UnsupportedLayout, match="streams"):
        parse_seq_state(bytes(blob), n_layer=L, n_embd_k=EK, n_embd_v=EV)
