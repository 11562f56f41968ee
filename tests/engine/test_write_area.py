"""The write area's staging range (one-exchange puts): what a request may name."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.engine.write_area import WriteArea
from kvtier.tiers.dram import ALIGN_BYTES


@given(
    size_bytes=st.integers(1, 1 << 20),
    offset=st.integers(-(1 << 21), 1 << 21),
    length=st.integers(-10, 1 << 21),
)
def test_staged_view_is_exactly_the_bytes_inside_the_staging_range(
    size_bytes: int, offset: int, length: int
) -> None:
    area = WriteArea()
    try:
        area.reserve(5000)  # a reserved slot first: the staging range starts after it
        start, staged = area.stage(size_bytes)
        assert staged >= size_bytes and staged % ALIGN_BYTES == 0 and start % ALIGN_BYTES == 0
        inside = offset >= start and length >= 0 and offset + length <= start + staged
        view = area.staged_view(offset, length)
        assert (view is not None) == inside
        if view is not None:
            assert view.nbytes == length
            view.release()
    finally:
        area.close()


def test_a_repeated_stage_keeps_its_range_and_a_larger_one_replaces_it() -> None:
    area = WriteArea()
    try:
        first = area.stage(4096)
        assert area.stage(100) == first  # large enough already: nothing moves
        grown = area.stage(1 << 20)
        assert grown[1] == 1 << 20
        # The old range was freed: only the new one is staged, the old bytes are refused
        # unless the new range covers them.
        assert area.staged_view(grown[0], 1 << 20) is not None
        if not grown[0] <= first[0] < grown[0] + grown[1]:
            assert area.staged_view(first[0], 4096) is None
        slot = area.reserve(4096)  # a reservation never lands inside the staging range
        assert not grown[0] <= slot < grown[0] + grown[1]
    finally:
        area.close()


def test_nothing_is_staged_before_stage_or_after_close() -> None:
    area = WriteArea()
    assert area.staged_view(0, 1) is None
    area.stage(4096)
    area.close()
    assert area.staged_view(0, 1) is None
