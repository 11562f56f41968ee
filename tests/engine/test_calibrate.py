"""Start-up calibration: bounded, leaves nothing on disk, moves the estimates to this machine."""

from __future__ import annotations

import time
from pathlib import Path

import xxhash

from kvtier.config import Config
from kvtier.engine.calibrate import CALIBRATION_NS_ID, calibrate
from kvtier.engine.store import Store
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for


def _config(tmp_path: Path, **planner: object) -> Config:
    return Config.model_validate(
        {
            "server": {"listen": f"unix://{tmp_path}/s.sock"},
            "dram": {"capacity_bytes": 16 << 20, "prefault": False},
            "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 64 << 20},
            "planner": planner,
        }
    )


def _records(root: Path) -> list[Path]:
    """Visible or half-written records (removed ones may wait in free/ to be recycled)."""
    return [p for d in ("v1", "tmp") for p in (root / d).rglob("*") if p.is_file()]


def test_calibration_times_both_paths_and_removes_its_records(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path / "nvme", 64 << 20, direct_io=True, sync_writes=False)
    tier.open()
    observations = calibrate(tier, budget_s=5.0, observations_per_path=6)
    assert sorted({o.path for o in observations}) == ["dram", "nvme"]
    assert sum(o.path == "nvme" for o in observations) == 6
    assert all(o.seconds > 0 for o in observations)
    assert len({o.size_bytes for o in observations if o.path == "dram"}) == 3
    assert _records(tmp_path / "nvme") == []
    tier.close()


def test_calibration_stops_at_its_budget(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path / "nvme", 64 << 20, direct_io=True, sync_writes=False)
    tier.open()
    started = time.perf_counter()
    observations = calibrate(tier, budget_s=0.0, observations_per_path=1000)
    assert observations == [] and time.perf_counter() - started < 1.0
    tier.close()


async def test_calibration_replaces_absurd_seeds(tmp_path: Path) -> None:
    store = Store(
        _config(
            tmp_path,
            calibration_s=5.0,
            dram_bandwidth_bytes_per_s=1.0,
            nvme_bandwidth_bytes_per_s=1.0,
        )
    )
    await store.start()
    await store.calibrate()
    paths, _ = store.estimates()
    for name in ("dram", "nvme"):
        assert 1e7 < paths[name].bandwidth_bytes_per_s < 1e12, (name, paths[name])
    # An NVMe block reaches the engine through both paths: slower than the copy alone, and
    # than its read amortized over the I/O threads that read a fetched run together.
    size = 1 << 20
    nvme_s = store.path_cost("nvme").fetch_s(size)
    assert nvme_s > paths["dram"].fetch_s(size)
    assert nvme_s > paths["nvme"].fetch_s(size) / store.io.threads
    await store.close()


async def test_a_record_left_by_an_interrupted_calibration_is_removed(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path / "nvme", 64 << 20, direct_io=False, sync_writes=False)
    tier.open()
    payload = bytes(range(256)) * 16
    header = RecordHeader(
        ns_id=CALIBRATION_NS_ID,
        key=b"4096",
        generation=1,
        payload_bytes=len(payload),
        xxh3_64=xxhash.xxh3_64_intdigest(payload),
        header_bytes=header_size_for(CALIBRATION_NS_ID, b"4096"),
    )
    buf = bytearray(payload)
    tier.write(header, [memoryview(buf)])
    tier.close()
    assert len(_records(tmp_path / "nvme")) == 1
    store = Store(_config(tmp_path, calibration_s=0))
    await store.start()
    assert list(store.residency.catalog.entries()) == []
    assert _records(tmp_path / "nvme") == []
    await store.close()
