"""NvmeRecovery adds a fan handed over as columns (the segment layout's restart) as it
adds one record at a time: the same blocks indexed, in the same NVMe order, and the same
records refused (and scheduled for removal) — a calibration record, a block put or
deleted meanwhile (buried), a block the catalog already holds — with chunks of any size."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvtier.engine import recovery as recovery_module
from kvtier.engine.calibrate import CALIBRATION_NS_ID
from kvtier.engine.recovery import NvmeRecovery
from kvtier.engine.residency import new_residency
from kvtier.engine.results import Counters
from kvtier.index.planner import PrefillCost, TierCost
from kvtier.index.policy import ValueModel
from kvtier.tiers.nvme import fan_of
from kvtier.tiers.record import RecordHeader
from kvtier.tiers.segment_recovery import fan_columns
from kvtier.tiers.startup import FanScan, RecoveredRecord

MODEL = ValueModel(
    0, 1024, PrefillCost(40e-6, 1.3e-9), {"dram": TierCost(50e9, 1e-5), "nvme": TierCost(7e9, 1e-4)}
)


class FakeTier:
    """A tier's fans as the record files' (the fan scans below are built with them)."""

    fan = staticmethod(fan_of)


class FakeDriver:
    tier: Any = FakeTier()
    capacity_bytes = 1 << 40

    def __init__(self) -> None:
        self.removed: list[tuple[RecordHeader, int]] = []

    def schedule_removal(self, header: RecordHeader, location: int = 0) -> None:
        self.removed.append((header, location))

    async def tombstone(self, block_id: tuple[str, bytes], generation: int) -> None:
        return None


def fan_scan() -> FanScan:
    """One fan's records: ordinary ones, a calibration record, out of generation order."""
    records = []
    i = 0
    while len(records) < 60:
        key = i.to_bytes(4, "little")
        i += 1
        ns = CALIBRATION_NS_ID if len(records) == 7 else ("t|a" if i % 3 else "u|b")
        if fan_of(ns, key) != fan_of("t|a", b"\0\0\0\0"):
            continue
        gen = 1000 - len(records) * 7 % 50
        header = RecordHeader(ns, key, gen, 4096, len(records) * 11, 4096)  # ties: by age
        records.append(RecoveredRecord(header, "", 10_000 + len(records)))
    return FanScan(fan_of("t|a", b"\0\0\0\0"), records)


def run(columns: bool, chunk: int) -> tuple[Any, ...]:
    driver = FakeDriver()
    residency = new_residency(
        "kvtier", "write_back", MODEL, 64, {"t": 1 << 24}, 1 << 40, lambda t: 0, Counters()
    )
    scan = fan_scan()
    held = scan.records[3].header
    residency.add_recovered((held.ns_id, held.key), 1, 1, 1, 8192, 5)  # held already
    rec = NvmeRecovery(driver, residency, Counters(), 5000)  # type: ignore[arg-type]
    touched = scan.records[11].header

    async def go() -> None:
        await rec.bury((touched.ns_id, touched.key))
        rec._chunk = chunk
        await rec._add_fan(fan_columns(scan) if columns else scan_sorted(scan))

    asyncio.run(go())
    order = []
    while (slot := residency.nvme_order.victim(lambda s: True)) is not None:
        order.append(residency.catalog.block_id_of(slot))
    removed = sorted((h.ns_id, h.key, h.generation, loc) for h, loc in driver.removed)
    cat = residency.catalog
    return (
        rec.indexed,
        rec.dropped,
        rec.max_generation,
        rec._bytes_added,
        removed,
        order,
        cat.nvme_used_bytes,
        dict(cat.nvme_used_by_tenant),
    )


def scan_sorted(scan: FanScan) -> FanScan:
    scan.records.sort(key=lambda r: r.header.generation)  # what on_fan does
    return scan


@pytest.mark.parametrize("chunk", [1, 5, 256])
def test_a_fan_in_columns_is_added_as_records_one_by_one(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recovery_module, "_MAX_CHUNK", chunk)
    want = run(columns=False, chunk=chunk)
    got = run(columns=True, chunk=chunk)
    assert got == want
    indexed, dropped, _, _, removed, order, _, _ = got
    assert dropped == 3 and indexed == 60 - 3 and len(order) == 60 - 3 + 1
    assert {r[0] for r in removed} >= {CALIBRATION_NS_ID}
