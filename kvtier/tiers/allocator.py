"""Best-fit extent allocator for a fixed arena: mixed block sizes, coalescing on free.

Pure bookkeeping (no bytes): the DRAM tier owns the memory and asks this where to put a
block. Every extent is aligned to `alignment_bytes`, so a block can go to disk with
O_DIRECT straight from the arena. Freeing merges neighbours, so capacity never leaks to
fragmentation once blocks are freed: freeing everything restores one extent of the
whole arena.

`extent_allocator` gives the same allocator in C (kvtier/tiers/_alloc_native.c) where it
was built: the same extents for the same calls (tests/tiers/test_allocator_native.py), at
a few hundred nanoseconds a call where this one takes several µs (a streamed block
allocates once and is freed once, on the daemon's loop). The extension is optional at
build time, and KVTIER_NATIVE=0 asks for this one where it exists (A/B measurements).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sortedcontainers import SortedDict, SortedList

from kvtier.env import python_twins_asked_for
from kvtier.types import Extent

__all__ = [
    "NATIVE_ALLOCATOR",
    "Allocator",
    "Extent",
    "ExtentAllocator",
    "extent_allocator",
    "round_up",
]


class Allocator(Protocol):
    """What the tiers ask of an allocator (ExtentAllocator, or its native twin)."""

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def allocate(self, size_bytes: int) -> Extent | None: ...

    def free(self, extent: Extent) -> None: ...

    def largest_free_bytes(self) -> int: ...

    def free_extents(self) -> list[Extent]: ...


def round_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class ExtentAllocator:
    """Hands out aligned, non-overlapping extents of [0, capacity_bytes)."""

    def __init__(self, capacity_bytes: int, alignment_bytes: int = 4096) -> None:
        if capacity_bytes <= 0 or alignment_bytes <= 0 or capacity_bytes % alignment_bytes:
            raise ValueError("capacity must be a positive multiple of the alignment")
        self.capacity_bytes = capacity_bytes
        self.alignment_bytes = alignment_bytes
        self.used_bytes = 0
        self._free_by_offset: SortedDict = SortedDict({0: capacity_bytes})
        self._free_by_size: SortedList = SortedList([(capacity_bytes, 0)])

    def allocate(self, size_bytes: int) -> Extent | None:
        """The smallest free extent that holds `size_bytes` (rounded up), or None if none does."""
        need = round_up(max(size_bytes, 1), self.alignment_bytes)
        idx = self._free_by_size.bisect_left((need, -1))
        if idx == len(self._free_by_size):
            return None
        free_size, offset = self._free_by_size.pop(idx)
        del self._free_by_offset[offset]
        if free_size > need:
            self._add_free(offset + need, free_size - need)
        self.used_bytes += need
        return Extent(offset, need)

    def free(self, extent: Extent) -> None:
        """Return `extent` (as allocate gave it) and merge it with free neighbours."""
        offset, size = extent.offset, extent.size_bytes
        if offset in self._free_by_offset:
            raise ValueError(f"double free of extent at {offset}")
        self.used_bytes -= size
        nxt = offset + size
        if nxt in self._free_by_offset:
            size += self._remove_free(nxt)
        idx = self._free_by_offset.bisect_left(offset)
        if idx > 0:
            prev_offset, prev_size = self._free_by_offset.peekitem(idx - 1)
            if prev_offset + prev_size == offset:
                self._remove_free(prev_offset)
                offset, size = prev_offset, prev_size + size
        self._add_free(offset, size)

    def largest_free_bytes(self) -> int:
        return int(self._free_by_size[-1][0]) if self._free_by_size else 0

    def free_extents(self) -> list[Extent]:
        return [Extent(o, s) for o, s in self._free_by_offset.items()]

    def _add_free(self, offset: int, size: int) -> None:
        self._free_by_offset[offset] = size
        self._free_by_size.add((size, offset))

    def _remove_free(self, offset: int) -> int:
        size: int = self._free_by_offset.pop(offset)
        self._free_by_size.remove((size, offset))
        return size


def _native_type() -> Callable[[int, int], Allocator] | None:
    try:
        from kvtier.tiers._alloc_native import ExtentAllocator as Native
    except ImportError:
        return None
    return Native


NATIVE_ALLOCATOR = _native_type()


def extent_allocator(capacity_bytes: int, alignment_bytes: int = 4096) -> Allocator:
    """An allocator of [0, capacity_bytes): the native one where it was built (and
    KVTIER_NATIVE is not "0"), else ExtentAllocator."""
    if NATIVE_ALLOCATOR is None or python_twins_asked_for():
        return ExtentAllocator(capacity_bytes, alignment_bytes)
    return NATIVE_ALLOCATOR(capacity_bytes, alignment_bytes)
