import numpy as np
import pytest

from edgekv import FragmentError
from edgekv.fragment import PASSAGE_PARENT, content_hash, next_expiry


def test_valid_fragment_derives_hash_and_sizes(fragment_factory):
    f = fragment_factory(span=64)
    assert f.span == 64
    assert f.content_hash == content_hash("fp", f.token_ids)
    assert f.nbytes == f.keys.nbytes + f.values.nbytes + f.token_ids.nbytes
    assert list(f.layer_indices) == [0, 1, 2, 3]


@pytest.mark.parametrize("span", [0, 2049])
def test_span_out_of_range_names_field_value_and_range(fragment_factory, span):
    with pytest.raises(FragmentError, match=rf"token_end - token_start={span}.*\[1, 2048\] "
                       r"tokens \(a chain's full chunk spans the chunk size \[64, 2048\], its "
                       r"trailing partial chunk at least 1\)"):
        fragment_factory(span=span)


@pytest.mark.parametrize("span", [1, 10, 63])
def test_a_trailing_partial_chunk_may_be_shorter_than_a_full_chunk(fragment_factory, span):
    """A chain's tail hangs off its last full chunk on its own, however short (`Writeback`)."""
    f = fragment_factory(span=span, start=128, parent_key="chunk-1")
    assert (f.span, f.token_end, len(f.token_ids)) == (span, 128 + span, span)
    assert f.keys.shape == (4, span, 8)


def test_a_passage_span_out_of_range_names_its_own_range(fragment_factory):
    with pytest.raises(FragmentError, match=r"=2049 .*\[1, 2048\] tokens \(a passage\)"):
        fragment_factory(span=2049, parent_key=PASSAGE_PARENT)


def test_layer_end_beyond_model(fragment_factory):
    with pytest.raises(FragmentError, match=r"layer_end=5.*<= model layers \(4\)"):
        fragment_factory(n_layer=4, layers=5)


def test_token_ids_length_must_equal_span(fragment_factory):
    f = fragment_factory()
    with pytest.raises(FragmentError, match=r"token_ids.*length 10.*exactly the span \(64\)"):
        type(f)(**{**_fields(f), "token_ids": np.arange(10), "content_hash": ""})


def test_empty_tensors_rejected(fragment_factory):
    f = fragment_factory()
    with pytest.raises(FragmentError, match=r"keys='empty'"):
        type(f)(**{**_fields(f), "keys": np.zeros((4, 64, 0), np.float16)})


def test_stride_must_be_positive(fragment_factory):
    f = fragment_factory()
    with pytest.raises(FragmentError, match=r"layer_stride=0.*>= 1"):
        type(f)(**{**_fields(f), "layer_stride": 0})


def test_content_hash_must_match_tokens(fragment_factory):
    f = fragment_factory()
    with pytest.raises(FragmentError, match="content_hash"):
        type(f)(**{**_fields(f), "content_hash": "0" * 64})


def test_shape_must_match_layers_and_span(fragment_factory):
    f = fragment_factory()
    with pytest.raises(FragmentError, match=r"keys.shape"):
        type(f)(**{**_fields(f), "keys": f.keys[:2]})


def test_strided_fragment_has_sampled_layers(fragment_factory):
    f = fragment_factory(n_layer=8, layers=8)
    g = type(f)(**{**_fields(f), "layer_stride": 2, "keys": f.keys[::2], "values": f.values[::2]})
    assert list(g.layer_indices) == [0, 2, 4, 6]
    assert not g.is_dense


def test_layer_slice(fragment_factory):
    f = fragment_factory()
    s = f.layer_slice(1, 3)
    assert (s.layer_start, s.layer_end) == (1, 3)
    assert np.array_equal(s.keys, f.keys[1:3])
    with pytest.raises(FragmentError):
        f.layer_slice(2, 9)


def test_promotion_after_five_hits():
    assert next_expiry(4, 100.0, 1800, 604800, 5) == 1900.0
    assert next_expiry(5, 100.0, 1800, 604800, 5) == 100.0 + 604800


def test_expiry(fragment_factory):
    f = fragment_factory().stamped(1000.0, 10.0)
    assert not f.is_expired(1005.0)
    assert f.is_expired(1010.0)


def _fields(f):
    return {name: getattr(f, name) for name in f.__slots__}
