"""Per-block state in flat typed arrays, for an index of millions of blocks.

A Python object per block costs ~50–100 bytes each and makes every garbage collection
walk all of them (0.8 s at 1 M blocks). Here a block is an integer **slot** (0, 1, 2 …,
given by the catalog and reused after the block is freed) and each of its fields is one
element of an `array.array`: a few bytes, no object, invisible to the collector. Reading
an element gives a plain Python int or float, so the code over them stays ordinary
Python (numpy would not help: its scalar access is slower than `array`'s).

* `headroom`, `extend` — grow arrays for a new slot, amortised.
* `mapping`, `remap` — columns in anonymous mappings, for the catalog's millions of slots:
  grown by mremap, so growing never copies or leaves the old block behind in the heap
  (with arrays grown by realloc, the freed old copies were ~20 % of the daemon's RSS).
* `DigestTable` — an ordered map of 64-bit key digests to a small value (0–255), in
  arrays: what a bounded `OrderedDict[key, small]` (FIFO or LRU) did, for blocks that
  have no slot any more (ghosts, reuse memory). Nodes hold the digest, the value and a
  doubly-linked order; an open-addressed index maps a digest to its node.

Digests must be uniform 64-bit hashes (`key_digest`): the table indexes by their bits
as they are. Two keys with one digest are one entry (at
10 M keys, a chance of about 3 in a million that any two collide).
"""

from __future__ import annotations

import mmap
from array import array
from collections.abc import Callable, Hashable
from typing import Any, TypeAlias

import numpy as np
import numpy.ma  # (see below)
import xxhash

# numpy 2's `np.unique` imports numpy.ma on its first call: 10-45 ms holding the GIL, in
# the event loop's first demotion batch (PackedValue.insert_many) or under recovery's
# thread (catalog_bulk), a stall over issue 22's 20 ms once per daemon. Every packed
# structure imports this module, so it is loaded here, at start, before anything serves.

NO_SLOT = -1
_EMPTY = 0  # index entry: never used (node 0 is the order's sentinel, never a key)
_DELETED = -1  # index entry: a key was here (probing must go on past it)
_MIN_INDEX = 8


def key_digest(key: Hashable) -> int:
    """The 64-bit digest packed structures key a block by (computed once per block, when
    the catalog adds it): the four 16-bit counter indices FrequencySketch takes from an
    xxh3-128 of `repr(key)`, side by side. So `DigestSketch` counts exactly what
    `FrequencySketch` counted (the same keys collide), and the digest is as uniform as
    the hash is."""
    h = xxhash.xxh3_128_intdigest(repr(key).encode())
    return (
        (h & 0xFFFF)
        | (h >> 16 & 0xFFFF_0000)
        | (h >> 32 & 0xFFFF_0000_0000)
        | (h >> 48 & 0xFFFF_0000_0000_0000)
    )


def all_distinct(values: np.ndarray) -> bool:
    """Whether no element of `values` (a demotion batch's slots: ~128) repeats, by a set
    of them. numpy 2's `np.unique` hashes, and took ~225 µs a call on the daemon's loop
    (~19 alone); `np.sort` lets go of the GIL, which on the loop can hand it to an I/O
    thread and wait for it back."""
    return len(set(values.tolist())) == len(values)


def headroom(size: int, needed: int) -> int:
    """The new length of arrays of `size` elements that must hold `needed`: at least an
    eighth more, so growing one slot at a time stays amortised O(1)."""
    return max(needed, size + (size >> 3), 16)


Ints: TypeAlias = "array[int] | memoryview[int]"  # per-slot ints: an `array` or a `column`


def link_last(prev: Ints, nxt: Ints, sentinel: int, node: int) -> None:
    """Put `node` last in the circular list that `sentinel` heads (prev/next arrays)."""
    last = prev[sentinel]
    prev[node], nxt[node] = last, sentinel
    nxt[last] = node
    prev[sentinel] = node


def first_slot(nxt: Ints, accept: Callable[[int], bool]) -> int | None:
    """The first slot `accept` takes, from the front of the list sentinel 0 heads (node
    `slot + 1`: the least recent end of a recency list), or None."""
    node = nxt[0]
    while node:
        if accept(node - 1):
            return node - 1
        node = nxt[node]
    return None


def unlink(prev: Ints, nxt: Ints, node: int) -> None:
    """Take `node` out of its circular list (its own prev/next are left as they were)."""
    before, after = prev[node], nxt[node]
    nxt[before] = after
    prev[after] = before


def extend(values: array[Any], count: int, fill: float) -> None:
    """Append `count` elements `fill` (at C speed)."""
    values.extend(array(values.typecode, [fill]) * count)


def mapping(size_bytes: int) -> mmap.mmap:
    """Anonymous memory for a column of per-slot values (zero-filled). A page is resident
    only once written, so a column can be mapped far larger than it is used."""
    # Private: a shared anonymous mapping is shmem, which mremap cannot grow (a touch past
    # its first size is SIGBUS) and which would hide from RssAnon.
    return mmap.mmap(
        -1, max(size_bytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )


def remap(old: mmap.mmap, size_bytes: int) -> mmap.mmap:
    """`old` grown to `size_bytes`: in place by mremap on Linux (no copy, no freed block
    left in the heap, whatever the size), else a new mapping with the old bytes. Every
    memoryview of `old` must be released first."""
    try:
        old.resize(size_bytes)
        return old
    except (OSError, SystemError, BufferError, TypeError):
        new = mapping(size_bytes)
        new[: len(old)] = old[:]
        return new


def column(code: str, length: int = 0, fill: float = 0) -> memoryview[Any]:
    """A per-slot array of `length` elements `fill` (typecode `code`, as `array`'s) in an
    anonymous mapping: indexed as fast as an `array`, and grown by `grow_column`."""
    room = mapping(length * _itemsize(code))
    view: memoryview[Any] = memoryview(room).cast(code)  # type: ignore[call-overload]
    return grow_column(view[:0], length, fill) if length else view[:0]


def grow_column(view: memoryview[Any], length: int, fill: float) -> memoryview[Any]:
    """`view` (a `column`) grown to `length` elements, the new ones `fill`. The mapping is
    grown by mremap (`remap`): an array grown by realloc moved to the heap's top and left
    its old copy behind as a hole, which stayed resident under the daemon's 1 GiB trim
    threshold (the packed NVMe order's dozen arrays at a million slots), and new pages
    of zeros are not resident until written. `view` is released: no other view or
    numpy array of it may be alive."""
    old, code = len(view), view.format
    if length <= old:
        return view
    room: mmap.mmap = view.obj  # type: ignore[assignment]
    view.release()
    needed = length * _itemsize(code)
    if needed > len(room):  # at least an eighth more: amortised, as `headroom`
        page = mmap.PAGESIZE  # whole pages: a whole number of elements of any size
        room = remap(room, -(-max(needed, len(room) + (len(room) >> 3)) // page) * page)
    grown: memoryview[Any] = memoryview(room).cast(code)[:length]  # type: ignore[call-overload]
    if fill:
        values = np.asarray(grown)
        values[old:] = fill
        del values
    return grown


def _itemsize(code: str) -> int:
    return array(code).itemsize


class DigestTable:
    """Ordered digest -> value (0..255) map: `put` appends (or, with `to_end`, moves to
    the end), `pop_oldest` takes from the front. The caller bounds it; nothing here
    evicts on its own."""

    def __init__(self, bound: int = 0) -> None:
        """`bound`: the most keys the caller will hold (0: unknown). An index for that many
        is made at once (4 B a slot, at most 0.7 full), so the table never rehashes: a
        rehash walks every key while the caller (the event loop) waits."""
        # Node 0 is the sentinel of the circular order list: _next[0] is the oldest. The
        # nodes and the index are mapped columns (`column`): the reuse memory's are a
        # million keys, whose realloc-grown arrays left their old copies in the heap (and
        # an index made for its bound at once costs nothing until its pages are written).
        self._digest: memoryview[int] = column("Q", 1)
        self._value: memoryview[int] = column("B", 1)
        self._prev: memoryview[int] = column("i", 1)
        self._next: memoryview[int] = column("i", 1)
        self._nodes = 1  # nodes made (the columns' used length)
        self._free = 0  # first free node (chained through _next), 0: none
        size = _MIN_INDEX
        while (bound + 1) * 10 > 7 * size:  # as `put` grows it: at most 0.7 full
            size <<= 1
        self._index: memoryview[int] = column("i", size, _EMPTY)
        self._mask = size - 1
        self._len = 0
        # _DELETED marks in the index: none since removal shifts the run back instead,
        # so only growth rehashes (the marks' bookkeeping is kept for clarity of `put`).
        self._deleted = 0

    def __len__(self) -> int:
        return self._len

    def _find(self, digest: int) -> int:
        """Index position holding `digest`, or -1."""
        index, mask, digests = self._index, self._mask, self._digest
        i = digest & mask
        while True:
            node = index[i]
            if node == _EMPTY:
                return -1
            if node > 0 and digests[node] == digest:
                return i
            i = (i + 1) & mask

    def get(self, digest: int) -> int:
        """The value of `digest`, or -1 if absent."""
        i = self._find(digest)
        return -1 if i < 0 else self._value[self._index[i]]

    def __contains__(self, digest: int) -> bool:
        return self._find(digest) >= 0

    def put(self, digest: int, value: int = 0, to_end: bool = False) -> None:
        """Set `digest`'s value; a new digest goes to the end, an old one stays where it
        is unless `to_end` (FIFO vs LRU order)."""
        i = self._find(digest)
        if i >= 0:
            node = self._index[i]
            self._value[node] = value
            if to_end:
                unlink(self._prev, self._next, node)
                link_last(self._prev, self._next, 0, node)
            return
        self._add(digest, value)

    def _add(self, digest: int, value: int) -> None:
        """`put` of a digest not in the table."""
        if (self._len + self._deleted + 1) * 10 > 7 * len(self._index):
            self._rehash()
        node = self._new_node()
        self._digest[node] = digest
        self._value[node] = value
        link_last(self._prev, self._next, 0, node)
        index, mask = self._index, self._mask
        i = digest & mask
        while index[i] > 0:
            i = (i + 1) & mask
        if index[i] == _DELETED:
            self._deleted -= 1
        index[i] = node
        self._len += 1

    def exchange(self, digest: int, value: int) -> int:
        """`put(digest, value, to_end=True)` returning the value it had (-1: absent): one
        probe where `get` then `put` took two."""
        i = self._find(digest)
        if i < 0:
            self._add(digest, value)
            return -1
        node = self._index[i]
        old = self._value[node]
        self._value[node] = value
        unlink(self._prev, self._next, node)
        link_last(self._prev, self._next, 0, node)
        return old

    def pop(self, digest: int) -> int:
        """Forget `digest`; returns its value, or -1 if it was absent."""
        i = self._find(digest)
        if i < 0:
            return -1
        return self._drop(i)

    def oldest(self) -> int:
        """The digest at the front (the table must not be empty)."""
        return int(self._digest[self._next[0]])

    def pop_oldest(self) -> int:
        """Forget the digest at the front and return it (the table must not be empty)."""
        digest = self.oldest()
        self._drop(self._find(digest))
        return digest

    def trim(self, most: int) -> None:
        """`pop_oldest` until at most `most` digests are left."""
        while self._len > most:
            self._drop(self._find(self._digest[self._next[0]]))

    def _drop(self, i: int) -> int:
        index, mask, digests = self._index, self._mask, self._digest
        node = index[i]
        # Backward-shift deletion (Knuth 6.4, Algorithm R): the keys after the hole in
        # its run move back into it unless their home lies between the hole and them, so
        # every run stays unbroken without a deleted mark, and marks never fill the index
        # until a rehash (which at the reuse memory's million keys was a long stall).
        hole, j = i, i
        while True:
            j = (j + 1) & mask
            moved = index[j]
            if moved == _EMPTY:
                break
            home = digests[moved] & mask
            # `moved` may fill the hole unless its home is cyclically in (hole, j].
            if (home <= hole < j) or (hole < j < home) or (j < home <= hole):
                index[hole] = moved
                hole = j
        index[hole] = _EMPTY
        self._len -= 1
        unlink(self._prev, self._next, node)
        self._next[node] = self._free
        self._free = node
        return self._value[node]

    def _new_node(self) -> int:
        node = self._free
        if node:
            self._free = self._next[node]
            return node
        node = self._nodes
        if node == len(self._next):
            size = headroom(node, node + 1)
            self._digest = grow_column(self._digest, size, 0)
            self._value = grow_column(self._value, size, 0)
            self._prev = grow_column(self._prev, size, 0)
            self._next = grow_column(self._next, size, 0)
        self._nodes = node + 1
        return node

    def _rehash(self) -> None:
        """A fresh index of the live nodes, built with numpy: a Python loop here cost
        ~0.5 µs a key on the event loop (the reuse memory's million keys: a half-second
        stall). Where a key lands differs from inserting one by one, but any placement
        that keeps linear probing's rule (every slot from a key's home to its own is
        taken) answers every `_find` the same; nothing reads the index's order."""
        size = _MIN_INDEX
        while size < 2 * (self._len + 1):  # load up to 0.7 before the next: short probes
            size <<= 1
        mask = size - 1
        old = np.frombuffer(self._index, dtype=np.int32)
        nodes = old[old > 0].astype(np.int64)  # every live node is in the old index once
        home = np.frombuffer(self._digest, dtype=np.uint64)[nodes] & np.uint64(mask)
        order = np.argsort(home, kind="stable")
        nodes, home = nodes[order], home[order].astype(np.int64)
        # Sorted by home, key k goes to max(home_k, place_{k-1} + 1): a running maximum.
        ranks = np.arange(nodes.size, dtype=np.int64)
        place = np.maximum.accumulate(home - ranks) + ranks if nodes.size else home
        index = np.zeros(size, dtype=np.int32)
        inside = place < size
        index[place[inside]] = nodes[inside]
        wrapped = nodes[~inside]  # their probes ran off the end: on from slot 0
        if wrapped.size:
            # The first empty slots from 0: everything before each of them is taken.
            index[np.flatnonzero(index == _EMPTY)[: wrapped.size]] = wrapped
        fresh: memoryview[int] = column("i", size, _EMPTY)
        np.asarray(fresh)[:] = index
        self._index = fresh
        self._mask, self._deleted = mask, 0
