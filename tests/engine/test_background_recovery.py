"""The store serving while its NVMe index fills (kvtier/engine/recovery.py), in-process, with
the scan held back fan by fan: what is not indexed yet is a miss, what is is bit-exact, and
a put or delete meanwhile wins over the records the scan finds later — also for a copy of
the tier taken at that moment, which is what a SIGKILL leaves."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.engine.calibrate import CALIBRATION_NS_ID
from kvtier.engine.store import Store
from kvtier.tiers import nvme as tier_module
from kvtier.tiers.nvme import NvmeTier, fan_of
from kvtier.tiers.record import RecordHeader, header_size_for
from kvtier.tiers.startup import EPOCH_BITS, FanScan
from tests.conftest import block_bytes
from tests.engine.test_store import NS, get, make_config, put

SIZE = 5000  # two pages: 8 KiB records, a few per fan
pytestmark = pytest.mark.timeout(90)


class Gate:
    """Lets the scan through fans below `upto` only (fan names compare as strings)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.upto = "g"  # every fan: close it before the start to hold back
        real = NvmeTier._scan_fan

        def gated(
            tier: NvmeTier, fan: str, tombstones: dict[tuple[str, bytes], int]
        ) -> FanScan | None:
            while fan >= self.upto:
                if tier._stop_recovery.is_set():
                    return None
                time.sleep(0.002)
            return real(tier, fan, tombstones)

        monkeypatch.setattr(NvmeTier, "_scan_fan", gated)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(monkeypatch)
    yield g
    g.upto = "g"  # let a scan still running end


def keys(count: int) -> list[bytes]:
    return [f"old{i}".encode() for i in range(count)]


def data_of(key: bytes) -> bytes:
    return block_bytes(int(key[3:]), SIZE)


async def fill(tmp_path: Path, count: int) -> list[bytes]:
    """`count` blocks on NVMe, the store stopped."""
    store = Store(make_config(tmp_path, 8 << 20, 64 << 20))
    await store.start()
    for key in keys(count):
        await put(store, key, data_of(key))
    assert await store.flush() == count
    await store.close()
    return keys(count)


async def until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def fan(key: bytes) -> str:
    return fan_of(NS, key)


async def test_serves_while_the_index_fills_and_every_block_comes_back(
    tmp_path: Path, gate: Gate
) -> None:
    old = await fill(tmp_path, 300)
    gate.upto = ""
    store = Store(make_config(tmp_path, 8 << 20, 64 << 20))
    await store.start(recover_in_background=True)
    assert store.nvme_recovering
    nvme = store.stats().tiers[1]
    assert (nvme.name, nvme.recovering, nvme.recovered_records) == ("nvme", True, 0)
    for key in old[:50]:
        assert await get(store, key) is None  # not indexed yet: a miss
    await put(store, b"new", block_bytes(9, SIZE))  # DRAM works meanwhile
    assert await get(store, b"new") == block_bytes(9, SIZE)

    gate.upto = "80"
    first_half = [k for k in old if fan(k) < "80"]
    await until(lambda: store.stats().tiers[1].recovered_records == len(first_half))
    assert store.nvme_recovering
    for key in old:
        assert await get(store, key) == (data_of(key) if fan(key) < "80" else None)

    gate.upto = "g"
    assert await store.nvme_recovered()
    nvme = store.stats().tiers[1]
    assert (nvme.recovering, nvme.recovered_records, nvme.blocks) == (False, 300, 300)
    for key in old:
        assert await get(store, key) == data_of(key)
    assert await get(store, b"new") == block_bytes(9, SIZE)
    await store.close()


def snapshot(tmp_path: Path, name: str) -> Path:
    """A copy of the tier as it is on disk now: what a SIGKILL would leave of it."""
    copy = tmp_path / name
    shutil.copytree(tmp_path / "nvme", copy / "nvme")
    return copy


async def test_a_put_and_a_delete_during_recovery_win_also_after_a_crash(
    tmp_path: Path, gate: Gate
) -> None:
    old = await fill(tmp_path, 200)
    gate.upto = ""
    replaced, deleted, added = old[0], old[1], old[2]  # added: put without overwrite
    store = Store(make_config(tmp_path, 8 << 20, 64 << 20))
    await store.start(recover_in_background=True)
    new_value = block_bytes(777, SIZE)
    await put(store, replaced, new_value, overwrite=True)
    assert not await store.delete((NS, deleted))  # not indexed yet: a miss, deleted anyway
    await put(store, added, block_bytes(778, SIZE))
    crashed = snapshot(tmp_path, "crash-during")

    gate.upto = "g"
    assert await store.nvme_recovered()
    assert await get(store, replaced) == new_value
    assert await get(store, deleted) is None
    assert await get(store, added) == block_bytes(778, SIZE)
    for key in old[3:]:
        assert await get(store, key) == data_of(key)
    recovery = store.recovery
    assert recovery is not None and (recovery.indexed, recovery.dropped) == (197, 3)

    assert store.nvme is not None and store.nvme.tier.first_generation is not None
    ours_from = store.nvme.tier.first_generation

    def old_files() -> list[Path]:
        return [
            p
            for key in (replaced, deleted, added)
            for p in (tmp_path / "nvme" / "v1" / fan(key)).iterdir()
            if _holds(p, key) and int(p.name.split(".")[1]) < ours_from
        ]

    await until(lambda: not old_files())  # the old records are removed, not just hidden
    crashed_after = snapshot(tmp_path, "crash-after")
    assert await store.flush() == 2  # the new values, DRAM-only so far
    await store.close()

    # After a crash at either point: never the old bytes, nothing else lost.
    for root in (crashed, crashed_after):
        again = Store(make_config(root, 8 << 20, 64 << 20))
        await again.start()
        assert await get(again, replaced) is None  # the new value was in DRAM only
        assert await get(again, deleted) is None
        assert await get(again, added) is None
        for key in old[3:]:
            assert await get(again, key) == data_of(key)
        await again.close()
    # After the clean stop: the new values.
    again = Store(make_config(tmp_path, 8 << 20, 64 << 20))
    await again.start()
    assert await get(again, replaced) == new_value
    assert await get(again, deleted) is None
    assert await get(again, added) == block_bytes(778, SIZE)
    await again.close()


def _holds(path: Path, key: bytes) -> bool:
    return path.name.split(".")[0] == tier_module._digest(NS, key)


async def test_records_written_while_recovering_are_left_to_this_run(
    tmp_path: Path, gate: Gate
) -> None:
    old = await fill(tmp_path, 100)
    gate.upto = ""
    # A record a crash during the last calibration left behind: removed by recovery.
    tier = NvmeTier(tmp_path / "nvme", 64 << 20, direct_io=False, sync_writes=False)
    tier.prepare()
    assert tier.first_generation is not None
    payload = aligned_buffer(4096)
    key = b"262144"
    leftover = RecordHeader(
        CALIBRATION_NS_ID,
        key,
        tier.first_generation,
        4096,
        xxhash.xxh3_64_intdigest(payload),
        header_size_for(CALIBRATION_NS_ID, key),
    )
    tier.write(leftover, [memoryview(payload)])
    tier.close()

    config = make_config(tmp_path, 4 << 20, 64 << 20)
    planner = config.planner.model_copy(update={"calibration_s": 0.3})
    store = Store(config.model_copy(update={"planner": planner}))
    await store.start(recover_in_background=True)
    gate.upto = "10"  # enough fans for an estimate of what is left: room for demotions
    assert store.nvme is not None
    capacity = store.nvme.capacity_bytes
    await until(lambda: store.residency.nvme_unindexed_bytes < capacity)
    await store.calibrate()  # its records are this run's: the scan must leave them alone
    fresh = {f"fresh{i}".encode(): block_bytes(1000 + i, 1 << 20) for i in range(12)}
    for k, v in fresh.items():  # 12 MiB through a 4 MiB arena: demoted while recovering
        await put(store, k, v)
    assert store.stats().demotions >= 8
    gate.upto = "g"
    assert await store.nvme_recovered()
    recovery = store.recovery
    assert recovery is not None
    assert (recovery.indexed, recovery.dropped) == (100, 1)  # the calibration leftover
    assert store.stats().checksum_failures == 0
    for k, v in fresh.items():
        assert await get(store, k) == v
    for k in old:
        assert await get(store, k) == data_of(k)
    await store.close()


async def test_no_room_on_nvme_until_the_estimate_of_what_is_left_is_known(
    tmp_path: Path, gate: Gate
) -> None:
    await fill(tmp_path, 50)
    gate.upto = ""
    store = Store(make_config(tmp_path, 2 << 20, 64 << 20))
    await store.start(recover_in_background=True)
    for i in range(4):  # through a 2 MiB arena: evicted, but no room to demote to
        await put(store, f"e{i}".encode(), block_bytes(i, 1 << 20))
    stats = store.stats()
    assert stats.demotions == 0 and stats.dropped_blocks >= 2
    gate.upto = "g"
    assert await store.nvme_recovered()
    assert store.residency.nvme_unindexed_bytes == 0
    for i in range(4, 8):
        await put(store, f"e{i}".encode(), block_bytes(i, 1 << 20))
    assert store.stats().demotions >= 2
    await store.close()


async def test_a_stop_while_recovering_ends_the_scan_and_keeps_the_old_tombstones(
    tmp_path: Path, gate: Gate
) -> None:
    old = await fill(tmp_path, 100)
    store = Store(make_config(tmp_path, 8 << 20, 64 << 20))
    await store.start()
    assert await store.delete((NS, old[5]))  # a tombstone in this run's log
    await store.close()

    store = Store(make_config(tmp_path, 8 << 20, 64 << 20))
    gate.upto = ""
    await store.start(recover_in_background=True)  # sets the last run's log aside
    gate.upto = "40"
    await until(lambda: store.stats().tiers[1].recovered_records > 0)
    started = time.monotonic()
    await store.close()  # the scan is held at fan 40: it must notice the stop
    assert time.monotonic() - started < 5
    await until(lambda: not any(t.name.startswith("kvtier-recover") for t in threading.enumerate()))
    # Not compacted: an incomplete recovery has not removed every record the log names.
    assert (tmp_path / "nvme" / "tombstones.1.log").stat().st_size > 0

    gate.upto = "g"
    again = Store(make_config(tmp_path, 8 << 20, 64 << 20))
    await again.start()
    for i, key in enumerate(old):
        assert await get(again, key) == (None if i == 5 else data_of(key))
    await again.close()
    logs = sorted(p.name for p in (tmp_path / "nvme").iterdir() if "tombstones" in p.name)
    assert logs == ["tombstones.log"]  # complete: the old logs are gone


async def test_generations_start_above_every_earlier_run(tmp_path: Path) -> None:
    seen = []
    for _ in range(3):
        store = Store(make_config(tmp_path, 8 << 20, 64 << 20))
        await store.start(recover_in_background=True)
        await put(store, b"k", block_bytes(len(seen), SIZE), overwrite=True)
        entry = store.stat((NS, b"k"))
        assert entry is not None
        seen.append(entry.generation)
        await store.close()  # no flush: nothing on disk says which generation it had
    assert seen == sorted(seen) and seen[0] >> EPOCH_BITS >= 1
    assert [g >> EPOCH_BITS for g in seen] == [(seen[0] >> EPOCH_BITS) + i for i in range(3)]
