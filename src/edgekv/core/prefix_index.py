"""The prefix index: the one place that knows the shape of the cache's chains.

A radix tree of chunks (SGLang's radix cache over vLLM-style chained keys): a node is one
stored chunk (a full chunk, a trailing partial chunk, a request's answer), its parent the chunk
before it, a root per tenant. It answers three questions no single tier can:

- What follows a matched chain (`successor`): the radix step compares a request's tokens
  with the children's, in memory, without asking a tier.
- What to evict (`evict`): leaves only. A hit walks a chain from its head, so a per-tier LRU
  sees the head as the oldest entry and evicts it first, which orphans every chunk after it
  (bytes held that no lookup can reach). Evicting leaves keeps a chunk that many chains share
  while any of its descendants is wanted. Of the leaves, `policy="leaf"` takes the one whose
  second-to-last access is oldest first (LRU-2, O'Neil et al. 1993): a chunk read once (a
  one-off prompt, a rarely continued chat) goes before one read again, so a stream of
  one-off requests does not flush the chains that are in use; `"leaf-lru"`, the least
  recently used leaf first.
- What is in use (`pin`): a request's matched path is pinned until its answer is stored, so
  an eviction for another request never removes the parent its new chunks hang off.

Tiers (`FragmentStore.tier_list`, fastest first) stay byte stores: the index tracks which
tier holds every fragment of a node (a bit per tier) from inserts, hits and the tiers' remove
events, and, with `policy="leaf"` or `"leaf-lru"`, is the tiers' evictor. A leaf evicted from
RAM stays on disk; the disk tier evicts leaves too. A node that no tier holds any more
(expired, damaged) takes its unreachable descendants with it. A tier that evicts by itself and
is shared by other processes (Redis, `FragmentStore.self_evicting`) is only tracked: the index
never removes anything from it, since another process may be about to write what a chain
there lacks. The index is rebuilt from the tiers' own indexes on open
(`FragmentStore.entries`; a chunk's access before its last is not recorded there, so after a
rebuild every chunk counts as read once), so it is as crash-safe as the disk tier; it is only a map:
the tiers are the truth, and a chain a tier holds that the index does not know (another
process's) is still found by the exact walk and adopted.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ..errors import StoreError
from ..fragment import common_prefix
from ..keys import next_key
from ..store.base import FragmentStore

__all__ = ["Lease", "Node", "PrefixIndex", "Successor"]

_NO_TOKENS = np.zeros(0, np.int32)
POLICIES = ("leaf", "leaf-lru", "lru")


@dataclass(slots=True, eq=False)
class Node:
    """One chunk of a chain (or a tenant's root: `root`, no tokens, always reachable)."""

    key: str
    parent: Node | None = None
    start: int = -1  # position of its first token; -1: not known yet (a placeholder)
    tokens: np.ndarray = field(default_factory=lambda: _NO_TOKENS)
    names: tuple[str, ...] = ()  # its fragments' names in the tiers (whole, or layer groups)
    nbytes: int = 0
    held: int = 0  # bit i: tier i holds every fragment of it
    last_access: float = 0.0
    prev_access: float = 0.0  # the access before `last_access` (0: read once, or not known)
    lock_ref: int = 0
    root: bool = False
    children: dict[str, Node] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def touch(self, now: float) -> None:
        """An access at `now`; the one before it is kept (LRU-2). One lookup's chunks share
        one `now`, so a chunk read twice by one request counts once."""
        if now > self.last_access:
            self.prev_access = self.last_access
        self.last_access = now


def _second_to_last_access(n: Node) -> float:
    return n.prev_access


def _no_rank(n: Node) -> float:
    return 0.0


@dataclass(frozen=True, slots=True)
class Successor:
    """The radix step's answer: the stored chunk `key` hangs off chunk `k0 - 1` of the
    request's chain and matches its tokens up to position `end`."""

    key: str
    k0: int
    end: int


class Lease:
    """Pins on the nodes of one request's path (`PrefixIndex.pin`). `release` unpins them
    (once; later calls do nothing) and frees the tails a newer path repeats that only these
    pins kept; a lease dropped unreleased (a request that raised) is released when it is
    collected, so a pin never outlives its request. That release only drops the pins (the
    collector may run while a tier's lock is held): what it leaves to free, the index's next
    insert frees."""

    __slots__ = ("__weakref__", "_index", "_release")

    def __init__(self, index: PrefixIndex, nodes: list[Node]) -> None:
        self._index = index
        self._release = weakref.finalize(self, index.unpin, nodes)

    def release(self) -> None:
        self._release()
        self._index.free_superseded()


class PrefixIndex:
    """The chains of `store` for one model (`fingerprint`). `layouts(chain_key)`: the ways a
    chunk may be stored, each a tuple of names (whole, then the configured layer groups)."""

    def __init__(self, store: FragmentStore, fingerprint: str,
                 layouts: Callable[[str], Sequence[tuple[str, ...]]], *,
                 chunk_size: int = 0, policy: str = "leaf") -> None:
        if policy not in POLICIES:
            raise ValueError(f"eviction policy {policy!r}: use 'leaf' (the prefix index, "
                             "leaves first, LRU-2), 'leaf-lru' (leaves first, least recently "
                             "used) or 'lru' (each tier's own LRU)")
        self.fingerprint, self.layouts, self.policy = fingerprint, layouts, policy
        self._leaf = policy != "lru"  # the index evicts (leaves first)
        self.chunk_size = chunk_size  # 0: unknown, so no tail is taken for redundant
        self.tiers = store.tier_list()
        self._tier_at = {t.name: i for i, t in reversed(list(enumerate(self.tiers)))}
        self._nodes: dict[str, Node] = {}
        self._by_name: dict[str, Node] = {}
        self._lock = threading.RLock()
        self._cascading = False
        # pinned tails a newer path repeats (`_supersede`), each with the node whose path
        # repeats it: freed once their last pin goes (a chat turn pins the tail it reuses
        # while its own longer tail is stored), by `free_superseded`
        self._superseded: dict[str, tuple[Node, Node]] = {}
        self.evictions = 0  # nodes evicted from a tier by `evict`
        # the leaf order's first key, smaller goes first (then least recent access, deepest,
        # key): the second-to-last access for LRU-2, nothing for the plain order. `bench
        # pressure`'s clairvoyant reference replaces it with each chunk's next read; a rank
        # may change only when its node is touched or stored (the node is re-pushed then)
        self.rank: Callable[[Node], float] = (
            _second_to_last_access if policy == "leaf" else _no_rank)
        # per tier, the eviction candidates by (rank, last access, -end, key), rank the
        # second-to-last access (LRU-2) or 0: pushed whenever a node's access, pins or what
        # its tier and its children hold changes; a popped entry that no longer describes its
        # node is skipped (lazy deletion), so `evict` never scans every node
        self._heaps: list[list[tuple[float, float, int, str, int, Node]]] = [
            [] for _ in self.tiers]
        self._pushed = itertools.count()  # ties (one node pushed twice) never compare nodes
        self.rebuild()
        # tiers whose contents the index may remove (not a shared, self-evicting Redis)
        self._owned = [not t.self_evicting for t in self.tiers]
        for i, tier in enumerate(self.tiers):
            tier.add_remove_listener(partial(self._on_remove, i))
            if self._leaf and self._owned[i]:
                tier.evictor = partial(self._make_room, i)

    # -- public API ----------------------------------------------------------------------

    def rebuild(self) -> int:
        """Forget everything and read the tiers' indexes (no fragment is read); return the
        nodes known. Entries of other models, and names that are not their chunk's (passage
        KV), are not chains and are skipped."""
        with self._lock:
            self._nodes.clear()
            self._by_name.clear()
            self._superseded.clear()
            for i, tier in enumerate(self.tiers):
                by_chain: dict[str, list[tuple[str, int]]] = {}
                for e in tier.entries():
                    if e.fingerprint not in ("", self.fingerprint):  # "": not recorded
                        continue  # (the key check below still binds it to this model)
                    chain: str = next_key(e.parent, self.fingerprint, e.tokens)
                    if e.name != chain and not e.name.startswith(chain + "."):
                        continue
                    node = self._place(chain, e.parent, e.start, e.tokens)
                    node.last_access = max(node.last_access, e.last_access)
                    by_chain.setdefault(chain, []).append((e.name, e.nbytes))
                for chain, held in by_chain.items():
                    self._complete(self._nodes[chain], i, dict(held))
            self._fill_starts()
            self._reheap()
            return sum(1 for n in self._nodes.values() if not n.root)

    def insert(self, key: str, parent: str, start: int, tokens: np.ndarray,
               names: Sequence[str], nbytes: int, now: float) -> None:
        """Record a chunk just stored under `names` (`Writeback`): which tiers took it. With
        the leaf policy, one that hangs off a chain no lookup can reach is freed at once."""
        with self._lock:
            self.free_superseded()  # left by a lease the collector released
            node = self._place(key, parent, start, np.asarray(tokens, np.int32))
            node.touch(now)  # stored again: wanted again (a new node: read once)
            node.names, node.nbytes = tuple(names), nbytes
            self._by_name.update(dict.fromkeys(node.names, node))
            for i, tier in enumerate(self.tiers):  # a tier that cannot answer now (a Redis
                if all(tier.contains(n) for n in node.names):  # down) keeps what it had:
                    self._set(node, i, True)  # removals come by its events
            self._mark(node)
            if self._leaf and node.held:
                if not self._reachable(node.parent):
                    self._free_subtree(node)
                else:
                    self._supersede(node)
            self._prune(node)

    def nbytes(self, key: str) -> int:
        """The bytes recorded for chunk `key` (0 where the index does not hold it)."""
        with self._lock:
            node = self._nodes.get(key)
            return node.nbytes if node is not None and node.names else 0

    def saw(self, key: str, parent: str, start: int, tokens: np.ndarray,
            names: Sequence[str], nbytes: int, tier: str, now: float) -> None:
        """Record a hit on a chunk read from `tier` (and promoted into the faster tiers):
        its last access, and the node itself if the index did not know it."""
        with self._lock:
            node = self._nodes.get(key)
            if node is None or node.start < 0:
                node = self._place(key, parent, start, np.asarray(tokens, np.int32))
            if not node.names:
                node.names, node.nbytes = tuple(names), nbytes
                self._by_name.update(dict.fromkeys(node.names, node))
            node.touch(now)
            j = self._tier_at.get(tier, len(self.tiers) - 1)
            for i in range(j + 1):
                self._set(node, i, i == j or all(self.tiers[i].contains(n) for n in node.names))
            self._mark(node)

    def missed(self, key: str) -> None:
        """A chunk the index thought held was not found (another process removed it, a
        tier dropped it without telling): it is held nowhere now. Nothing is cascaded: a
        tier that could not answer (a Redis node down) may hold it again later."""
        with self._lock:
            node = self._nodes.get(key)
            if node is not None and not node.root:
                node.held = 0
                self._mark(node.parent)
                self._prune(node)

    def successor(self, root: str, path: Sequence[str], ids: np.ndarray, limit: int,
                  chunk_size: int, min_gain: int) -> Successor | None:
        """The stored chunk after the first `len(path)` chunks of the chain (under `root`)
        whose leading tokens match `ids` furthest, if it restores at least `min_gain` more
        tokens (up to `limit`). Candidates are the children of the last chunk (the tails
        and chunks that follow it) and of the one before it: a cache written before every
        tail hung off its last full chunk holds tails shorter than a full chunk's minimum
        span (`fragment.MIN_SPAN`) stored together with the chunk before them."""
        c, n = chunk_size, len(path)
        best: Successor | None = None
        with self._lock:
            for k0 in range(max(0, n - 1), n + 1):
                parent = self._nodes.get(path[k0 - 1] if k0 else root)
                if parent is None:
                    continue
                for child in parent.children.values():
                    if not child.held or child.start != k0 * c or self._repeated(child):
                        continue  # (a tail a held path repeats: that path matches as far)
                    end = k0 * c + common_prefix(child.tokens, ids[k0 * c : limit])
                    gain = end - max(n * c, best.end if best else 0)
                    if gain > 0 and gain >= min_gain:
                        best = Successor(child.key, k0, end)
        return best

    def covers(self, parent: str, start: int, tokens: Sequence[int] | np.ndarray) -> bool:
        """Whether a held chunk under `parent` from position `start` holds `tokens` and
        possibly more (they are its leading tokens): their KV is held already, since the same
        tokens after the same prefix have the same KV, and storing them would hold it twice."""
        ids = np.asarray(tokens, np.int32)
        with self._lock:
            up = self._nodes.get(parent)
            return up is not None and any(
                child.held and child.start == start and len(child.tokens) >= len(ids)
                and np.array_equal(child.tokens[: len(ids)], ids)
                for child in up.children.values())

    def pin(self, keys: Iterable[str]) -> Lease:
        """Pin the nodes of `keys` (a request's path) until `Lease.release`."""
        with self._lock:
            nodes = [n for n in (self._nodes.get(k) for k in keys) if n is not None]
            for n in nodes:
                n.lock_ref += 1
        return Lease(self, nodes)

    def evict(self, nbytes: int, tier: int = 0,
              done: Callable[[], bool] | None = None) -> int:
        """Free at least `nbytes` from tier `tier` (as far as unpinned leaves allow), least
        recently used leaf first; return the bytes freed. A leaf here is a node with no child
        held in this tier; one that no other tier holds must have no child held anywhere
        (it would orphan it). `done()`: stop as soon as it says so (the tier's own count)."""
        freed = 0
        with self._lock:
            # oldest second-to-last access first (LRU-2; "leaf-lru": all 0), then least
            # recently used; of a path touched at once, the deepest first (the tail, as vLLM
            # frees a request's blocks), then by key: the same order every run
            heap = self._heaps[tier]
            while heap and freed < nbytes and not (done and freed and done()):
                _, access, neg_end, _, _, node = heapq.heappop(heap)
                if (self._nodes.get(node.key) is not node or access != node.last_access
                        or neg_end != -node.end or not self._evictable(node, tier)):
                    continue  # stale: a newer entry describes it, or it is not a leaf now
                self._drop(node, tier)  # its parent is pushed, should it be a leaf now
                self.tiers[tier].count_evictions(len(node.names))  # the tier's own stats
                freed += node.nbytes
                self.evictions += 1
        return freed

    def _make_room(self, tier: int, nbytes: int) -> int:
        """The tiers' evictor: leaves out until the tier is within its capacity by its own
        count (a disk entry's bytes are its file's, more than the KV the index counts)."""
        t = self.tiers[tier]
        return self.evict(nbytes, tier, done=lambda: t.excess_bytes() <= 0) or 0

    def orphan_bytes(self) -> int:
        """Bytes the tiers hold (per tier) for nodes no lookup can reach: one of their
        ancestors is held by no tier."""
        with self._lock:
            reach: set[int] = set()
            stack = [n for n in self._nodes.values() if n.root]
            while stack:
                node = stack.pop()
                reach.add(id(node))
                stack.extend(c for c in node.children.values() if c.held)
            return sum(n.nbytes * bin(n.held).count("1") for n in self._nodes.values()
                       if n.held and id(n) not in reach)

    def held_bytes(self, tier: int) -> int:
        with self._lock:
            return sum(n.nbytes for n in self._nodes.values() if n.held >> tier & 1)

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for n in self._nodes.values() if not n.root)

    # -- private helpers -----------------------------------------------------------------

    def _place(self, key: str, parent: str, start: int, tokens: np.ndarray) -> Node:
        """The node of `key` under `parent`, made (or a placeholder filled in) as needed."""
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = Node(key)
        up = self._nodes.get(parent)
        if up is None:
            up = self._nodes[parent] = Node(parent, root=start == 0 or parent == "")
        elif start == 0 and up.start < 0 and not up.root and up.parent is None:
            up.root = True  # a placeholder that turns out to be a tenant's root
        if node.parent is not up:
            if node.parent is not None:
                node.parent.children.pop(key, None)
                self._mark(node.parent)
            node.parent = up
            up.children[key] = node
        node.start, node.tokens, node.root = start, tokens, False
        return node

    def _supersede(self, node: Node) -> None:
        """Free the stored tails `node` makes redundant: a tail (not a full chunk) beside
        its path, under its parent or grandparent, whose tokens the path through `node`
        repeats from the same start, and which is shorter than that path. Any match that
        tail gives, the path gives too (the radix step compares tokens from the tail's
        start, and the same tokens at the same positions after the same prefix have the
        same KV), so it only takes room: a chat turn's partial tail, once the next turn
        has filled its chunk or stored a longer tail of the same chunk. (A tail under the
        grandparent is one an older cache stored together with the chunk before it.) A
        pinned tail (the one that turn reused, pinned until its answer is stored) is freed
        once its last pin goes (`free_superseded`, from `Lease.release` or the next insert)."""
        c = self.chunk_size
        if not c:
            return
        level, tokens = node, node.tokens
        for _ in range(2):
            anchor = level.parent
            if anchor is None or not level.held:
                return
            for leaf in list(anchor.children.values()):
                if (leaf is not level and not leaf.children
                        and len(leaf.tokens) != c and leaf.held and leaf.start == level.start
                        and len(leaf.tokens) < len(tokens)
                        and np.array_equal(leaf.tokens, tokens[: len(leaf.tokens)])):
                    if leaf.lock_ref:
                        self._superseded[leaf.key] = (leaf, node)
                    else:
                        self._free_subtree(leaf)
            level, tokens = anchor, np.concatenate([anchor.tokens, tokens])
            if level.root:
                return

    def _fill_starts(self) -> None:
        """Rows of an older disk index lack their start: place them after their parent."""
        stack = [n for n in self._nodes.values() if n.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if child.start < 0 and (node.root or node.start >= 0):
                    child.start = 0 if node.root else node.end
                stack.append(child)

    def _complete(self, node: Node, tier: int, held: dict[str, int]) -> None:
        """Mark `node` held in `tier` if `held` (name -> bytes) covers one of its layouts."""
        for names in self.layouts(node.key):
            if all(n in held for n in names):
                node.names, node.nbytes = names, sum(held[n] for n in names)
                self._by_name.update(dict.fromkeys(names, node))
                self._set(node, tier, True)
                return

    def _set(self, node: Node, tier: int, on: bool) -> None:
        held = node.held | 1 << tier if on else node.held & ~(1 << tier)
        if held != node.held:
            node.held = held
            self._mark(node)
            self._mark(node.parent)  # a child's holdings decide whether it is a leaf

    def _mark(self, node: Node | None) -> None:
        """Push `node` as an eviction candidate of each tier holding it (see `_heaps`)."""
        if node is None or node.root or not node.held:
            return
        entry = self._entry(node)
        for i, heap in enumerate(self._heaps):
            if node.held >> i & 1:
                heapq.heappush(heap, entry)
                if len(heap) > 4 * len(self._nodes) + 64:
                    self._reheap(i)

    def _entry(self, n: Node) -> tuple[float, float, int, str, int, Node]:
        return (self.rank(n), n.last_access, -n.end, n.key, next(self._pushed), n)

    def _reheap(self, *tiers: int) -> None:
        """The candidate heaps from the nodes themselves (after a rebuild, or when stale
        entries outnumber the nodes)."""
        for i in tiers or range(len(self.tiers)):
            bit = 1 << i
            heap = [self._entry(n) for n in self._nodes.values() if not n.root and n.held & bit]
            heapq.heapify(heap)
            self._heaps[i] = heap

    def _reachable(self, node: Node | None) -> bool:
        while node is not None and not node.root:
            if not node.held:
                return False
            node = node.parent
        return node is not None

    def _evictable(self, node: Node, tier: int) -> bool:
        bit = 1 << tier
        if node.root or not node.held & bit or node.lock_ref or not self._owned[tier]:
            return False
        if any(c.held & bit for c in node.children.values()):
            return False
        return bool(node.held & ~bit) or not any(c.held for c in node.children.values())

    def _drop(self, node: Node, tier: int) -> None:
        """Delete `node`'s fragments from `tier` (its remove events find it already gone)."""
        self._set(node, tier, False)
        for name in node.names:
            try:
                self.tiers[tier].delete(name)
            except StoreError:
                pass  # counted and logged by the tier
        self._prune(node)

    def _prune(self, node: Node) -> None:
        """Forget nodes that no tier holds and nothing hangs off, up the path (an empty
        tenant root too)."""
        while not node.root and not node.held and not node.children and not node.lock_ref:
            self._nodes.pop(node.key, None)
            for name in node.names:
                if self._by_name.get(name) is node:
                    del self._by_name[name]
            up, node.parent = node.parent, None
            if up is None:
                return
            up.children.pop(node.key, None)
            node = up
        if node.root and not node.children:
            self._nodes.pop(node.key, None)

    def _free_subtree(self, node: Node) -> None:
        """Delete `node` and its descendants from every tier: no lookup can reach them."""
        self._cascading = True
        try:
            stack, order = [node], []
            while stack:
                n = stack.pop()
                order.append(n)
                stack.extend(n.children.values())
            for n in reversed(order):  # leaves first
                for i in range(len(self.tiers)):
                    if n.held >> i & 1 and self._owned[i]:
                        self._drop(n, i)
        finally:
            self._cascading = False

    def _on_remove(self, tier: int, name: str) -> None:
        """A tier dropped `name` (eviction, expiry, damage, delete, clear)."""
        with self._lock:
            node = self._by_name.get(name)
            if node is None or not node.held >> tier & 1:
                return
            t = self.tiers[tier]
            whole = (node.key,)
            if name != node.key and whole != node.names and t.contains(node.key):
                node.names = whole  # compacted: the whole-layer fragment replaced the groups
                self._by_name[node.key] = node
                return
            self._set(node, tier, False)
            if not node.held and self._leaf and not self._cascading:
                self._free_subtree(node)
            self._prune(node)

    def unpin(self, nodes: list[Node]) -> None:
        """Drop one pin from each of `nodes` (what a `Lease` releases, once)."""
        with self._lock:
            for n in nodes:
                n.lock_ref -= 1
                if not n.lock_ref:
                    self._mark(n)
                if n.key not in self._superseded:
                    self._prune(n)

    def free_superseded(self) -> int:
        """Free the superseded tails no request pins any more (`_supersede`) whose newer path
        is still held and reachable; return how many. Kept: one that path no longer covers."""
        freed = 0
        with self._lock:
            for key, (leaf, by) in list(self._superseded.items()):
                if leaf.lock_ref:
                    continue
                del self._superseded[key]
                if self._repeats(by, leaf):
                    self._free_subtree(leaf)
                    freed += 1
                elif self._nodes.get(key) is leaf:  # (not a node placed since under its key)
                    self._prune(leaf)
        return freed

    def _repeats(self, by: Node, leaf: Node) -> bool:
        """Whether `by`'s path still stands for superseded `leaf`: both in the index, `by`
        held and reachable, `leaf` a held leaf."""
        return (self._nodes.get(leaf.key) is leaf and self._nodes.get(by.key) is by
                and bool(leaf.held) and not leaf.children and self._reachable(by))

    def _repeated(self, node: Node) -> bool:
        """A superseded tail whose newer path still stands (`successor` skips it)."""
        entry = self._superseded.get(node.key)
        return entry is not None and entry[0] is node and self._repeats(entry[1], node)
