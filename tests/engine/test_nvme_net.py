"""The NVMe order's safety net in the store (kvtier/index/policy.py, ValuePolicy's
`reach_net`): requests that reach NVMe move its weight, a block served from NVMe that the
sampled shadow LRU had forgotten towards the value order, a block asked for after it left
every tier while the shadow held it towards recency, once per departure."""

from __future__ import annotations

from pathlib import Path

from kvtier.engine.store import Store
from kvtier.index.packed_policy import PackedValue
from kvtier.index.reach_net import REACH_STEP, in_sample
from kvtier.types import TierName
from tests.engine.test_store import NS, get, make_config, put

BLOCK = 64 << 10


def _keys(store: Store, sampled: bool, count: int, prefix: str) -> list[bytes]:
    """`count` keys whose digests the net samples (or does not)."""
    digest = store.residency.catalog.digest
    keys: list[bytes] = []
    i = 0
    while len(keys) < count:
        key = f"{prefix}{i}".encode()
        if in_sample(digest((NS, key))) == sampled:
            keys.append(key)
        i += 1
    return keys


async def test_requests_that_reach_nvme_move_its_orders_weight(tmp_path: Path) -> None:
    # DRAM holds 16 blocks, NVMe ~40: puts demote as they arrive, NVMe evicts past 40.
    store = Store(make_config(tmp_path, 16 * BLOCK, 40 * (BLOCK + 8192)))
    await store.start()
    try:
        order = store.residency.nvme_order
        assert isinstance(order, PackedValue)
        catalog = store.residency.catalog
        value = bytes(range(256)) * (BLOCK // 256)
        # Unsampled blocks never enter the shadow: they fill NVMe (the shadow's bound is
        # an eighth of the tier's blocks as each key enters), then push `early` out of
        # both tiers while the shadow still holds them.
        fillers = _keys(store, False, 180, "filler")
        for key in fillers[:60]:
            await put(store, key, value)
        await store.flush()
        early = _keys(store, True, 4, "early")
        for key in early:
            await put(store, key, value)
        for key in fillers[60:]:
            await put(store, key, value)
        await store.flush()
        assert all(catalog.get((NS, key)) is None for key in early)
        assert order.weight == 1.0
        for key in early:
            assert await get(store, key) is None  # a miss: recency would have kept it
        assert order.weight == 1.0 - 4 * REACH_STEP
        for key in early:  # asked again before the block is back: counted once
            assert await get(store, key) is None
        assert order.weight == 1.0 - 4 * REACH_STEP

        # 24 sampled blocks, every one on NVMe; the shadow holds an eighth of the tier's
        # blocks, so the first ones are held by NVMe and forgotten by the shadow.
        held = _keys(store, True, 24, "held")
        for key in held:
            await put(store, key, value)
        await store.flush()
        entry = catalog.get((NS, held[0]))
        assert entry is not None and entry.dram_extent is None and entry.nvme_record_bytes
        assert catalog.count(TierName.NVME) < 8 * 20
        before = order.weight
        assert await get(store, held[0]) == value  # served from NVMe: a point for value
        assert order.weight == before + REACH_STEP
    finally:
        await store.close()
