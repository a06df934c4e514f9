"""The window-aware fragment model on synthetic fragments: which layers a prefix needs, how a
sliding-window model's chunks are grouped, read and checked (no engine needed)."""

import numpy as np
import pytest

from edgekv import IncompatibleFragment, KVFragment
from edgekv.core.match import ChunkReader
from edgekv.engines.shared import check_injectable
from edgekv.engines.window import WindowLayout
from edgekv.keys import ModelFingerprint, chunk_keys, store_key
from edgekv.store.memory import MemoryStore

FP = ModelFingerprint("0" * 64, "gemma3", 6, 1, 4, 4, "f16", "test")
SWA = (0, 1, 3, 4)  # layers 2 and 5 global
WIN = WindowLayout(6, SWA, 128)
C = 64  # chunk size: the window covers the last two chunks


def chunk_frags(tokens, i, keys, groups):
    out = []
    for lo, hi in groups:
        rng = np.random.default_rng(i * 10 + lo)
        kv = rng.standard_normal((hi - lo, C, 4)).astype(np.float16)
        out.append(KVFragment(
            model_fingerprint=FP.digest, chain_key=keys[i], token_start=i * C,
            token_end=(i + 1) * C, layer_start=lo, layer_end=hi, layer_stride=1, n_layer_model=6,
            token_ids=np.asarray(tokens[i * C : (i + 1) * C]), keys=kv, values=kv.copy(),
            parent_key=keys[i - 1] if i else ""))
    return out


@pytest.fixture
def stored():
    reader = ChunkReader.for_model(MemoryStore(1 << 30), FP, local_layers=SWA, window=128)
    tokens = list(range(1, 5 * C + 1))
    keys = chunk_keys(FP.digest, tokens, C)
    for i in range(5):
        for f in chunk_frags(tokens, i, keys, reader.layer_groups):
            reader.store.put(store_key(keys[i], (f.layer_start, f.layer_end), 6), f)
    return reader, keys


def test_groups_never_mix_global_and_local_layers(stored):
    reader, _ = stored
    assert reader.layer_groups == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert reader.global_groups == [(2, 3), (5, 6)] and reader.local_groups == [(0, 2), (3, 5)]
    full = ChunkReader.for_model(MemoryStore(1), FP, 4)  # full attention: groups as configured
    assert full.layer_groups == [(0, 4), (4, 6)] and full.window == 0


def test_walk_reads_local_layers_of_the_last_window_only(stored):
    reader, keys = stored
    chunks = reader.walk(keys, 0.0, [])
    assert [len(c.fragments) for c in chunks] == [2, 2, 2, 4, 4]
    frags = [f for c in chunks for f in c.fragments]
    assert check_injectable(frags, FP, window=WIN) == 5 * C
    with pytest.raises(IncompatibleFragment, match="lack layers"):
        check_injectable(frags, FP)  # without the window every layer is needed
    with pytest.raises(IncompatibleFragment, match="lack layers"):  # a shorter prefix moves
        check_injectable(frags, FP, window=WIN, until=3 * C)  # its window back: chunk 1 lacks


def test_missing_local_group_ends_the_chain_before_it(stored):
    reader, keys = stored
    assert reader.store.delete(store_key(keys[4], (3, 5), 6))
    chunks = reader.walk(keys, 0.0, [])
    assert len(chunks) == 4 and [len(c.fragments) for c in chunks] == [2, 2, 4, 4]
    check_injectable([f for c in chunks for f in c.fragments], FP, window=WIN)
