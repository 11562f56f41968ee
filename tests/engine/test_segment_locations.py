"""A store on the segment layout keeps its records' locations in the catalog (issue 22): the
tier holds nothing per record, every write is settled, reclaim run from the tier's own kind
of thread asks the catalog (on the loop) and moves the live records, the catalog follows
them, and every block reads back bit-exact — also after a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.engine.store import Store
from kvtier.tiers.segment_file import unpack_location
from kvtier.tiers.segments import SegmentTier
from tests.conftest import block_bytes
from tests.engine.test_store import NS, get, make_config, put

pytestmark = pytest.mark.timeout(120)
SIZE = 20_000


def config(tmp_path: Path) -> Config:
    # 4 MiB segments (the smallest), a tier of 64 MiB: ~650 blocks fill a few segments.
    return make_config(tmp_path, 2 << 20, 64 << 20, layout="segments")


async def test_the_catalog_follows_reclaim_and_every_block_reads_back(tmp_path: Path) -> None:
    store = Store(config(tmp_path))
    await store.start()
    try:
        keys = [b"k%d" % i for i in range(600)]
        for i, key in enumerate(keys):
            await put(store, key, block_bytes(i, SIZE))
        await store.flush()
        assert store.nvme is not None
        tier = store.nvme.tier
        assert isinstance(tier, SegmentTier)
        assert await store.nvme_recovered()
        assert all(ns != NS for ns, _, _ in tier._placed)  # the blocks' locations: catalog
        assert all(not s.pending for s in tier._segments.values())  # every write settled
        before: dict[bytes, int] = {}
        for key in keys:
            entry = store.residency.get((NS, key))
            assert entry is not None and entry.nvme_record_bytes and entry.nvme_location
            before[key] = entry.nvme_location
        for key in keys[::3]:  # dead records in every segment
            await store.delete((NS, key))
        for _ in range(500):  # the removals run in the background: wait for them all
            if not store.nvme._removing:
                break
            await asyncio.sleep(0.01)
        assert not store.nvme._removing
        moved = await asyncio.to_thread(tier.reclaim, True)  # as the reclaimer thread does
        assert moved > 0 and tier.relocated_bytes > 0
        kept = [k for i, k in enumerate(keys) if i % 3]
        changed = 0
        for key in kept:
            entry = store.residency.get((NS, key))
            assert entry is not None
            seg_id, _ = unpack_location(entry.nvme_location)
            assert seg_id in tier._segments  # never a deleted segment
            changed += entry.nvme_location != before[key]
        assert changed > 0
        for i, key in enumerate(keys):
            want = None if i % 3 == 0 else block_bytes(i, SIZE)
            assert await get(store, key) == want
    finally:
        await store.close()
    again = Store(config(tmp_path))
    await again.start()
    try:
        for i, key in enumerate(keys):
            want = None if i % 3 == 0 else block_bytes(i, SIZE)
            assert await get(again, key) == want
    finally:
        await again.close()
