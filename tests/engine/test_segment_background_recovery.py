"""The store serving while a segment tier's index fills: a segment tier hands its records
out in fans of its own (the top byte of a key's digest, `SegmentRecovery.fan`), and the
recovery engine must judge a block pending by the same fans, or a delete of a block not
indexed yet is forgotten and its old record comes back (and a put's old record with it
after a crash). The hand-out is held at a fan boundary here, by the engine's adds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.engine.recovery import NvmeRecovery
from kvtier.engine.store import Store
from kvtier.tiers.segment_recovery import FanColumns
from kvtier.tiers.startup import FanScan
from tests.conftest import block_bytes
from tests.engine.test_background_recovery import until
from tests.engine.test_store import NS, get, make_config, put

SIZE = 5000
pytestmark = pytest.mark.timeout(90)


def config(root: Path) -> Config:
    return make_config(root, 8 << 20, 64 << 20, layout="segments")


def data_of(i: int) -> bytes:
    return block_bytes(i, SIZE)


async def test_a_put_and_a_delete_of_blocks_not_yet_indexed_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [b"old%d" % i for i in range(400)]
    store = Store(config(tmp_path))
    await store.start()
    for i, key in enumerate(keys):
        await put(store, key, data_of(i))
    assert await store.flush() == len(keys)
    await store.close()

    first_half, the_rest = asyncio.Event(), asyncio.Event()  # fans below "80", the others
    real = NvmeRecovery._add_fan

    async def held(self: NvmeRecovery, fan_scan: FanScan | FanColumns) -> None:
        await (first_half if fan_scan.fan < "80" else the_rest).wait()
        await real(self, fan_scan)

    monkeypatch.setattr(NvmeRecovery, "_add_fan", held)
    store = Store(config(tmp_path))
    await store.start(recover_in_background=True)
    assert store.nvme is not None and store.recovery is not None
    fan = store.nvme.tier.fan
    first_half.set()
    early = [i for i, k in enumerate(keys) if fan(NS, k) < "80"]
    late = [i for i, k in enumerate(keys) if fan(NS, k) >= "80"]
    assert len(early) > 20 and len(late) > 20
    recovery = store.recovery
    # A fan stops being pending a loop turn after its last rows are counted: both waited.
    await until(
        lambda: (
            store.stats().tiers[1].recovered_records == len(early)
            and not any(recovery.pending((NS, keys[i])) for i in early)
        )
    )
    assert all(recovery.pending((NS, keys[i])) for i in late)

    deleted = set(late[:10] + early[:5])
    replaced = set(late[10:20] + early[5:10])
    for i in deleted:
        await store.delete((NS, keys[i]))
    for i in replaced:
        await put(store, keys[i], data_of(10_000 + i), overwrite=True)
    the_rest.set()
    assert await store.nvme_recovered()

    def wanted(i: int) -> bytes | None:
        if i in deleted:
            return None
        return data_of(10_000 + i) if i in replaced else data_of(i)

    for i, key in enumerate(keys):
        assert await get(store, key) == wanted(i), i
    await store.flush()
    await store.close()
    monkeypatch.undo()
    again = Store(config(tmp_path))
    await again.start()
    for i, key in enumerate(keys):
        assert await get(again, key) == wanted(i), i
    await again.close()
