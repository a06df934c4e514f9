"""`WriteBehind`: the tier behind RAM written by a thread of its own; what is queued reads as
held, mutations keep their order, nothing is lost by `close`, memory stays bounded."""

import os
import threading
import time

import pytest

from edgekv import StoreError
from edgekv.config import CacheConfig
from edgekv.core.pipeline import EdgeKV
from edgekv.engines.fake import FakeAdapter
from edgekv.store import DiskStore, MemoryStore, TieredStore, open_store
from edgekv.store.behind import WriteBehind


class GatedDisk(DiskStore):
    """A disk tier whose writes wait for `gate` (a slow disk, held still by the test)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.gate, self.entered = threading.Event(), threading.Event()

    def put_many(self, items):
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        super().put_many(items)


def test_put_returns_before_the_write_and_reads_as_held(tmp_path, fragment_factory):
    disk = GatedDisk(tmp_path, 10**9)
    store = WriteBehind(disk)
    child = fragment_factory(chain_key="c1", parent_key="p0")
    store.put_many([("c1", child)])  # returns with the writer stuck in the gate
    assert disk.entered.wait(5) and not disk.contains("c1")
    assert store.contains("c1") and store.keys() == ["c1"]
    (hit,) = store.get_many(["c1"], prefix=True)
    assert hit is not None and hit.tier == "disk" and hit.fragment is child
    assert [k for k, _ in store.children("p0")] == ["c1"]
    assert [e.name for e in store.entries()] == ["c1"]
    assert store.pending() == (1, child.nbytes) and store.stats().entries == 0
    disk.gate.set()
    assert store.flush(10)
    assert store.pending() == (0, 0) and store.stats().entries == 1
    store.close()
    again = DiskStore(tmp_path, 10**9).get("c1")
    assert again is not None and (again.keys == child.keys).all()


def test_a_chain_walk_stops_at_the_first_miss_across_queue_and_tier(tmp_path, fragment_factory):
    gated = GatedDisk(tmp_path, 10**9)
    DiskStore.put_many(gated, [("a", fragment_factory(chain_key="a"))])  # written, ungated
    store = WriteBehind(gated)
    store.put_many([("b", fragment_factory(chain_key="b"))])  # queued
    hits = store.get_many(["a", "b", "x", "b"], prefix=True)
    assert [h and h.tier for h in hits] == ["disk", "disk", None, None]  # not read past x
    hits = store.get_many(["x", "b"])
    assert hits[0] is None and hits[1] is not None  # without prefix each is looked up
    gated.gate.set()
    store.close()


def test_touch_after_put_lands_after_it(tmp_path, fragment_factory):
    disk = GatedDisk(tmp_path, 10**9)
    store = WriteBehind(disk)
    f = fragment_factory(chain_key="a").stamped(time.time(), 60.0)
    store.put_many([("a", f)])
    store.touch_many([("a", 3, f.expires_at + 100)])
    assert store.get("a").hit_count == 3  # the queued copy sees the hit at once
    disk.gate.set()
    store.close()
    got = DiskStore(tmp_path, 10**9).get("a")
    assert got is not None and got.hit_count == 3


def test_delete_of_a_queued_fragment_never_reaches_the_tier(tmp_path, fragment_factory):
    disk = GatedDisk(tmp_path, 10**9)
    store = WriteBehind(disk)
    removed: list[str] = []
    store.add_remove_listener(removed.append)
    store.put_many([("first", fragment_factory(chain_key="first"))])
    assert disk.entered.wait(5)  # "first" is being written; "a" waits in the queue
    store.put_many([("a", fragment_factory(chain_key="a"))])
    assert store.delete("a") and not store.contains("a") and set(removed) == {"a"}
    disk.gate.set()
    assert store.flush(10)
    assert disk.contains("first") and not disk.contains("a")
    assert store.pending() == (0, 0)
    store.close()


def test_delete_while_being_written_is_done_again_once_written(tmp_path, fragment_factory):
    disk = GatedDisk(tmp_path, 10**9)
    store = WriteBehind(disk)
    store.put_many([("a", fragment_factory(chain_key="a"))])
    assert disk.entered.wait(5)  # the writer holds "a"
    assert store.delete("a")
    disk.gate.set()
    assert store.flush(10)
    assert not disk.contains("a") and not store.contains("a")
    store.close()


def test_clear_drops_the_queue(tmp_path, fragment_factory):
    disk = GatedDisk(tmp_path, 10**9)
    store = WriteBehind(disk)
    store.put_many([("a", fragment_factory(chain_key="a"))])
    assert disk.entered.wait(5)
    store.put_many([("b", fragment_factory(chain_key="b"))])
    assert store.clear() == 2  # "b" queued, "a" being written: both gone
    disk.gate.set()
    assert store.flush(10)
    assert disk.keys() == [] and store.keys() == [] and store.pending() == (0, 0)
    store.close()


def test_put_again_while_written_keeps_the_newer(tmp_path, fragment_factory):
    disk = GatedDisk(tmp_path, 10**9)
    store = WriteBehind(disk)
    store.put_many([("a", fragment_factory(chain_key="a"))])
    assert disk.entered.wait(5)
    newer = fragment_factory(chain_key="a").stamped(time.time(), 999.0)
    store.put_many([("a", newer)])
    assert store.get("a").expires_at == newer.expires_at
    disk.gate.set()
    assert store.flush(10) and store.pending() == (0, 0)
    store.close()
    assert DiskStore(tmp_path, 10**9).get("a").expires_at == newer.expires_at


def test_a_full_queue_makes_the_writer_wait(tmp_path, fragment_factory):
    f = fragment_factory()
    disk = GatedDisk(tmp_path, 10**9)
    store = WriteBehind(disk, max_pending_bytes=f.nbytes)  # one fits, a second waits
    store.put_many([("a", fragment_factory(chain_key="a")), ("b", fragment_factory(chain_key="b"))])
    done = threading.Event()
    t = threading.Thread(target=lambda: (store.put_many([("c", f)]), done.set()))
    t.start()
    assert not done.wait(0.5)  # 2 queued past the bound: the third put waits
    disk.gate.set()
    assert done.wait(10)
    t.join(10)
    assert store.flush(10) and sorted(disk.keys()) == ["a", "b", "c"]
    store.close()


def test_a_refused_write_is_counted_and_frees_the_queue(tmp_path, fragment_factory):
    class Full(DiskStore):
        def put_many(self, items):
            raise StoreError("disk full")

    store = WriteBehind(Full(tmp_path, 10**9))
    store.put_many([("a", fragment_factory(chain_key="a"))])
    assert store.flush(10)
    assert store.failed == 1 and store.pending() == (0, 0) and not store.contains("a")
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.put_many([("b", fragment_factory(chain_key="b"))])


def test_close_writes_what_is_queued(tmp_path, fragment_factory):
    store = WriteBehind(DiskStore(tmp_path, 10**9))
    store.put_many([(f"k{i}", fragment_factory(chain_key=f"k{i}")) for i in range(5)])
    store.close()
    assert sorted(DiskStore(tmp_path, 10**9).keys()) == [f"k{i}" for i in range(5)]


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread priority here")
def test_the_writer_runs_at_a_lower_priority(tmp_path, fragment_factory):
    store = WriteBehind(DiskStore(tmp_path, 10**9), nice=5)
    store.put_many([("a", fragment_factory(chain_key="a"))])
    assert store.flush(10)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, store._thread.native_id) == min(mine + 5, 19)
    store.close()


def test_the_tier_the_prefix_index_evicts_from_is_the_one_written(tmp_path, fragment_factory):
    """The prefix index sets its evictor on the wrapper: the tier under it gets it, and its
    evictions (on the writer's thread, beside the requests) keep the index and tiers in step."""
    cfg = CacheConfig(chunk_size=64, cache_dir=tmp_path, reuse_granularity="chunk",
                      write_behind=True, disk_capacity_bytes=100_000)
    store = open_store(cfg)
    behind = store.tiers[-1]
    assert isinstance(behind, WriteBehind)
    kv = EdgeKV(FakeAdapter(), store, cfg)
    assert behind.inner.evictor is not None  # the prefix index's, set through the wrapper
    written = 0
    for turn in range(6):  # the writer evicts on its thread while the next request runs
        for u in range(3):
            r = kv.generate(list(range(u * 1000, u * 1000 + 64 * (turn + 2))), max_tokens=2)
            written += r.kv_bytes_written
    assert behind.flush(30)
    assert behind.inner.stats().bytes <= cfg.disk_capacity_bytes
    assert written > cfg.disk_capacity_bytes  # so the tier had to let some go
    # the index knows no chunk that no tier holds
    for node in kv.index._nodes.values():
        if not node.root and node.held:
            assert any(store.contains(n) for n in node.names)
    kv.close()


def test_the_default_store_writes_before_it_returns(tmp_path):
    store = open_store(CacheConfig(cache_dir=tmp_path))
    assert isinstance(store, TieredStore) and isinstance(store.tiers[0], MemoryStore)
    assert isinstance(store.tiers[-1], DiskStore)
    store.close()
