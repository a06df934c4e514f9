import numpy as np
import pytest

from edgekv import CorruptEntry
from edgekv.keys import ModelFingerprint, chain_of, chunk_keys, store_key
from edgekv.serial import decode_fragment, encode_fragment, pack, unpack


def test_round_trip_is_exact(fragment_factory):
    f = fragment_factory(embedding=np.arange(384, dtype=np.float32), hit_count=3)
    g = decode_fragment(encode_fragment(f))
    for name in ("keys", "values", "token_ids", "embedding"):
        assert np.array_equal(getattr(f, name), getattr(g, name))
    assert (g.chain_key, g.hit_count, g.content_hash) == (f.chain_key, 3, f.content_hash)


def test_arrays_pack_by_their_values_whatever_their_layout_or_byte_order():
    """The tensors are written from their own memory where it is contiguous little-endian
    (`pack_parts`), converted where not: the same bytes either way."""
    a = np.arange(48, dtype=np.float32).reshape(4, 12)
    blob = pack({"x": 1}, {"a": a[:, ::2].copy(), "b": np.arange(5, dtype="<i4")})
    assert pack({"x": 1}, {"a": a[:, ::2], "b": np.arange(5, dtype=">i4")}) == blob
    header, arrays = unpack(blob)
    assert header["x"] == 1 and np.array_equal(arrays["a"], a[:, ::2])
    assert arrays["b"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "magic"])
def test_damage_is_detected(fragment_factory, damage):
    blob = bytearray(encode_fragment(fragment_factory()))
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x40
    elif damage == "truncate":
        blob = blob[: len(blob) - 100]
    elif damage == "empty":
        blob = bytearray()
    else:
        blob[0:4] = b"XXXX"
    with pytest.raises(CorruptEntry):
        decode_fragment(bytes(blob))


def test_chain_keys_bind_the_whole_prefix():
    a = list(range(256))
    b = [999] + a[1:]  # same second chunk, different first chunk
    ka, kb = chunk_keys("fp", a, 128), chunk_keys("fp", b, 128)
    assert len(ka) == 2
    assert ka[0] != kb[0] and ka[1] != kb[1]  # second chunk differs because its prefix does
    assert chunk_keys("fp", a + [1, 2, 3], 128) == ka  # partial chunk gets no key
    assert chunk_keys("other", a, 128) != ka  # model fingerprint is in every key


def test_fingerprint_digest_changes_with_layout():
    base = dict(file_sha256="x", architecture="llama", n_layer=30, n_head_kv=3, head_dim_k=64,
                head_dim_v=64, kv_dtype="f16", engine="llama.cpp/0.3.36")
    d = ModelFingerprint(**base).digest
    assert ModelFingerprint(**{**base, "kv_dtype": "f32"}).digest != d
    assert ModelFingerprint(**{**base, "file_sha256": "y"}).digest != d
    assert ModelFingerprint(**base).digest == d


def test_store_keys_name_a_layer_range_and_map_back_to_the_chain():
    chain = chunk_keys("fp", list(range(64)), 64)[0]
    assert store_key(chain, (0, 30), 30) == chain  # every layer: the chain key itself
    group = store_key(chain, (10, 20), 30)
    assert group == f"{chain}.L10-20"
    assert chain_of(group) == chain_of(chain) == chain


def test_tenant_roots_keep_serve_and_kv_server_tenants_apart():
    from edgekv.keys import KV_SERVER_TENANTS, SERVE_TENANTS, tenant_root

    serve, kv_server = tenant_root("fp", "bob", SERVE_TENANTS), tenant_root(
        "fp", "bob", KV_SERVER_TENANTS)
    assert serve != kv_server and len(serve) == len(kv_server) == 64  # one salt, two tenants
    assert tenant_root("fp", "bob", SERVE_TENANTS) == serve  # stable: chains are found again
    assert tenant_root("fp", "eve", SERVE_TENANTS) != serve
    assert tenant_root("other", "bob", SERVE_TENANTS) != serve  # bound to the model
    # no salt: the untenanted chain, one for everyone (shared system prompts stay shared)
    assert tenant_root("fp", "", SERVE_TENANTS) == tenant_root("fp", "", KV_SERVER_TENANTS) == ""
    assert chunk_keys("fp", list(range(64)), 64, serve) != chunk_keys(
        "fp", list(range(64)), 64, kv_server)
    with pytest.raises(ValueError, match="namespace"):
        tenant_root("fp", "bob", "servee")


def test_store_key_is_typed_and_its_name_is_only_its_spelling():
    from edgekv.keys import StoreKey

    chain = chunk_keys("fp", list(range(64)), 64)[0]
    whole, group = StoreKey.of(chain, (0, 30), 30), StoreKey.of(chain, (10, 20), 30)
    assert (whole.chain, whole.layers, whole.name) == (chain, None, chain)
    assert (group.chain, group.layers) == (chain, (10, 20))
    assert group.name == str(group) == store_key(chain, (10, 20), 30)
    assert StoreKey.of(chain, (10, 20), 30) == group and hash(group) == hash(StoreKey.of(
        chain, (10, 20), 30))
