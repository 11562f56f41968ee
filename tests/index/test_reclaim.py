"""The segment reclaim rule and the space model the replay uses for write amplification."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.index.reclaim import (
    SegmentSpace,
    reclaim_victim,
    reserve_bytes_for,
    segment_bytes_for,
)

MiB = 1 << 20


def test_the_emptiest_segment_goes_only_when_it_is_worth_it() -> None:
    seg, limit = 4 * MiB, 64 * MiB
    cands = [(1, 3 * MiB, 4 * MiB), (2, 1 * MiB, 4 * MiB), (3, 4 * MiB - 1, 4 * MiB)]
    assert reclaim_victim(cands, 40 * MiB, seg, limit) is None  # room left: not yet
    assert reclaim_victim(cands, 57 * MiB, seg, limit) == 2  # pressed: the emptiest
    assert reclaim_victim([cands[0]], 60 * MiB, seg, limit) == 1  # pressed: <= 90 % live
    assert reclaim_victim([cands[2]], 60 * MiB, seg, limit) is None  # nearly all live
    assert reclaim_victim([cands[2]], 0, seg, limit, force=True) == 3
    assert reclaim_victim([], 60 * MiB, seg, limit) is None


def test_segment_sizes_and_reserve_follow_the_tier() -> None:
    assert segment_bytes_for(16 * MiB) == 4 * MiB
    assert segment_bytes_for(1 << 40) == 256 * MiB
    assert segment_bytes_for(1 << 30) == 64 * MiB
    assert reserve_bytes_for(1 << 40, 256 * MiB) == (1 << 40) // 8
    space = SegmentSpace.for_store(100 * MiB)
    assert space.store_bytes >= 100 * MiB  # the reserve withheld from the limit
    smaller = int(space.limit_bytes * 0.97)  # and not far more than needed
    assert SegmentSpace(smaller).store_bytes < 100 * MiB


def test_fifo_eviction_rewrites_nothing_and_random_eviction_does() -> None:
    record = 1 * MiB
    fifo = SegmentSpace.for_store(64 * MiB)
    live: list[int] = []
    for n in range(2000):
        if len(live) * record >= fifo.store_bytes:
            fifo.remove(live.pop(0))  # the oldest first: whole segments die in order
        fifo.append(n, record)
        live.append(n)
    # Nothing copied: by the time the room is needed the oldest segment is dead.
    assert fifo.write_amplification == 1.0 and fifo.relocated_bytes == 0
    assert fifo.allocated_bytes <= fifo.limit_bytes

    rng = random.Random(3)
    rand = SegmentSpace.for_store(64 * MiB)
    alive: list[int] = []
    for n in range(2000):
        if len(alive) * record >= rand.store_bytes:
            rand.remove(alive.pop(rng.randrange(len(alive))))
        rand.append(n, record)
        alive.append(n)
    assert 1.5 < rand.write_amplification < 8.0  # greedy cleaning of a full store
    assert rand.allocated_bytes <= rand.limit_bytes


@given(
    st.lists(
        st.tuples(st.sampled_from(["put", "del"]), st.integers(0, 60), st.integers(1, 900)),
        max_size=400,
    ),
    st.integers(8, 40),
)
def test_random_sequences_keep_every_live_record_once(
    ops: list[tuple[str, int, int]], store_kib: int
) -> None:
    space = SegmentSpace.for_store(store_kib * MiB // 8)
    live: dict[int, int] = {}
    for op, key, kib in ops:
        size = kib * 1024
        if op == "put" and sum(v for k, v in live.items() if k != key) + size <= (
            space.store_bytes
        ):
            space.append(key, size)
            live[key] = size
        else:
            space.remove(key)
            live.pop(key, None)
        held = {rid: b for seg in space._segments.values() for rid, b in seg.records.items()}
        assert held == live
        assert space.allocated_bytes <= space.limit_bytes
    assert space.write_amplification >= 1.0
    moved = space.written_bytes * (space.write_amplification - 1)
    assert moved == pytest.approx(space.relocated_bytes)
