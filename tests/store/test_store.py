import logging
import sqlite3

import pytest

from edgekv import StoreError
from edgekv.store import DiskStore, FragmentStore, MemoryStore, TieredStore


def test_memory_lru_respects_capacity(fragment_factory):
    f = fragment_factory()
    store = MemoryStore(capacity_bytes=2 * f.nbytes + 10)
    for k in ("a", "b"):
        store.put(k, fragment_factory(chain_key=k))
    store.get("a")  # a is now most recent
    store.put("c", fragment_factory(chain_key="c"))
    assert store.contains("a") and store.contains("c") and not store.contains("b")
    assert store.stats().evictions == 1
    assert store.stats().bytes <= store.capacity_bytes


def test_memory_expiry(fragment_factory):
    store = MemoryStore(10**8)
    store.put("a", fragment_factory().stamped(100.0, 10.0))
    assert store.get("a", now=105.0) is not None
    assert store.get("a", now=111.0) is None
    assert not store.contains("a")


def test_disk_persists_across_instances(tmp_path, fragment_factory):
    f = fragment_factory()
    DiskStore(tmp_path, 10**9).put("k1", f)
    g = DiskStore(tmp_path, 10**9).get("k1")
    assert g is not None and (g.keys == f.keys).all()
    assert not list(tmp_path.rglob("*.tmp"))  # atomic write leaves no temp file


@pytest.mark.parametrize("damage", ["flip", "truncate", "zero"])
def test_disk_damaged_entry_is_a_logged_miss(tmp_path, fragment_factory, caplog, damage):
    store = DiskStore(tmp_path, 10**9)
    store.put("k1", fragment_factory())
    path = next(tmp_path.rglob("k1.ekv"))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[200] ^= 1
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert store.get("k1") is None
    assert "damaged" in caplog.text
    assert store.stats().corrupt == 1
    assert not path.exists() and store.stats().entries == 0


def test_disk_capacity_evicts_least_recently_used(tmp_path, fragment_factory):
    one = len(__import__("edgekv.serial", fromlist=["x"]).encode_fragment(fragment_factory()))
    store = DiskStore(tmp_path, capacity_bytes=2 * one + 10)
    store.put("a", fragment_factory(chain_key="a"))
    store.put("b", fragment_factory(chain_key="b"))
    store.get("a")
    store.put("c", fragment_factory(chain_key="c"))
    assert set(store.keys()) == {"a", "c"}
    assert store.stats().bytes <= store.capacity_bytes


def test_disk_ttl_sweep_and_touch(tmp_path, fragment_factory):
    store = DiskStore(tmp_path, 10**9)
    store.put("old", fragment_factory().stamped(100.0, 10.0))
    store.put("new", fragment_factory().stamped(100.0, 1000.0))
    store.touch("new", hit_count=5, expires_at=5000.0, now=101.0)
    assert store.sweep(now=200.0) == 1
    assert store.keys() == ["new"]
    g = DiskStore(tmp_path, 10**9).get("new", now=300.0)
    assert g is not None and g.hit_count == 5 and g.expires_at == 5000.0
    assert DiskStore(tmp_path, 10**9).get("new", now=6000.0) is None


def test_damaged_index_is_rebuilt_from_files(tmp_path, fragment_factory, caplog):
    store = DiskStore(tmp_path, 10**9)
    store.put("a", fragment_factory())
    store.close()
    for p in tmp_path.glob("index.sqlite3*"):
        p.write_bytes(b"this is not a database" * 100)
    with caplog.at_level(logging.WARNING):
        again = DiskStore(tmp_path, 10**9)
    assert "rebuilding" in caplog.text
    assert again.keys() == ["a"] and again.get("a") is not None
    db = sqlite3.connect(tmp_path / "index.sqlite3")
    assert len(db.execute("SELECT * FROM entries_v2").fetchall()) == 1
    db.close()


def test_missing_index_is_rebuilt_and_children_listed(tmp_path, fragment_factory):
    store = DiskStore(tmp_path, 10**9)
    child = fragment_factory(chain_key="c1", parent_key="p0")
    store.put("c1", child)
    store.put("other", fragment_factory(chain_key="o", parent_key="p9"))
    store.close()
    for p in tmp_path.glob("index.sqlite3*"):
        p.unlink()
    again = DiskStore(tmp_path, 10**9)
    (key, ids), = again.children("p0")
    assert key == "c1" and (ids == child.token_ids).all()
    mem = MemoryStore(10**8)
    mem.put("c1", child)
    assert [k for k, _ in mem.children("p0")] == ["c1"]
    mem.delete("c1")
    assert mem.children("p0") == []


def test_bad_key_is_a_clear_error(tmp_path, fragment_factory):
    with pytest.raises(StoreError, match="key"):
        DiskStore(tmp_path, 10**9).put("../escape", fragment_factory())


def test_tiered_promotes_disk_hits_to_ram(tmp_path, fragment_factory):
    ram, disk = MemoryStore(10**8), DiskStore(tmp_path, 10**9)
    disk.put("a", fragment_factory())
    t = TieredStore(ram, disk)
    (hit,) = t.get_many(["a"])
    assert hit is not None and hit.tier == "disk"  # the read says which tier answered
    (hit,) = t.get_many(["a"])
    assert hit is not None and hit.tier == "ram"
    assert not hasattr(t, "last_tier")


def test_tiered_clear_tier_empties_one_tier_by_name(tmp_path, fragment_factory):
    ram, disk = MemoryStore(10**8), DiskStore(tmp_path, 10**9)
    t = TieredStore(ram, disk)
    t.put("a", fragment_factory())
    assert t.clear_tier("ram") == 1 and not ram.contains("a") and disk.contains("a")
    assert t.get_many(["a"])[0].tier == "disk"
    with pytest.raises(StoreError, match="ram, disk"):
        t.clear_tier("ssd")


class _Minimal(FragmentStore):
    """A tier that implements only the required methods: the protocol's defaults apply."""

    name = "minimal"

    def __init__(self) -> None:
        self.items: dict[str, object] = {}

    def get(self, key, now=None):
        return self.items.get(key)

    def put(self, key, fragment):
        self.items[key] = fragment

    def contains(self, key):
        return key in self.items

    def keys(self):
        return list(self.items)


def test_protocol_defaults_for_what_a_tier_cannot_offer(fragment_factory):
    s = _Minimal()
    s.put("a", fragment_factory())
    assert s.children("p0") == [] and s.warm("a") is None and s.entries() == []
    assert s.add_remove_listener(print) is None and s.persistent_tier() is s
    assert s.tier_list() == (s,) and s.evictor is None
    # batched calls default to the per-item ones; a prefix walk stops at the first miss
    s.put_many([("b", fragment_factory(seed=1)), ("c", fragment_factory(seed=2))])
    hits = s.get_many(["a", "zz", "b"])
    assert [h and h.tier for h in hits] == ["minimal", None, "minimal"]
    assert s.get_many(["a", "zz", "b"], prefix=True)[1:] == [None, None]
    t = TieredStore(MemoryStore(10**8), s)
    assert t.persistent_tier() is s and sorted(t.keys()) == ["a", "b", "c"]
    assert t.tier_list() == (t.tiers[0], s)
    assert t.warm("a") is not None and t.tiers[0].contains("a")  # warmed into RAM


def _count_selects(store):
    seen = []
    store._db.set_trace_callback(lambda sql: seen.append(sql) if sql.startswith("SELECT")
                                 else None)
    return seen


def test_disk_reads_a_chain_in_one_index_query(tmp_path, fragment_factory):
    store = DiskStore(tmp_path, 10**9)
    store.put_many([(f"k{i}", fragment_factory(chain_key=f"k{i}", seed=i)) for i in range(8)])
    selects = _count_selects(store)
    hits = store.get_many([f"k{i}" for i in range(8)])
    assert all(h is not None and h.tier == "disk" for h in hits)
    assert [h.fragment.chain_key for h in hits] == [f"k{i}" for i in range(8)]
    assert len(selects) == 1, selects
    # a walk stops at the first missing file: what follows it is not read
    store.delete("k3")
    hits = store.get_many([f"k{i}" for i in range(8)], prefix=True)
    assert [h is not None for h in hits] == [True] * 3 + [False] * 5
    store.touch_many([("k0", 3, 0.0), ("k1", 4, 0.0)])
    again = DiskStore(tmp_path, 10**9)
    assert [again.get(k).hit_count for k in ("k0", "k1")] == [3, 4]
    assert {e.name for e in again.entries()} == {f"k{i}" for i in range(8)} - {"k3"}


def test_tiered_walk_reads_the_last_tier_once_and_promotes(tmp_path, fragment_factory):
    ram, disk = MemoryStore(10**8), DiskStore(tmp_path, 10**9)
    t = TieredStore(ram, disk)
    t.put_many([(f"k{i}", fragment_factory(chain_key=f"k{i}", seed=i)) for i in range(6)])
    ram.delete("k1")
    ram.delete("k4")
    selects = _count_selects(disk)
    hits = t.get_many([f"k{i}" for i in range(6)], prefix=True)
    assert [h.tier for h in hits] == ["ram", "disk", "ram", "ram", "disk", "ram"]
    assert len(selects) == 1 and ram.contains("k1") and ram.contains("k4")
    disk.delete("k2")
    ram.delete("k2")
    assert [h is not None for h in t.get_many([f"k{i}" for i in range(6)], prefix=True)] == [
        True, True, False, False, False, False]


def test_memory_evictor_frees_room_and_refuses_what_it_cannot_place(fragment_factory):
    f = fragment_factory()
    store = MemoryStore(capacity_bytes=2 * f.nbytes)
    asked = []

    def evictor(nbytes):
        asked.append(nbytes)
        return int(store.delete("a")) * f.nbytes  # "a" may go, nothing else

    store.evictor = evictor
    for k in ("a", "b", "c"):
        store.put(k, fragment_factory(chain_key=k))
    assert asked and not store.contains("a") and store.contains("b") and store.contains("c")
    store.put("d", fragment_factory(chain_key="d"))  # the evictor frees nothing more
    assert not store.contains("d") and store.stats().bytes <= store.capacity_bytes
