"""The DRAM arena's prefault: every page mapped dirty before the first put.

MAP_POPULATE faulted a shared mapping in for reading: every page present, but clean, so
each page's first write made the CPU set its page-table entry's dirty bit, in user time
(no fault to count): a put's copy into an extent not yet written took twice as long.
/proc/self/smaps shows which: a page whose entry is dirty counts as Dirty."""

from __future__ import annotations

import re

import pytest

from kvtier.tiers import dram
from kvtier.tiers.dram import DramTier

ARENA_BYTES = 32 << 20
_RANGE = re.compile(r"^([0-9a-f]+)-[0-9a-f]+ ")


def mapped_kib(tier: DramTier) -> dict[str, int]:
    """The arena mapping's Rss and dirty KiB, as /proc/self/smaps counts them."""
    counts: dict[str, int] = {}
    ours = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            start = _RANGE.match(line)
            if start is not None:
                ours = int(start.group(1), 16) == tier.address
            elif ours and line.split(":")[0] in {"Rss", "Shared_Dirty", "Private_Dirty"}:
                name, value = line.split(":")
                counts[name] = int(value.split()[0])
    return {"rss": counts["Rss"], "dirty": counts["Shared_Dirty"] + counts["Private_Dirty"]}


@pytest.mark.parametrize("advice", [dram.MADV_POPULATE_WRITE, 0x7FFF_FFFF])
def test_a_prefaulted_arena_is_mapped_dirty_before_its_first_write(
    advice: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 0x7FFF_FFFF: advice no kernel knows, as on one older than 5.14: the zeros' path.
    monkeypatch.setattr(dram, "MADV_POPULATE_WRITE", advice)
    tier = DramTier(ARENA_BYTES, prefault=True)
    try:
        assert mapped_kib(tier) == {"rss": ARENA_BYTES >> 10, "dirty": ARENA_BYTES >> 10}
        assert not any(tier.whole[:: 1 << 20])  # still the fresh arena's zeros
    finally:
        tier.close()


def test_an_arena_not_prefaulted_maps_nothing_until_written() -> None:
    tier = DramTier(ARENA_BYTES, prefault=False)
    try:
        assert mapped_kib(tier) == {"rss": 0, "dirty": 0}
    finally:
        tier.close()
