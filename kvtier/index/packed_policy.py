"""The policies of kvtier/index/policy.py over catalog slots, with per-block state in arrays.

Same decisions, other layout: a block is the integer slot the catalog gives it (reused
after the block is freed), each per-block field one element of a typed array
(kvtier/index/slots.py), so a million blocks cost a few tens of megabytes and no object
the garbage collector walks. Blocks that have left (ghosts, reuse memory, use counts)
are keyed by their 64-bit key digest instead, in fixed-size or bounded tables.

Layout, per slot of one tier's order (bytes per block in brackets):

* `PackedLru` [8] — a circular doubly-linked list in two int32 arrays (`_prev`, `_next`,
  element 0 the sentinel, slot s at s + 1; `_next == -1`: not in the tier).
* `PackedS3Fifo` [14 + ghosts] — the small and main FIFOs as two circular lists over one
  pair of int32 link arrays (sentinels 0 and 1, slot s at s + 2), which queue in a byte,
  the 0..3 use count in a byte, the size in a uint32; its ghost FIFO a `DigestTable` of
  key digests (≈ 26 bytes a ghost, as many ghosts as main holds).
* `PackedValue` [56, + ≈ 26 in DRAM] — per slot: priority (float64), seq (int64),
  position, size, parent slot, and the children cached in this tier as an intrusive
  sibling list (`_first` child, `_next_sib`, `_prev_sib`: int32s) in place of child
  sets; an indexed binary min-heap (`_heap`, `_where`) of the blocks that may be chosen
  — those with no cached child — ordered by (priority, −position, seq); the safety
  net's recency list (`_rprev`, `_rnext`) and, in DRAM, its shadow LRU (a DigestTable
  of as many key digests as the tier holds). Raising a chain is array writes: its
  ancestors have children, so they are not in the heap; a block enters it when its last
  cached child leaves.
* `PackedChainArc` [37, + ≈ 26 shadow, + ≈ 26 a ghost] — DRAM's order (ChainArcPolicy):
  three circular lists over one pair of int32 link arrays, the list in a byte, position,
  parent and cached-children count as int32s, the last touch as an int64; the safety
  net's recency list (two int32s) and shadow LRU (a DigestTable); its ghosts one
  DigestTable per list a block left.
* `DigestSketch` (kvtier/index/sketch.py) [fixed, 256 KiB] — the count-min sketch in four
  bytearrays, row r indexed by the digest's r-th 16-bit quarter. `key_digest` packs the
  four indices FrequencySketch took from xxh3-128(`repr(key)`), so the counts, collisions
  included, are FrequencySketch's; the repr is hashed once per block (by the catalog),
  not per use.
* `PackedReuse`, `PackedGhosts` [≈ 26 a remembered key] — `DigestTable`s in LRU order.

What is and is not identical to policy.py (tests/index/test_packed_policy.py checks it):

* LRU, S3-FIFO, the sketch, the reuse estimate, admission and ghosts make the same
  decisions for the same calls (two keys with one 64-bit digest aside: those are one key
  to the ghost tables and the reuse memory).
* The value policy orders blocks as ValuePolicy's lazy heap does but for one case.
  ValuePolicy leaves a block's superseded heap items in place until they surface or a
  compaction drops them; if the block leaves the tier and in a later stay reaches
  *exactly* (float equality) the priority one of them carries, that item counts again,
  with the old stay's (−position, seq), and among equal priorities the block sorts as
  if it had come back then. Here a block's order goes when it leaves: the decisions are
  ValuePolicy's with its `remove` dropping the block's items. Equality across stays needs
  L unmoved and the same uses × saving: a block removed (not evicted) and put back
  before any eviction, or one that saves nothing (priority L) evicted and back before L
  moves. The shared trace's replays never do this: every figure is identical.

Slots named as a parent must keep naming that block: the children lists are keyed by the
parent's slot whether or not the parent is in the tier (a parent that comes back finds
them, as ValuePolicy's dict of child sets by key did), so the catalog must not give such
a slot to another block while `names_as_parent` is true in any tier.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any

import numpy as np

from kvtier.index.packed_arc import PackedChainArc
from kvtier.index.policy import (
    BlockInfo,
    ValueModel,
    ValuePolicy,
)
from kvtier.index.reach_net import ReachNet
from kvtier.index.sketch import DigestSketch
from kvtier.index.slot_policy import SlotPolicy
from kvtier.index.slots import (
    NO_SLOT,
    DigestTable,
    all_distinct,
    column,
    extend,
    first_slot,
    grow_column,
    headroom,
    link_last,
    unlink,
)

__all__ = [
    "NO_SLOT",
    "DigestSketch",
    "PackedChainArc",
    "PackedLru",
    "PackedS3Fifo",
    "PackedValue",
    "SlotPolicy",
]


# ---- LRU ------------------------------------------------------------------------------


class PackedLru(SlotPolicy):
    """Least recently used first: one circular list, oldest after the sentinel."""

    def __init__(self) -> None:
        self._prev = array("i", [0])
        self._next = array("i", [0])
        self._len = 0

    def _present(self, node: int) -> bool:
        return node < len(self._next) and self._next[node] >= 0

    def _append(self, node: int) -> None:
        link_last(self._prev, self._next, 0, node)

    def insert(self, slot: int, size_bytes: int, position: int = 0, parent: int = NO_SLOT) -> None:
        node = slot + 1
        if node >= len(self._next):
            count = headroom(len(self._next), node + 1) - len(self._next)
            extend(self._prev, count, -1)
            extend(self._next, count, -1)
        if self._next[node] >= 0:
            unlink(self._prev, self._next, node)
        else:
            self._len += 1
        self._append(node)

    def insert_many(self, slots: np.ndarray, sizes: np.ndarray, digests: np.ndarray) -> None:
        """`insert` of each: new slots linked after the newest in one pass."""
        nodes = slots.astype(np.int64) + 1
        if not len(nodes):
            return
        top = int(nodes.max())
        if top >= len(self._next):
            count = headroom(len(self._next), top + 1) - len(self._next)
            extend(self._prev, count, -1)
            extend(self._next, count, -1)
        nxt = np.frombuffer(self._next, dtype=np.int32)
        if not all_distinct(nodes) or (nxt[nodes] >= 0).any():
            del nxt
            super().insert_many(slots, sizes, digests)  # some are here already: hits
            return
        prv = np.frombuffer(self._prev, dtype=np.int32)
        last = int(prv[0])
        nxt[last] = nodes[0]
        prv[nodes[0]] = last
        links = nodes.astype(np.int32)  # the lists' type: a cast in the store lets go of the GIL
        nxt[nodes[:-1]] = links[1:]
        prv[nodes[1:]] = links[:-1]
        nxt[nodes[-1]] = 0
        prv[0] = nodes[-1]
        self._len += len(nodes)
        del nxt, prv

    def hit(self, slot: int) -> None:
        node = slot + 1
        if self._present(node):
            unlink(self._prev, self._next, node)
            self._append(node)

    def remove(self, slot: int) -> None:
        node = slot + 1
        if self._present(node):
            unlink(self._prev, self._next, node)
            self._next[node] = -1
            self._len -= 1

    def victim(self, evictable: Callable[[int], bool]) -> int | None:
        slot = first_slot(self._next, evictable)
        if slot is not None:
            unlink(self._prev, self._next, slot + 1)
            self._next[slot + 1] = -1
            self._len -= 1
        return slot

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and slot >= 0 and self._present(slot + 1)

    def __len__(self) -> int:
        return self._len


# ---- S3-FIFO --------------------------------------------------------------------------

_SMALL, _MAIN = 1, 2  # a slot's queue (0: not in the tier)


class PackedS3Fifo(SlotPolicy):
    """S3-FIFO by bytes, as S3FifoPolicy: small queue 10 % of the tier, main the rest,
    ghosts (key digests, `digest_of(slot)`) as many as main holds."""

    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity_bytes: int, digest_of: Callable[[int], int]) -> None:
        self._capacity = capacity_bytes
        self._digest_of = digest_of
        # Nodes 0 and 1: the sentinels of the small and main lists; slot s is node s + 2.
        self._prev = array("i", [0, 1])
        self._next = array("i", [0, 1])
        self._queue = bytearray()  # per slot: 0, _SMALL or _MAIN
        self._freq = bytearray()
        self._size = array("I")
        self._small_len = 0
        self._main_len = 0
        self._small_bytes = 0
        self._ghost = DigestTable()

    def _grow(self, slot: int) -> None:
        size = len(self._queue)
        count = headroom(size, slot + 1) - size
        self._queue.extend(bytes(count))
        self._freq.extend(bytes(count))
        extend(self._size, count, 0)
        extend(self._prev, count, 0)
        extend(self._next, count, 0)

    def _append(self, sentinel: int, node: int) -> None:
        link_last(self._prev, self._next, sentinel, node)

    def insert(self, slot: int, size_bytes: int, position: int = 0, parent: int = NO_SLOT) -> None:
        if slot >= len(self._queue):
            self._grow(slot)
        if self._queue[slot]:
            self.hit(slot)
            return
        self._size[slot] = size_bytes
        self._freq[slot] = 0
        if self._ghost.pop(self._digest_of(slot)) >= 0:
            self._queue[slot] = _MAIN
            self._main_len += 1
            self._append(_MAIN - 1, slot + 2)
        else:
            self._queue[slot] = _SMALL
            self._small_len += 1
            self._small_bytes += size_bytes
            self._append(_SMALL - 1, slot + 2)

    def hit(self, slot: int) -> None:
        if slot in self and self._freq[slot] < self.MAX_FREQ:
            self._freq[slot] += 1

    def remove(self, slot: int) -> None:
        if slot not in self:
            return
        unlink(self._prev, self._next, slot + 2)
        if self._queue[slot] == _SMALL:
            self._small_len -= 1
            self._small_bytes -= self._size[slot]
        else:
            self._main_len -= 1
        self._queue[slot] = 0

    def victim(self, evictable: Callable[[int], bool]) -> int | None:
        queue, freq, nxt = self._queue, self._freq, self._next
        # Bounded: every block is looked at a few times at most (freq only goes down).
        for _ in range(4 * (len(self) + 1)):
            use_small = self._small_len > 0 and (
                self._small_bytes >= self.SMALL_FRACTION * self._capacity or not self._main_len
            )
            sentinel = _SMALL - 1 if use_small else _MAIN - 1
            node = nxt[sentinel]
            if node == sentinel:
                return None
            slot = node - 2
            if not evictable(slot):
                unlink(self._prev, self._next, node)  # in use: look again later
                self._append(sentinel, node)
                continue
            unlink(self._prev, self._next, node)
            if use_small:
                self._small_len -= 1
                self._small_bytes -= self._size[slot]
                if freq[slot] > 0:
                    freq[slot] = 0
                    queue[slot] = _MAIN  # used while on probation: promote
                    self._main_len += 1
                    self._append(_MAIN - 1, node)
                    continue
                self._remember_ghost(slot)
            else:
                if freq[slot] > 0:
                    freq[slot] -= 1
                    self._append(_MAIN - 1, node)  # a second chance
                    continue
                self._main_len -= 1
            queue[slot] = 0
            return slot
        return None

    def _remember_ghost(self, slot: int) -> None:
        ghost = self._ghost
        ghost.put(self._digest_of(slot))
        while len(ghost) > max(self._main_len, 1):
            ghost.pop_oldest()

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and 0 <= slot < len(self._queue) and self._queue[slot] > 0

    def __len__(self) -> int:
        return self._small_len + self._main_len


# ---- eviction by value ----------------------------------------------------------------


_ABSENT, _PARENT = -1, -2  # _where of a slot not in the tier / in it with cached children


_GROW_AHEAD_FROM = 1 << 14
# PackedValue's per-slot columns: (attribute, fill, how much longer than the slots it is),
# `_where` last (its length is the capacity every check reads).
_GROWN: tuple[tuple[str, float, int], ...] = (
    ("_prio", 0.0, 0),
    ("_seq", 0, 0),
    ("_pos", 0, 0),
    ("_size", 0, 0),
    ("_parent", -1, 0),
    ("_first", -1, 0),
    ("_next_sib", -1, 0),
    ("_prev_sib", -1, 0),
    ("_rprev", 0, 1),  # one longer than the rest: node 0 is the sentinel
    ("_rnext", 0, 1),
    ("_where", -1, 0),
)


class PackedValue(SlotPolicy):
    """ValuePolicy's greedy-dual-size-frequency with leaves before parents, on an
    indexed heap of the blocks that can be chosen: those in the tier with no cached
    child. A block with cached children is never a victim, so it stays out of the heap
    (raising a chain's priorities is then a few array writes, not a heap move per
    ancestor) and goes in, at its priority then, when its last cached child leaves.

    ValuePolicy pushes a new (priority, −position, seq) item on every `_set` and skips
    stale ones when they surface, so among a block's live items the one that counts is
    the first pushed at its current priority: here `_seq` changes only when the
    priority does, which gives the same order (seq values differ, their order does
    not)."""

    STEP = ValuePolicy.STEP

    def __init__(
        self,
        tier: str,
        fallback: str | None,
        model: ValueModel,
        uses_of: Callable[[int], int],
        digest_of: Callable[[int], int] | None = None,
        shadow: bool = False,
        sketch: DigestSketch | None = None,
        reach_net: bool = False,
    ) -> None:
        self._tier = tier
        # The sketch `uses_of` counts in, by the digests `insert_many` is given (None:
        # insert_many goes one by one).
        self._sketch = sketch
        self._fallback = fallback
        self._model = model
        self._uses_of = uses_of  # the sketch's count for the slot's block
        self._inflation = 0.0  # L: rises to each evicted priority
        self._tick = 0  # seq of the last priority change
        self._len = 0
        # Per slot, in mapped columns (slots.column): the NVMe order's are a dozen arrays
        # of a million slots and more, which realloc growth left holes behind in the heap.
        self._prio: memoryview[float] = column("d")
        self._seq: memoryview[int] = column("q")
        self._pos: memoryview[int] = column("i")
        self._size: memoryview[int] = column("I")
        self._parent: memoryview[int] = column("i")
        self._first: memoryview[int] = column("i")  # first child cached in this tier (-1: none)
        self._next_sib: memoryview[int] = column("i")
        self._prev_sib: memoryview[int] = column("i")
        self._where: memoryview[int] = column("i")  # index in _heap, or _ABSENT / _PARENT
        self._heap = array("i")
        # ValuePolicy's safety net: recency as a circular list (node 0 the sentinel, slot s
        # at s + 1, oldest first) and the shadow LRU's keys by digest (by slot without
        # `digest_of`: right only while slots are not reused, as in the replay's SlotMap).
        self._rprev: memoryview[int] = column("i", 1)
        self._rnext: memoryview[int] = column("i", 1)
        self._digest_of: Callable[[int], int] = digest_of or int
        self._shadow: DigestTable | None = DigestTable() if shadow else None
        self._reach = ReachNet() if reach_net else None
        self.weight = 1.0
        self._credit = 0.0
        self._ahead_from = 1 << 62  # from this slot on, `_grow_ahead` (set as it grows)
        self.grow_ahead_from = _GROW_AHEAD_FROM  # arrays shorter: grown all at once (cheap)

    def _columns(self) -> tuple[tuple[memoryview[Any], float, int], ...]:
        """The per-slot columns, each with its fill and how much longer than the slots it
        is; `_where` last: its length is the capacity every other check reads."""
        return tuple((getattr(self, name), fill, extra) for name, fill, extra in _GROWN)

    def _grow(self, slot: int) -> None:
        self._grow_to(headroom(len(self._where), slot + 1), every=True)

    def _grow_to(self, slots: int, every: bool) -> None:
        """Columns to `slots` long: all of them, or (`every` false) the first one short."""
        for name, fill, extra in _GROWN:
            values: memoryview[Any] = getattr(self, name)
            if slots + extra > len(values):
                setattr(self, name, grow_column(values, slots + extra, fill))
                if not every:
                    break
        size = len(self._where)
        self._ahead_from = size - (size >> 4) if size >= self.grow_ahead_from else 1 << 62

    def _grow_ahead(self) -> None:
        """Within the last sixteenth of the capacity: one column grown a step per call, to
        where `_grow` would take them all. (Grown by mremap, a column's growth copies
        nothing; when these were arrays, growing all eleven at once copied ~90 MB at a
        million slots, a 25-55 ms stall, which this spread out.)"""
        size = len(self._where)
        self._grow_to(headroom(size, size + 1), every=False)

    def _touch(self, slot: int, hit: bool) -> None:
        """ValuePolicy._touch: most recent now; the shadow's verdict moves the weight."""
        node = slot + 1
        if hit:
            unlink(self._rprev, self._rnext, node)
        link_last(self._rprev, self._rnext, 0, node)
        if self._reach is not None:
            self._reach.touched(self._digest_of(slot), self._len)
        shadow = self._shadow
        if shadow is None:
            return
        digest = self._digest_of(slot)
        if (digest in shadow) != hit:
            step = self.STEP if hit else -self.STEP
            self.weight = min(max(self.weight + step, 0.0), 1.0)
        shadow.put(digest, to_end=True)
        while len(shadow) > max(self._len, 1):
            shadow.pop_oldest()

    def reached(self, digest: int, held: bool) -> None:
        """ValuePolicy.reached, by key digest."""
        if self._reach is not None:
            step = self._reach.reached(digest, held)
            self.weight = min(max(self.weight + step, 0.0), 1.0)

    # ---- the heap: a < b when (prio, -pos, seq) of a is smaller -----------------------
    def _sift_up(self, i: int, top: int = 0) -> None:
        """Move heap[i] up to its place, no higher than index `top`."""
        heap, where, prio, pos, seq = self._heap, self._where, self._prio, self._pos, self._seq
        s = heap[i]
        p, q, n = prio[s], pos[s], seq[s]
        while i > top:
            j = (i - 1) >> 1
            t = heap[j]
            pt = prio[t]
            if pt < p or (pt == p and (pos[t] > q or (pos[t] == q and seq[t] < n))):
                break
            heap[i] = t
            where[t] = i
            i = j
        heap[i] = s
        where[s] = i

    def _sift_down(self, i: int) -> None:
        """Move heap[i] down to its place: as heapq does, first to a leaf along the smaller
        children (one comparison a level), then back up (a raised block usually belongs
        near the bottom, so that is a step or two)."""
        heap, where, prio, pos, seq = self._heap, self._where, self._prio, self._pos, self._seq
        size = len(heap)
        start = i
        s = heap[i]
        c = 2 * i + 1
        while c < size:
            t = heap[c]
            if c + 1 < size:
                u = heap[c + 1]
                pt, pu = prio[t], prio[u]
                if pu < pt or (
                    pu == pt and (pos[u] > pos[t] or (pos[u] == pos[t] and seq[u] < seq[t]))
                ):
                    c, t = c + 1, u
            heap[i] = t
            where[t] = i
            i = c
            c = 2 * i + 1
        heap[i] = s
        where[s] = i
        self._sift_up(i, start)

    def _push(self, slot: int) -> None:
        self._heap.append(slot)
        self._sift_up(len(self._heap) - 1)

    def _take(self, slot: int, now: int) -> None:
        """Take `slot` out of the heap; its _where becomes `now`."""
        heap, where = self._heap, self._where
        i = where[slot]
        where[slot] = now
        last = heap.pop()
        if last != slot:
            heap[i] = last
            where[last] = i
            self._sift_up(i)
            self._sift_down(where[last])

    # ---- priorities -----------------------------------------------------------------
    def _own_priority(self, slot: int) -> float:
        size = self._size[slot]
        info = BlockInfo(size, self._pos[slot])
        saving = self._model.saving_s(self._tier, self._fallback, info)
        # Uses, not the learned reuse estimate: see ValuePolicy._own_priority.
        uses = max(self._uses_of(slot), 1)
        return self._inflation + uses * saving / max(size, 1)

    def _raise(self, slot: int, priority: float) -> None:
        self._prio[slot] = priority
        self._tick += 1
        self._seq[slot] = self._tick
        if self._where[slot] >= 0:
            self._sift_down(self._where[slot])  # larger: further from the root

    def _set(self, slot: int, priority: float) -> None:
        prio, where = self._prio, self._where
        if prio[slot] != priority:  # never lower: a hit takes the max
            self._raise(slot, priority)
        # A parent is worth at least its children: raise the chain above this block.
        parent = self._parent[slot]
        while parent >= 0 and where[parent] != _ABSENT:
            if prio[parent] >= priority:
                break
            self._raise(parent, priority)
            parent = self._parent[parent]

    def insert(self, slot: int, size_bytes: int, position: int = 0, parent: int = NO_SLOT) -> None:
        if slot >= self._ahead_from:
            self._grow_ahead()
        if max(slot, parent) >= len(self._where):
            self._grow(max(slot, parent))
        where = self._where
        if where[slot] != _ABSENT:
            self.hit(slot)
            return
        self._len += 1
        self._touch(slot, hit=False)
        self._size[slot] = size_bytes
        self._pos[slot] = position
        self._parent[slot] = parent
        if parent >= 0:
            first = self._first[parent]
            self._next_sib[slot] = first
            self._prev_sib[slot] = -1
            if first >= 0:
                self._prev_sib[first] = slot
            elif where[parent] >= 0:
                self._take(parent, _PARENT)  # its first cached child: no longer a candidate
            self._first[parent] = slot
        # Arriving after blocks that extend it (e.g. promoted later): worth as much as they.
        floor = 0.0
        prio, nxt = self._prio, self._next_sib
        child = self._first[slot]
        while child >= 0:
            if child != slot and prio[child] > floor:
                floor = prio[child]
            child = nxt[child]
        self._tick += 1
        self._seq[slot] = self._tick
        prio[slot] = max(self._own_priority(slot), floor)
        if self._first[slot] >= 0:
            where[slot] = _PARENT
        else:
            self._push(slot)
        self._set(slot, prio[slot])

    def insert_run(self, slots: list[int], sizes: list[int]) -> None:
        """`insert` of each (position 0, no parent), in order, as `insert` does it for a
        block new to the tier with no cached child, inlined: the saving asked once a size
        (the model does not change within the call) and the uses by the sketch. Any other
        slot (a hit, a parent) takes `insert` itself, in its turn."""
        sketch = self._sketch
        if self._shadow is not None or sketch is None or not slots:
            super().insert_run(slots, sizes)
            return
        top = max(slots)
        if top >= self._ahead_from:
            self._grow_ahead()
        if top >= len(self._where):
            self._grow(top)
        savings: dict[int, float] = {}
        digest_of, count, reach = self._digest_of, sketch.count, self._reach
        fresh = True
        for slot, size in zip(slots, sizes, strict=True):
            if fresh:  # the columns, again after `insert` (it may grow them)
                where, first, prio = self._where, self._first, self._prio
                rprev, rnext = self._rprev, self._rnext
                fresh = False
            if where[slot] != _ABSENT or first[slot] >= 0:
                self.insert(slot, size)
                fresh = True
                continue
            self._len += 1
            link_last(rprev, rnext, 0, slot + 1)  # _touch: most recent (no shadow)
            if reach is not None:
                reach.touched(digest_of(slot), self._len)
            self._size[slot] = size
            self._pos[slot] = 0
            self._parent[slot] = NO_SLOT
            self._tick += 1
            self._seq[slot] = self._tick
            saving = savings.get(size)
            if saving is None:
                info = BlockInfo(size, 0)
                saving = savings[size] = self._model.saving_s(self._tier, self._fallback, info)
            uses = max(count(digest_of(slot)), 1)
            prio[slot] = self._inflation + uses * saving / max(size, 1)  # _own_priority
            self._push(slot)

    def insert_many(self, slots: np.ndarray, sizes: np.ndarray, digests: np.ndarray) -> None:
        """`insert` of each (position 0, no parent) on arrays: the priorities computed
        at once (one saving per distinct size, the sketch's counts of the digests), the
        recency list linked in one pass, and the heap appended to as it stands when no
        new item would sift up (else pushed one by one: the same heap either way)."""
        n = len(slots)
        if not n:
            return
        slots = slots.astype(np.int64)
        top = int(slots.max())
        if top >= self._ahead_from:
            self._grow_ahead()
            self._grow_ahead()  # a chunk adds thousands: two steps for each
        if top >= len(self._where):
            self._grow(top)
        where = np.frombuffer(self._where, dtype=np.int32)
        first = np.frombuffer(self._first, dtype=np.int32)
        if (
            self._shadow is not None
            or self._sketch is None
            or not all_distinct(slots)
            or (where[slots] != _ABSENT).any()
            or (first[slots] >= 0).any()
        ):
            del where, first
            super().insert_many(slots, sizes, digests)
            return
        del first
        sizes = sizes.astype(np.int64)
        uses = np.maximum(self._sketch.count_many(digests.astype(np.uint64)), 1)
        saving: float | np.ndarray
        if (sizes == sizes[0]).all():  # a batch of one size: one saving (no np.unique)
            saving = self._model.saving_s(self._tier, self._fallback, BlockInfo(int(sizes[0]), 0))
        else:
            distinct, inverse = np.unique(sizes, return_inverse=True)
            saving = np.array(
                [
                    self._model.saving_s(self._tier, self._fallback, BlockInfo(size, 0))
                    for size in distinct.tolist()
                ],
                dtype=np.float64,
            )[inverse]
        priority = self._inflation + uses * saving / np.maximum(sizes, 1)
        prio = np.asarray(self._prio)  # float64: the column's typecode is "d"
        seq = np.frombuffer(self._seq, dtype=np.int64)
        pos = np.frombuffer(self._pos, dtype=np.int32)
        prio[slots] = priority
        seq[slots] = np.arange(self._tick + 1, self._tick + 1 + n, dtype=np.int64)
        self._tick += n
        pos[slots] = 0
        # Stored as the columns' types: a fancy assignment that casts lets go of the GIL,
        # which on the daemon's loop can hand it to an I/O thread and wait for it back.
        np.frombuffer(self._size, dtype=np.uint32)[slots] = sizes.astype(np.uint32)
        np.frombuffer(self._parent, dtype=np.int32)[slots] = NO_SLOT
        # Recency: after the most recent, in order (_touch without a shadow).
        nodes = slots + 1
        rprev = np.frombuffer(self._rprev, dtype=np.int32)
        rnext = np.frombuffer(self._rnext, dtype=np.int32)
        last = int(rprev[0])
        rnext[last] = nodes[0]
        rprev[nodes[0]] = last
        links = nodes.astype(np.int32)
        rnext[nodes[:-1]] = links[1:]
        rprev[nodes[1:]] = links[:-1]
        rnext[nodes[-1]] = 0
        rprev[0] = nodes[-1]
        if self._reach is not None:  # _touch's part, each at the tier's size then
            self._reach.touched_many(digests, self._len)
        self._len += n
        # Would any new item sift up? Its parent in the heap as appended must come first
        # by (priority, -position, seq); then pushing one by one moves nothing.
        h0 = len(self._heap)
        heap = np.frombuffer(self._heap, dtype=np.int32) if h0 else np.zeros(0, np.int32)
        index = np.arange(h0, h0 + n, dtype=np.int64)
        child = index > 0
        up = (index[child] - 1) >> 1
        mine = slots[child]
        parent = np.empty(len(up), dtype=np.int64)
        old = up < h0
        parent[old] = heap[up[old]].astype(np.int64)
        parent[~old] = slots[up[~old] - h0]
        pp, pq, pn = prio[parent], pos[parent], seq[parent]
        p, q, s = prio[mine], pos[mine], seq[mine]
        before = (pp < p) | ((pp == p) & ((pq > q) | ((pq == q) & (pn < s))))
        still = bool(before.all())
        del heap, prio, seq, pos, rprev, rnext
        if still:
            self._heap.extend(array("i", slots.tolist()))
            where[slots] = index.astype(np.int32)
            del where
        else:
            del where
            for slot in slots.tolist():
                self._push(slot)

    def hit(self, slot: int) -> None:
        if slot in self:
            self._touch(slot, hit=True)
            self._set(slot, max(self._own_priority(slot), self._prio[slot]))

    def remove(self, slot: int) -> None:
        if slot not in self:
            return
        self._len -= 1
        unlink(self._rprev, self._rnext, slot + 1)
        if self._where[slot] >= 0:
            self._take(slot, _ABSENT)
        else:
            self._where[slot] = _ABSENT
        parent = self._parent[slot]
        if parent >= 0:
            before, after = self._prev_sib[slot], self._next_sib[slot]
            if before >= 0:
                self._next_sib[before] = after
            else:
                self._first[parent] = after
            if after >= 0:
                self._prev_sib[after] = before
            if self._first[parent] < 0 and self._where[parent] == _PARENT:
                self._push(parent)  # its last cached child left: a candidate again

    def victim(self, evictable: Callable[[int], bool]) -> int | None:
        self._credit += self.weight
        chosen: int | None = None
        if self._credit < 1.0:
            chosen = self._least_recent_leaf(evictable)
        if chosen is None:
            self._credit = max(self._credit - 1.0, 0.0)
            chosen = self._by_value(evictable)
        if chosen is not None:
            self.remove(chosen)
        return chosen

    def last_resort(self, evictable: Callable[[int], bool]) -> int | None:
        """ValuePolicy.last_resort: the least recently used evictable slot, parent or not."""
        slot = first_slot(self._rnext, evictable)
        if slot is not None:
            self.remove(slot)
        return slot

    def _least_recent_leaf(self, evictable: Callable[[int], bool]) -> int | None:
        first, nxt = self._first, self._rnext
        node = nxt[0]
        while node:
            if first[node - 1] < 0 and evictable(node - 1):
                return node - 1
            node = nxt[node]
        return None

    def _by_value(self, evictable: Callable[[int], bool]) -> int | None:
        heap = self._heap
        if not heap:
            return None
        chosen: int | None = heap[0]
        if not evictable(heap[0]):
            # Skip blocks in use in heap order without moving them: visit the heap
            # best-first from its root (the order ValuePolicy's pops and pushes-back give).
            chosen = None
            prio, pos, seq = self._prio, self._pos, self._seq
            size = len(heap)
            frontier = [(0.0, 0, 0, 0)]  # the root, already looked at
            while frontier:
                i = heappop(frontier)[3]
                for c in (2 * i + 1, 2 * i + 2):
                    if c < size:
                        t = heap[c]
                        heappush(frontier, (prio[t], -pos[t], seq[t], c))
                if frontier and evictable(heap[frontier[0][3]]):
                    chosen = heap[frontier[0][3]]
                    break
        if chosen is not None:
            self._inflation = max(self._inflation, self._prio[chosen])
        return chosen

    def names_as_parent(self, slot: int) -> bool:
        return 0 <= slot < len(self._first) and self._first[slot] >= 0

    def __contains__(self, slot: object) -> bool:
        return (
            isinstance(slot, int) and 0 <= slot < len(self._where) and self._where[slot] != _ABSENT
        )

    def __len__(self) -> int:
        return self._len
