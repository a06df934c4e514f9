"""The Redis store on a real three-node Redis Cluster (started on loopback by `redis_kit`):
`redis-cluster://` URLs, hash-tagged keys (a fragment, its metadata and its successor list in
one slot, checked with the cluster's own CLUSTER KEYSLOT), a node stopped mid-run."""

from __future__ import annotations

import logging
import time

import pytest

from edgekv import StoreError
from edgekv.store import open_store_url
from edgekv.store.redis import RedisStore, cluster_nodes, redact
from edgekv_harness import faults_redis

from .. import redis_kit
from ..conftest import make_fragment


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    redis_kit.need_redis()
    with redis_kit.cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture
def store(cluster):
    s = open_store_url(cluster.url, 0)
    assert isinstance(s, RedisStore) and s.cluster
    yield s
    s.clear()
    s.close()


def frag(key, parent="", layers=(0, 4), seed=0):
    lo, hi = layers
    f = make_fragment(chain_key=key.split(".")[0], parent_key=parent, seed=seed, layers=hi)
    return f.stamped(time.time(), 600)


def test_cluster_urls():
    assert cluster_nodes("redis-cluster://127.0.0.1:7000,localhost:7001, [::1]:7002") == [
        ("127.0.0.1", 7000), ("localhost", 7001), ("::1", 7002)]
    for bad in ("redis://127.0.0.1:7000", "redis-cluster://127.0.0.1", "redis-cluster://:7000"):
        with pytest.raises(StoreError):
            cluster_nodes(bad)
    assert redact("redis://user:s3cret@10.0.0.2:6379/0") == "redis://user:***@10.0.0.2:6379/0"
    assert redact("redis://:s3cret@h:1/0") == "redis://:***@h:1/0"


def test_unreachable_cluster_is_a_store_error(tmp_path):
    port = redis_kit.RedisServer(tmp_path).port  # free, nothing listening
    with pytest.raises(StoreError, match="cannot reach Redis"):
        RedisStore(f"redis-cluster://127.0.0.1:{port}")


def test_a_fragment_its_metadata_and_successors_share_one_slot(cluster, store):
    chain = "a" * 64
    for layers in ((0, 2), (2, 4)):
        store.put(f"{chain}.L{layers[0]}-{layers[1]}", frag(chain, "p" * 64, layers))
    store.put("b" * 64, frag("b" * 64, chain))  # its entry in `chain`'s successor list
    names = [store._k(kind, f"{chain}.L{lo}-{hi}") for kind in ("frag", "meta")
             for lo, hi in ((0, 2), (2, 4))] + [store._k("children", chain)]
    r = cluster.nodes[0].client()
    slots = {int(r.execute_command("CLUSTER", "KEYSLOT", n)) for n in names}
    assert slots == {store.slot(chain)}
    # and the node that owns the slot holds exactly these five keys in it
    owner = next(n for n in cluster.nodes if n.address == store.server_of(chain))
    held = owner.client().execute_command("CLUSTER", "GETKEYSINSLOT", store.slot(chain), 100)
    assert {k.decode() for k in held} == set(names)
    # a multi-key transaction on these keys is accepted by the cluster (one slot)
    p = store._r.pipeline(transaction=True)
    p.exists(names[0])
    p.exists(names[2])
    assert p.execute() == [1, 1]


def test_store_round_trip_across_three_nodes(store):
    keys = [f"{i:064x}" for i in range(1, 31)]
    for parent, key in zip(["", *keys], keys):
        store.put(key, frag(key, parent, seed=len(key) + int(key, 16)))
    assert len({store.server_of(k) for k in keys}) == 3  # spread over every node
    assert store.keys() == sorted(keys)
    g = store.get(keys[7])
    assert g is not None and g.chain_key == keys[7]
    assert [k for k, _ in store.children(keys[7])] == [keys[8]]
    store.touch(keys[3], 4, time.time() + 900)
    assert store.get(keys[3]).hit_count == 4
    st = store.stats()
    assert st.entries == 30 and st.bytes > 0 and st.errors == 0
    assert store.delete(keys[0]) and not store.contains(keys[0])


def test_stopped_node_loses_only_its_slots_logged_once(tmp_path, caplog):
    redis_kit.need_redis()
    with redis_kit.cluster(tmp_path / "c", persist=True) as c:
        s = RedisStore(c.url)
        keys = [f"{i:064x}" for i in range(1, 31)]
        for key in keys:
            s.put(key, frag(key))
        victim = c.nodes[1]
        on_victim = {k for k in keys if s.server_of(k) == victim.address}
        assert on_victim
        # a parent on a live node whose successor lives on the victim
        parent = next(k for k in keys if k not in on_victim)
        child = next(k for k in on_victim)
        s.put(child + ".L0-4", frag(child, parent))
        victim.stop(kill=True)
        with caplog.at_level(logging.WARNING, logger="edgekv.store.redis"):
            for _ in range(3):
                got = {k for k in keys if s.get(k) is not None}
                assert got == set(keys) - on_victim  # the others still serve theirs
                assert s.children(parent) == []  # unreadable now, but not forgotten:
        assert len([r for r in caplog.records if r.name == "edgekv.store.redis"]) == 1
        assert s.stats().errors >= 3 * len(on_victim)
        c.restart(1)  # its append-only file brings its keys back
        assert all(s.get(k) is not None for k in keys)
        assert [k for k, _ in s.children(parent)] == [child + ".L0-4"]  # listed again


def test_node_down_row_on_the_fake_engine(tmp_path):
    redis_kit.need_redis()
    eng = redis_kit.fake_engine(tmp_path)
    row = faults_redis.cluster_node_down(eng, tmp_path, {"requests": 4, "duration": 0.0})
    assert row["wrong_outputs"] == 0 and row["lost_requests"] == 0
    assert row["lost_entries"] == 0
    assert row["entries_on_stopped_node"] > 0
    assert row["unavailable_entries"] == row["entries_on_stopped_node"]
    assert row["errors_logged"] == 1 and row["errors_counted"] > 1
    assert row["recovery_s"] is not None


@pytest.mark.real
def test_node_down_on_the_real_engine(tmp_path):
    """SmolLM2 on llama.cpp over the cluster: a node killed mid-run, every answer still its
    cold run's, only that node's entries unavailable while it is down."""
    from edgekv.engines.models import default_model_path

    from ..conftest import real_stack

    redis_kit.need_redis()
    real_stack("llama.cpp", "llama_cpp", check=default_model_path)
    row = faults_redis.FAULTS["redis_cluster_node_down"](tmp_path, {
        "requests": 3, "duration": 0.0, "max_tokens": 6})
    assert row["wrong_outputs"] == 0 and row["lost_requests"] == 0
    assert row["lost_entries"] == 0 and row["unavailable_entries"] > 0
    assert row["errors_logged"] == 1
