"""HbmCache bookkeeping: capacity, pins, generations (property-tested), and eviction in
the daemon policy's order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.cuda_path import HbmCache
from kvtier.index.policy import BlockInfo, LruPolicy, S3FifoPolicy, TierPolicy

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
    cache = HbmCache(memory=None, capacity_bytes=CAPACITY, order=LruPolicy())
    for op, block, generation, size in steps:
        bid = ("ns", bytes([block]))
        pinned_before = {c.block_id: c for c in cache._copies.values() if c.pins}
        if op == "reserve":
            copy = cache.reserve(bid, generation, BlockInfo(size))
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


def _survivors_of_a_scan(order: TierPolicy) -> set[int]:
    """Block 0 read three times, then eight blocks read once each, in a cache of four."""
    block_bytes = CAPACITY // 4
    cache = HbmCache(memory=None, capacity_bytes=CAPACITY, order=order)
    assert cache.reserve(("ns", b"\0"), 1, BlockInfo(block_bytes)) is not None
    for _ in range(2):
        assert cache.lookup(("ns", b"\0"), 1, block_bytes) is not None
    for block in range(1, 9):
        assert cache.reserve(("ns", bytes([block])), 1, BlockInfo(block_bytes)) is not None
    assert len(cache) == 4 and cache.evictions == 5
    return {b for b in range(9) if cache.lookup(("ns", bytes([b])), 1, block_bytes)}


def test_which_copy_leaves_is_the_policys_choice() -> None:
    # LRU lets a one-time scan push out the block read three times; S3-FIFO keeps it.
    assert _survivors_of_a_scan(LruPolicy()) == {5, 6, 7, 8}
    assert 0 in _survivors_of_a_scan(S3FifoPolicy(CAPACITY))
