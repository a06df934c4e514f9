"""The Redis tier answers a chain walk in one round trip (one pipeline per server), on a real
redis-server and a real three-node cluster: counted where the client writes to its sockets."""

from __future__ import annotations

import pytest
from redis.connection import AbstractConnection

from edgekv import CacheConfig, EdgeKV
from edgekv.engines.fake import FakeAdapter
from edgekv.serial import encode_fragment
from edgekv.store.redis import RedisStore

from .. import redis_kit


@pytest.fixture
def sends(monkeypatch):
    """Every request the client writes to a Redis socket (a command, or a whole pipeline)."""
    seen: list[str] = []
    real = AbstractConnection.send_packed_command

    def send(self, command, check_health=True):
        seen.append(f"{self.host}:{self.port}")
        return real(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", send)
    return seen


def _hit(url: str, tmp_path, sends) -> tuple[RedisStore, EdgeKV, list[str], int]:
    tokens = [(7 * i) % 250 + 1 for i in range(1025)]  # 1,024 tokens to reuse
    cfg = CacheConfig(chunk_size=128, cache_dir=tmp_path)
    store = RedisStore(url)
    store.clear()
    EdgeKV(FakeAdapter(), store, cfg).generate(tokens, max_tokens=1)
    kv = EdgeKV(FakeAdapter(), store, cfg)  # a fresh process: its index from Redis' lists
    kv.lookup(tokens).release()  # the connection pool warms up
    sends.clear()
    before = store.round_trips
    match = kv.lookup(tokens)
    match.release()
    assert match.n_tokens == 1024 and len(match.chunks) == 8
    return store, kv, list(sends), store.round_trips - before


def test_a_1024_token_hit_is_one_round_trip(tmp_path, sends):
    redis_kit.need_redis()
    with redis_kit.server(tmp_path / "r") as srv:
        store, kv, sent, trips = _hit(srv.url, tmp_path, sends)
        assert trips == 1 and len(sent) == 1, sent
        store.clear()
        store.close()


def test_a_cluster_hit_is_one_pipeline_per_node(tmp_path, sends):
    redis_kit.need_redis()
    with redis_kit.cluster(tmp_path / "c") as c:
        store, kv, sent, trips = _hit(c.url, tmp_path, sends)
        nodes = {store.server_of(ch.chain_key) for ch in kv.lookup(
            [(7 * i) % 250 + 1 for i in range(1025)]).chunks}
        assert len(nodes) > 1  # the chain's chunks live on several nodes
        assert trips == len(nodes) and sorted(sent) == sorted(nodes), (sent, nodes)
        store.clear()
        store.close()


def test_a_requests_chunks_are_written_in_one_round_trip(tmp_path, sends):
    """put_many on a single Redis: every fragment, its lifecycle and its successor entry in
    one MULTI/EXEC; a fresh process then finds the whole chain from Redis alone."""
    redis_kit.need_redis()
    from edgekv.store import MemoryStore

    tokens = [(7 * i) % 250 + 1 for i in range(1025)]
    cfg = CacheConfig(chunk_size=128, cache_dir=tmp_path)
    ram = MemoryStore(1 << 30)
    EdgeKV(FakeAdapter(), ram, cfg).generate(tokens, max_tokens=1)
    items = [(k, ram.get(k)) for k in ram.keys()]
    assert len(items) >= 8
    with redis_kit.server(tmp_path / "r") as srv:
        store = RedisStore(srv.url)
        store.clear()
        store.get("warm")  # the connection pool warms up
        sends.clear()
        store.put_many(items)
        assert len(sends) == 1, sends
        assert all(store.contains(k) for k, _ in items)
        match = EdgeKV(FakeAdapter(), store, cfg).lookup(tokens)
        match.release()
        assert match.n_tokens == 1024
        store.clear()
        store.close()


def test_a_full_redis_that_evicts_takes_a_request_too_big_for_one_transaction(tmp_path):
    """Under `allkeys-lru` with room for a few fragments but not a request's whole batch, the
    MULTI/EXEC is refused (its payload counts twice: queued and in the query buffer); the
    chunks then go one at a time, Redis evicts between them, and nothing is counted as an
    error. Under `noeviction` what fits lands, parents first, and the rest raises `StoreError`
    and is counted: what Redis holds is a prefix of the chain."""
    redis_kit.need_redis()
    from edgekv.errors import StoreError
    from edgekv.store import MemoryStore

    tokens = [(7 * i) % 250 + 1 for i in range(1025)]
    cfg = CacheConfig(chunk_size=128, cache_dir=tmp_path)
    ram = MemoryStore(1 << 30)
    EdgeKV(FakeAdapter(), ram, cfg).generate(tokens, max_tokens=1)
    items = sorted(((k, ram.get(k)) for k in ram.keys()), key=lambda kv: kv[1].token_start)
    biggest = max(len(encode_fragment(f)) for _, f in items)
    total = sum(len(encode_fragment(f)) for _, f in items)
    assert total > 6 * biggest  # the batch is far larger than the room below
    for policy in ("allkeys-lru", "noeviction"):
        with redis_kit.server(tmp_path / policy, "--maxmemory-policy", policy) as srv:
            store = RedisStore(srv.url)
            admin = srv.client()
            admin.config_set("maxmemory", int(admin.info("memory")["used_memory"])
                             + 3 * biggest)
            if policy == "allkeys-lru":
                store.put_many(items)
                assert store.stats().errors == 0
                assert store.contains(items[-1][0])  # the deepest chunk was written last
                assert int(admin.info("stats")["evicted_keys"]) > 0
            else:
                with pytest.raises(StoreError):
                    store.put_many(items)
                assert store.stats().errors >= 1
                held = [store.contains(k) for k, _ in items]
                assert not all(held) and held == sorted(held, reverse=True)  # a head prefix
            admin.close()
            store.close()


def test_a_cluster_walk_asks_its_nodes_at_once(tmp_path, monkeypatch):
    """The pipelines to the nodes of a read are in flight together: each send waits at a
    barrier for the other nodes' sends, which a read asking one node after another never
    reaches (the barrier breaks, the reads fail, the fragments are misses)."""
    import threading

    redis_kit.need_redis()
    with redis_kit.cluster(tmp_path / "c") as c:
        tokens = [(7 * i) % 250 + 1 for i in range(1025)]
        store = RedisStore(c.url)
        store.clear()
        EdgeKV(FakeAdapter(), store, CacheConfig(chunk_size=128, cache_dir=tmp_path)).generate(
            tokens, max_tokens=1)
        keys = store.keys()
        nodes = {store.server_of(k) for k in keys}
        assert len(nodes) > 1  # the chunks live on several nodes
        assert all(h is not None for h in store.get_many(keys))  # the pools warm up
        barrier = threading.Barrier(len(nodes), timeout=10)
        real = AbstractConnection.send_packed_command

        def send(self, command, check_health=True):
            barrier.wait()
            return real(self, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", send)
        hits = store.get_many(keys)
        monkeypatch.undo()
        assert all(h is not None for h in hits) and not barrier.broken
        store.clear()
        store.close()
