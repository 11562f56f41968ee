"""The native extent allocator (kvtier/tiers/_alloc_native.c) against the Python one it
stands for (kvtier/tiers/allocator.py): the same extent (or None, or the same error) for
every call, and the same free extents, used bytes and largest free extent after it, over
random call sequences: Hypothesis's, and long seeded ones that leave thousands of free
extents (chunks of the size-ordered list split and emptied, the hash tables grown, and
their entries deleted out of probe runs)."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.allocator import NATIVE_ALLOCATOR, Allocator, ExtentAllocator, extent_allocator
from kvtier.types import Extent

pytestmark = pytest.mark.skipif(
    NATIVE_ALLOCATOR is None and os.environ.get("KVTIER_REQUIRE_NATIVE") != "1",
    reason="kvtier/tiers/_alloc_native.c was not built (no C compiler at install)",
)


class Twins:
    """Both allocators, fed the same calls; `live` is what they have handed out."""

    def __init__(self, capacity_bytes: int, alignment_bytes: int) -> None:
        assert NATIVE_ALLOCATOR is not None, "the native allocator was not built"
        self.python: Allocator = ExtentAllocator(capacity_bytes, alignment_bytes)
        self.native: Allocator = NATIVE_ALLOCATOR(capacity_bytes, alignment_bytes)
        self.live: list[Extent] = []

    def allocate(self, size_bytes: int) -> None:
        want, got = self.python.allocate(size_bytes), self.native.allocate(size_bytes)
        assert got == want, f"allocate({size_bytes}): {got} where Python gives {want}"
        if want is not None:
            self.live.append(want)

    def free(self, index: int) -> None:
        extent = self.live.pop(index % len(self.live))
        self.python.free(extent)
        self.native.free(extent)

    def free_twice(self, extent: Extent) -> None:
        """A double free: both refuse it alike, and neither changes."""
        errors = []
        for alloc in (self.python, self.native):
            with pytest.raises(ValueError, match="double free") as caught:
                alloc.free(extent)
            errors.append(str(caught.value))
        assert errors[0] == errors[1]

    def check(self) -> None:
        python, native = self.python, self.native
        assert native.used_bytes == python.used_bytes
        assert native.largest_free_bytes() == python.largest_free_bytes()
        assert native.free_extents() == python.free_extents()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(min_value=-4096, max_value=40 * 4096)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=1 << 16)),
        st.tuples(st.just("again"), st.integers(min_value=0, max_value=1 << 16)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(
    calls=ops, pages=st.integers(min_value=1, max_value=64), alignment=st.sampled_from([512, 4096])
)
def test_the_same_extents_as_python(
    calls: list[tuple[str, int]], pages: int, alignment: int
) -> None:
    twins = Twins(pages * alignment, alignment)
    freed: list[Extent] = []
    for name, arg in calls:
        if name == "allocate":
            twins.allocate(arg)
        elif name == "free" and twins.live:
            freed.append(twins.live[arg % len(twins.live)])
            twins.free(arg)
        elif name == "again" and freed:
            extent = freed[arg % len(freed)]
            if extent not in twins.live and any(
                f.offset == extent.offset for f in twins.python.free_extents()
            ):
                twins.free_twice(extent)
        twins.check()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_long_sequences_with_thousands_of_free_extents(seed: int) -> None:
    """Fill an arena with blocks of mixed sizes, free every other one (thousands of free
    extents, of many sizes), then churn: best fit over many sizes and ties, merges on
    both sides, the tables' growth and deletes."""
    rng = random.Random(seed)
    page = 4096
    twins = Twins(20_000 * page, page)
    while True:
        size = rng.choice([1, page, 3 * page, 16 * page, 5 * page + 1])
        before = len(twins.live)
        twins.allocate(size)
        if len(twins.live) == before:
            break
    for i in range(len(twins.live) - 1, -1, -2):
        twins.free(i)
    twins.check()
    assert len(twins.python.free_extents()) > 1000
    for step in range(30_000):
        if twins.live and rng.random() < 0.5:
            twins.free(rng.randrange(len(twins.live)))
        else:
            twins.allocate(rng.choice([1, page, 2 * page, 7 * page, 64 * page, 300 * page]))
        if step % 997 == 0:
            twins.check()
    while twins.live:
        twins.free(rng.randrange(len(twins.live)))
    twins.check()
    assert twins.native.free_extents() == [Extent(0, 20_000 * page)]


def test_misuse_is_refused_and_changes_nothing() -> None:
    """What only the native one checks (the Python one trusts its caller): an extent that
    is not the arena's. Bad sizes to allocate are treated as the Python one treats them."""
    assert NATIVE_ALLOCATOR is not None
    alloc = NATIVE_ALLOCATOR(16 * 4096, 4096)
    extent = alloc.allocate(4096)
    assert extent == Extent(0, 4096)
    for bad in (Extent(0, 0), Extent(-4096, 4096), Extent(15 * 4096, 2 * 4096), Extent(4096, 8192)):
        with pytest.raises(ValueError):
            alloc.free(bad)
    assert alloc.used_bytes == 4096
    assert alloc.free_extents() == [Extent(4096, 15 * 4096)]
    assert alloc.allocate(0) == Extent(4096, 4096)  # at least one byte, as in Python
    assert alloc.allocate(-1) == Extent(8192, 4096)
    assert alloc.allocate(1 << 80) is None
    assert alloc.allocate(17 * 4096) is None
    with pytest.raises(TypeError):
        alloc.allocate("4096")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        NATIVE_ALLOCATOR(0, 4096)


def test_kvtier_native_0_picks_the_python_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert NATIVE_ALLOCATOR is not None
    assert isinstance(extent_allocator(1 << 20), NATIVE_ALLOCATOR)  # type: ignore[arg-type]
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    assert type(extent_allocator(1 << 20)) is ExtentAllocator
