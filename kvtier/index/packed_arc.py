"""PackedChainArc: DRAM's order (ChainArcPolicy, kvtier/index/policy.py) over catalog
slots, per-block state in arrays; the layout is described with the other packed policies
in kvtier/index/packed_policy.py."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Protocol

from kvtier.index.policy import PROBATION, PROTECTED, TAIL, ChainArcPolicy
from kvtier.index.slot_policy import SlotPolicy
from kvtier.index.slots import (
    NO_SLOT,
    DigestTable,
    extend,
    first_slot,
    headroom,
    link_last,
    unlink,
)

__all__ = ["PackedChainArc", "UseCounts"]


class UseCounts(Protocol):
    """Uses by key digest (DigestSketch)."""

    def count(self, digest: int) -> int: ...


_LISTS = 3  # PROBATION, PROTECTED, TAIL: sentinels 0..2, slot s is node s + 3


class PackedChainArc(SlotPolicy):
    """ChainArcPolicy over slots: its three lists are circular lists over one pair of
    int32 link arrays, which list in a byte (0: not in the tier, else the list + 1),
    position, parent slot and cached-children count as int32s, the last touch as an
    int64; the safety net's recency as another circular list and its shadow LRU a
    DigestTable of key digests; the ghosts one DigestTable per list. Same decisions for
    the same calls (tests/index/test_policy_chain_arc.py, and the replays of
    tests/index/test_packed_policy.py)."""

    STEP = ChainArcPolicy.STEP

    def __init__(
        self,
        uses_of: Callable[[int], int],
        digest_of: Callable[[int], int],
        sketch: UseCounts | None = None,
    ) -> None:
        """`sketch`: where `uses_of(slot)` is `sketch.count(digest_of(slot))`, the
        sketch itself, so a touch reads the count by the digest it already has."""
        self._uses_of = uses_of
        self._digest_of = digest_of
        self._sketch = sketch
        self._prev = array("i", range(_LISTS))
        self._next = array("i", range(_LISTS))
        self._list = bytearray()
        self._pos = array("i")
        self._parent = array("i")
        self._kids = array("i")
        self._tick = array("q")
        self._lens = [0] * _LISTS
        self._len = 0
        self._clock = 0
        self._deep = NO_SLOT
        self._deep_position = -1
        self._ghosts = (DigestTable(), DigestTable(), DigestTable())  # by list evicted from
        self.target = 0.0
        # The safety net: every block least recent first (node 0 the sentinel, slot s at
        # s + 1) and a shadow LRU of key digests as large as the tier.
        self._rprev = array("i", [0])
        self._rnext = array("i", [0])
        self._shadow = DigestTable()
        self.weight = 1.0
        self._credit = 0.0
        self._returns = {PROBATION: [0, 0], TAIL: [0, 0]}

    def _grow(self, slot: int) -> None:
        size = len(self._list)
        count = headroom(size, slot + 1) - size
        self._list.extend(bytes(count))
        extend(self._pos, count, 0)
        extend(self._parent, count, -1)
        extend(self._kids, count, 0)
        extend(self._tick, count, 0)
        extend(self._prev, count, 0)
        extend(self._next, count, 0)
        extend(self._rprev, count, 0)
        extend(self._rnext, count, 0)

    def _place(self, slot: int, kind: int) -> None:
        node = slot + _LISTS
        old = self._list[slot]
        if old:
            unlink(self._prev, self._next, node)
            self._lens[old - 1] -= 1
        self._list[slot] = kind + 1
        self._lens[kind] += 1
        link_last(self._prev, self._next, kind, node)

    def _touch(self, slot: int, hit: bool, digest: int) -> None:
        node = slot + 1
        if hit:
            unlink(self._rprev, self._rnext, node)
        link_last(self._rprev, self._rnext, 0, node)
        shadow = self._shadow
        if (shadow.exchange(digest, 0) >= 0) != hit:  # ChainArcPolicy._touch
            step = self.STEP if hit else -self.STEP
            self.weight = min(max(self.weight + step, 0.0), 1.0)
        shadow.trim(max(self._len, 1))
        self._clock += 1
        self._tick[slot] = self._clock
        position = self._pos[slot]
        if self._parent[slot] < 0:
            deep = self._deep
            if deep >= 0 and deep != slot and self._list[deep]:
                self._place(deep, TAIL)
            self._deep, self._deep_position = slot, position
        elif position >= self._deep_position:
            self._deep, self._deep_position = slot, position
        sketch = self._sketch
        uses = self._uses_of(slot) if sketch is None else sketch.count(digest)
        self._place(slot, PROTECTED if uses > 1 else PROBATION)

    def insert(self, slot: int, size_bytes: int, position: int = 0, parent: int = NO_SLOT) -> None:
        if max(slot, parent) >= len(self._list):
            self._grow(max(slot, parent))
        if self._list[slot]:
            self.hit(slot)
            return
        self._len += 1
        self._pos[slot] = position
        self._parent[slot] = parent
        if parent >= 0:
            self._kids[parent] += 1
        digest = self._digest_of(slot)
        ghosts = self._ghosts
        kind = -1
        for k in range(_LISTS):
            if ghosts[k].pop(digest) >= 0:  # the first that has it (the others kept)
                kind = k
                break
        if kind in (PROBATION, PROTECTED):  # a ghost: ARC's adaptation
            young = len(ghosts[PROBATION]) + len(ghosts[TAIL])
            old = len(ghosts[PROTECTED])
            if kind == PROBATION:
                self.target = min(self.target + max(1.0, old / (young + 1)), float(self._len))
            else:
                self.target = max(self.target - max(1.0, young / (old + 1)), 0.0)
        if kind >= 0 and kind != PROTECTED:
            self._returns[kind][1] += 1
        self._touch(slot, False, digest)

    def hit(self, slot: int) -> None:
        if slot in self:
            self._touch(slot, True, self._digest_of(slot))

    def remove(self, slot: int) -> None:
        if slot not in self:
            return
        unlink(self._prev, self._next, slot + _LISTS)
        unlink(self._rprev, self._rnext, slot + 1)
        self._lens[self._list[slot] - 1] -= 1
        self._list[slot] = 0
        self._len -= 1
        if slot == self._deep:
            self._deep = NO_SLOT  # ChainArcPolicy.remove
        parent = self._parent[slot]
        if parent >= 0:
            self._kids[parent] -= 1

    def _first_leaf(self, kind: int, evictable: Callable[[int], bool]) -> int:
        kids, nxt = self._kids, self._next
        node = nxt[kind]
        while node != kind:
            slot = node - _LISTS
            if not kids[slot] and evictable(slot):
                return slot
            node = nxt[node]
        return NO_SLOT

    def tails_first(self) -> bool:
        """ChainArcPolicy.tails_first."""
        tails, probation = self._returns[TAIL], self._returns[PROBATION]
        return (tails[1] + 1) * (probation[0] + 2) <= (probation[1] + 1) * (tails[0] + 2)

    def victim(self, evictable: Callable[[int], bool]) -> int | None:
        self._credit += self.weight
        if self._credit < 1.0:
            kids, nxt = self._kids, self._rnext
            node = nxt[0]
            while node:
                slot = node - 1
                if not kids[slot] and evictable(slot):
                    return self._evicted(slot, self._list[slot] - 1)
                node = nxt[node]
        self._credit = max(self._credit - 1.0, 0.0)
        chosen = NO_SLOT
        kind = TAIL
        tails_first = self.tails_first()
        if tails_first:
            chosen = self._first_leaf(TAIL, evictable)
        if chosen < 0:
            young = self._first_leaf(PROBATION, evictable)
            kind = PROBATION
            if not tails_first:
                tail = self._first_leaf(TAIL, evictable)
                if tail >= 0 and (young < 0 or self._tick[tail] < self._tick[young]):
                    young, kind = tail, TAIL
            old = self._first_leaf(PROTECTED, evictable)
            probation = self._lens[PROBATION] + self._lens[TAIL]
            if old >= 0 and (young < 0 or probation <= self.target):
                young, kind = old, PROTECTED
            chosen = young
        if chosen < 0:
            return None
        return self._evicted(chosen, kind)

    def last_resort(self, evictable: Callable[[int], bool]) -> int | None:
        """ChainArcPolicy.last_resort: the least recently used evictable slot, leaf or not."""
        slot = first_slot(self._rnext, evictable)
        return None if slot is None else self._evicted(slot, self._list[slot] - 1)

    def _evicted(self, chosen: int, kind: int) -> int:
        if kind != PROTECTED:
            self._returns[kind][0] += 1
        self.remove(chosen)
        ghosts = self._ghosts[kind]
        ghosts.put(self._digest_of(chosen), to_end=True)
        ghosts.trim(max(self._len, 1))
        return chosen

    def names_as_parent(self, slot: int) -> bool:
        return 0 <= slot < len(self._kids) and self._kids[slot] > 0

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and 0 <= slot < len(self._list) and self._list[slot] > 0

    def __len__(self) -> int:
        return self._len


# ---- what is remembered of blocks by digest -------------------------------------------
