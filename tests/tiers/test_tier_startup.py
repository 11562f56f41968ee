"""The tier's start-up in steps (prepare, recover, compact) as a daemon serving while its
index fills uses them: generation epochs, the tombstone logs set aside, this run's records
left alone by the scan, a stopped scan."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.tiers.nvme import TOMBSTONE_LOG, NvmeTier
from kvtier.tiers.startup import EPOCH_BITS, EPOCH_FILE
from kvtier.tiers.wipe import wipe
from tests.tiers.test_nvme import NS, write


def tier_at(root: Path) -> NvmeTier:
    return NvmeTier(root, 1 << 30, direct_io=False, sync_writes=False)


def test_each_start_claims_a_later_epoch_and_a_damaged_one_means_recover_first(
    tmp_path: Path,
) -> None:
    firsts = []
    for _ in range(3):
        tier = tier_at(tmp_path)
        tier.prepare()  # a start that is killed before its recovery ends
        assert tier.first_generation is not None
        firsts.append(tier.first_generation)
        tier.close()
    assert firsts == [1 << EPOCH_BITS, 2 << EPOCH_BITS, 3 << EPOCH_BITS]

    tier = tier_at(tmp_path)
    tier.prepare()
    write(tier, b"k", b"newest", generation=tier.first_generation + 7)  # type: ignore[operator]
    tier.close()
    (tmp_path / EPOCH_FILE).write_bytes(b"\0" * 16)  # damaged: the epoch is unknown
    tier = tier_at(tmp_path)
    tier.prepare()
    assert tier.first_generation is None
    report = tier.recover()
    assert report.max_generation == (4 << EPOCH_BITS) + 7
    assert tier.epoch.claim_above(report.max_generation) == 5 << EPOCH_BITS
    tier.close()
    tier = tier_at(tmp_path)
    tier.prepare()
    assert tier.first_generation == 6 << EPOCH_BITS
    tier.close()


def test_a_tier_an_older_kvtier_wrote_has_no_epoch_until_it_is_recovered(
    tmp_path: Path,
) -> None:
    tier = tier_at(tmp_path)
    tier.open()
    write(tier, b"k", b"old", generation=41)
    tier.close()
    (tmp_path / EPOCH_FILE).unlink()
    tier = tier_at(tmp_path)
    report = tier.open()  # recovers, then claims above what it found
    assert [r.header.generation for r in report.records] == [41]
    assert tier.first_generation == 1 << EPOCH_BITS
    tier.close()


def test_tombstones_of_a_run_killed_mid_recovery_count_after_a_torn_one_before_them(
    tmp_path: Path,
) -> None:
    tier = tier_at(tmp_path)
    tier.open()
    old = write(tier, b"old", b"old bytes", generation=5)
    other = write(tier, b"other", b"other bytes", generation=6)
    tier.tombstone(NS, b"other", 6)
    tier.close()
    log = tmp_path / TOMBSTONE_LOG
    os.truncate(log, log.stat().st_size - 3)  # a power loss tore that append
    tier = tier_at(tmp_path)
    tier.prepare()
    assert tier.first_generation is not None
    tier.tombstone(NS, b"old", tier.first_generation - 1)  # deleted while recovering
    tier.close()  # killed before its recovery ended
    tier = tier_at(tmp_path)
    report = tier.open()
    assert [r.header for r in report.records] == [other]  # the torn tombstone is lost
    assert report.dropped_deleted == 1 and not tier.record_path(NS, b"old", 5).exists()
    assert old.generation == 5
    # Complete: the logs set aside are gone, the live one is this run's (empty).
    assert sorted(p.name for p in tmp_path.iterdir() if "tombstones" in p.name) == [TOMBSTONE_LOG]
    tier.close()


def test_the_scan_leaves_this_runs_records_alone(tmp_path: Path) -> None:
    tier = tier_at(tmp_path)
    tier.open()
    old = write(tier, b"k", b"old", generation=3)
    tier.close()
    tier = tier_at(tmp_path)
    tier.prepare()
    assert tier.first_generation is not None
    ours = write(tier, b"k", b"ours", generation=tier.first_generation)  # a demotion, say
    report = tier.recover()
    # Not judged stale against ours (the store decides: the block was touched), not removed.
    assert [r.header for r in report.records] == [old]
    assert tier.record_path(NS, b"k", ours.generation).exists()
    assert report.max_generation == 3
    tier.close()


def test_a_stopped_recovery_is_incomplete_and_keeps_the_old_logs(tmp_path: Path) -> None:
    tier = tier_at(tmp_path)
    tier.open()
    write(tier, b"k", b"v", generation=3)
    tier.tombstone(NS, b"gone", 2)
    tier.close()
    tier = tier_at(tmp_path)
    tier.prepare()
    tier.stop_recovery()
    handed: list[object] = []
    report = tier.recover(handed.append)
    assert not report.complete and handed == [] and report.records == []
    tier.close()
    assert (tmp_path / "tombstones.1.log").stat().st_size > 0


def test_wipe_drops_the_tenants_tombstones_from_the_logs_set_aside_too(tmp_path: Path) -> None:
    alice = "alice|m"
    tier = tier_at(tmp_path)
    tier.open()
    tier.tombstone(alice, b"secret-key", 9)
    tier.tombstone(NS, b"kept", 9)
    tier.close()
    tier = tier_at(tmp_path)
    tier.prepare()  # sets that log aside; killed before its recovery ended
    tier.close()
    assert b"secret-key" in (tmp_path / "tombstones.1.log").read_bytes()
    report = wipe(tmp_path, "alice")
    assert report.tombstones_dropped == 1
    logs = [p for p in tmp_path.iterdir() if p.name.startswith("tombstones")]
    assert logs and all(b"secret-key" not in p.read_bytes() for p in logs)
    assert any(b"kept" in p.read_bytes() for p in logs)
