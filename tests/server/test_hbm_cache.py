"""HbmCache bookkeeping: capacity, pins, generations, recency (property-tested)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.server.cuda_path import HbmCache

CAPACITY = 16 << 10
ops = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "lookup", "pin", "unpin"]),
        st.integers(0, 7),  # block
        st.integers(1, 3),  # generation
        st.sampled_from([1 << 10, 3 << 10, 6 << 10]),  # size
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_capacity_holds_pinned_copies_stay_and_stale_generations_miss(
    steps: list[tuple[str, int, int, int]],
) -> None:
    cache = HbmCache(memory=None, capacity_bytes=CAPACITY)
    for op, block, generation, size in steps:
        bid = ("ns", bytes([block]))
        pinned_before = {c.block_id: c for c in cache._copies.values() if c.pins}
        if op == "reserve":
            copy = cache.reserve(bid, generation, size)
            if copy is not None:
                assert copy.generation == generation and copy.size_bytes == size
        elif op == "lookup":
            found = cache.lookup(bid, generation, size)
            assert found is None or (found.generation, found.size_bytes) == (generation, size)
        elif op == "pin":
            copy = cache._copies.get(bid)
            if copy is not None:
                copy.pins += 1
        elif (copy := cache._copies.get(bid)) is not None and copy.pins:
            copy.pins -= 1
        assert cache.used_bytes <= CAPACITY
        assert cache.used_bytes == sum(
            -(-c.size_bytes // 256) * 256 for c in cache._copies.values()
        )
        for block_id, copy in pinned_before.items():
            assert cache._copies.get(block_id) is copy  # a copy in use is never dropped
