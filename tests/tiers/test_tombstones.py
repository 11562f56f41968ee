"""Tombstones: a deleted or overwritten record never comes back after a crash."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.nvme import TOMBSTONE_LOG, NvmeTier
from tests.tiers.test_nvme import make_tier, read, reopen, write


def test_a_tombstoned_record_is_dropped_at_the_next_start(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    old = write(tier, b"k", b"old bytes", generation=3)
    write(tier, b"other", b"kept", generation=4)
    tier.tombstone(old.ns_id, old.key, old.generation)  # the file is still there: a crash
    report = reopen(tmp_path)
    assert report.dropped_deleted == 1
    assert [r.header.key for r in report.records] == [b"other"]
    assert report.max_tombstone_generation == 3
    # Compacted: the next start finds an empty log and nothing more to drop.
    assert (tmp_path / TOMBSTONE_LOG).stat().st_size == 0
    assert reopen(tmp_path).dropped_deleted == 0


def test_a_newer_generation_of_the_key_survives_its_old_tombstone(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    old = write(tier, b"k", b"v1", generation=1)
    tier.tombstone(old.ns_id, old.key, old.generation)
    tier.remove(old)
    new = write(tier, b"k", b"v2", generation=2)
    report = reopen(tmp_path)
    assert [r.header for r in report.records] == [new]
    assert read(make_tier(tmp_path), new) == b"v2"


def test_a_torn_last_tombstone_is_ignored_and_the_rest_apply(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    a = write(tier, b"a", b"A", generation=1)
    b = write(tier, b"b", b"B", generation=2)
    tier.tombstone(a.ns_id, a.key, a.generation)
    tier.tombstone(b.ns_id, b.key, b.generation)
    log = tmp_path / TOMBSTONE_LOG
    os.truncate(log, log.stat().st_size - 3)  # the crash hit the second append
    report = reopen(tmp_path)
    assert report.dropped_deleted == 1
    assert [r.header.key for r in report.records] == [b"b"]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([b"x", b"y", b"z"]), st.booleans()), max_size=12))
def test_recovery_matches_the_model_of_puts_and_deletes(
    tmp_path_factory: object, ops: list[tuple[bytes, bool]]
) -> None:
    root = tmp_path_factory.mktemp("tomb")  # type: ignore[attr-defined]
    tier = NvmeTier(root, 1 << 30, direct_io=False, sync_writes=False)  # fast: no fsyncs
    tier.open()
    model: dict[bytes, int] = {}
    for generation, (key, delete) in enumerate(ops, start=1):
        if delete:
            if key in model:
                tier.tombstone("default|m/l", key, model.pop(key))
        else:
            write(tier, key, key * generation, generation)  # old record left behind
            model[key] = generation
    tier.close()
    report = reopen(root)
    assert {r.header.key: r.header.generation for r in report.records} == model
