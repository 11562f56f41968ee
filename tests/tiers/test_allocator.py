"""The extent allocator's properties, for the Python one and its native twin (where built;
tests/tiers/test_allocator_native.py checks that the two agree call for call)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.tiers.allocator import NATIVE_ALLOCATOR, Allocator, Extent, ExtentAllocator, round_up

CAPACITY = 64 * 4096
MakeAllocator = Callable[[int, int], Allocator]


def _implementations() -> list[object]:
    impls: list[object] = [pytest.param(ExtentAllocator, id="python")]
    if NATIVE_ALLOCATOR is not None or os.environ.get("KVTIER_REQUIRE_NATIVE") == "1":
        impls.append(pytest.param(NATIVE_ALLOCATOR, id="native"))
    return impls


IMPLEMENTATIONS = _implementations()


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences never overlap, never exceed capacity, never leak."""

    make: MakeAllocator = ExtentAllocator

    def __init__(self) -> None:
        super().__init__()
        self.alloc = type(self).make(CAPACITY, 4096)
        self.live: list[Extent] = []

    @rule(size=st.integers(min_value=0, max_value=CAPACITY + 4096))
    def allocate(self, size: int) -> None:
        before = self.alloc.largest_free_bytes()
        extent = self.alloc.allocate(size)
        need = round_up(max(size, 1), 4096)
        if extent is None:
            assert need > before, "refused although a large enough free extent existed"
            return
        assert extent.size_bytes == need and extent.offset % 4096 == 0
        assert extent.offset + extent.size_bytes <= CAPACITY
        self.live.append(extent)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(min_value=0))
    def free(self, index: int) -> None:
        self.alloc.free(self.live.pop(index % len(self.live)))

    @invariant()
    def accounting(self) -> None:
        spans = sorted((e.offset, e.offset + e.size_bytes) for e in self.live)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "two live extents overlap"
        used = sum(e.size_bytes for e in self.live)
        assert self.alloc.used_bytes == used <= CAPACITY
        free = self.alloc.free_extents()
        assert sum(f.size_bytes for f in free) == CAPACITY - used
        # Free extents are coalesced: no two are adjacent.
        ordered = sorted(free, key=lambda f: f.offset)
        for a, b in itertools.pairwise(ordered):
            assert a.offset + a.size_bytes < b.offset

    def teardown(self) -> None:
        for extent in self.live:
            self.alloc.free(extent)
        assert self.alloc.free_extents() == [Extent(0, CAPACITY)]


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def _native_missing(capacity_bytes: int, alignment_bytes: int) -> Allocator:
    raise AssertionError("the native allocator was not built (KVTIER_REQUIRE_NATIVE=1)")


class NativeAllocatorMachine(AllocatorMachine):
    """The same properties of the native allocator."""

    make: MakeAllocator = NATIVE_ALLOCATOR or _native_missing


TestNativeAllocatorMachine = pytest.mark.skipif(
    NATIVE_ALLOCATOR is None and os.environ.get("KVTIER_REQUIRE_NATIVE") != "1",
    reason="kvtier/tiers/_alloc_native.c was not built (no C compiler at install)",
)(NativeAllocatorMachine.TestCase)
TestNativeAllocatorMachine.settings = TestAllocatorMachine.settings


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
@given(sizes=st.lists(st.integers(min_value=1, max_value=5 * 4096), min_size=1, max_size=40))
def test_best_fit_reuses_the_smallest_hole(make: MakeAllocator, sizes: list[int]) -> None:
    alloc = make(1 << 22, 4096)
    extents = [alloc.allocate(s) for s in sizes]
    assert all(e is not None for e in extents)
    for extent in extents[::2]:
        assert extent is not None
        alloc.free(extent)
    smallest_hole = min(f.size_bytes for f in alloc.free_extents())
    got = alloc.allocate(smallest_hole)
    assert got is not None and got.size_bytes == smallest_hole


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
def test_double_free_and_bad_construction_are_refused(make: MakeAllocator) -> None:
    alloc = make(8192, 4096)
    extent = alloc.allocate(1)
    assert extent is not None
    alloc.free(extent)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(extent)
    with pytest.raises(ValueError):
        make(5000, 4096)
