"""The parallel recovery scan against a serial reference: the same winners, in the same
order, the same counts and the same files left, on a tier holding every kind of record
recovery has to sort out, with the fans finishing in a scrambled order."""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.errors import CorruptRecord
from kvtier.tiers import nvme
from kvtier.tiers.allocator import round_up
from kvtier.tiers.nvme import RECORD_SUFFIX, NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for

NS = "default|m/l"


@dataclass(frozen=True)
class Outcome:
    records: list[tuple[RecordHeader, str]]
    corrupt: int
    stale: int
    deleted: int
    left: list[str]  # record files on disk afterwards


def _write(tier: NvmeTier, key: bytes, data: bytes, generation: int) -> RecordHeader:
    header = RecordHeader(
        NS, key, generation, len(data), xxhash.xxh3_64_intdigest(data), header_size_for(NS, key)
    )
    buf = aligned_buffer(round_up(max(len(data), 1), 4096))
    buf[: len(data)] = data
    tier.write(header, [memoryview(buf)[: round_up(len(data), 4096)]])
    return header


def _populate(root: Path) -> None:
    """~300 blocks over most fans: several generations (in either order on disk), some
    tombstoned (all or only old generations), corrupt, truncated, misplaced, renamed."""
    rng = random.Random(22)
    tier = NvmeTier(root, 1 << 40, direct_io=False, sync_writes=False)
    tier.open()
    try:
        for i in range(300):
            key = f"block-{i}".encode()
            generations = rng.sample(range(1, 40), rng.choice([1, 1, 2, 3]))
            headers = [
                _write(tier, key, os.urandom(rng.randrange(1, 9000)), g) for g in generations
            ]
            kind = i % 10
            newest = max(headers, key=lambda h: h.generation)
            path = tier.record_path(NS, key, newest.generation)
            if kind == 1:  # deleted before the stop: every generation goes
                tier.tombstone(NS, key, newest.generation)
            elif kind == 2:  # an older generation deleted, the newest stays
                tier.tombstone(NS, key, min(h.generation for h in headers))
            elif kind == 3:  # the newest's header damaged: an older one may win
                with path.open("r+b") as fh:
                    fh.seek(40)
                    fh.write(b"\xff")
            elif kind == 4:  # the newest truncated
                os.truncate(path, newest.header_bytes)
            elif kind == 5:  # the newest moved to another fan
                other = tier.record_path(NS, b"elsewhere", 1).parent
                if other != path.parent:
                    path.rename(other / path.name)
            elif kind == 6:  # the newest renamed to another generation in its fan
                path.rename(path.with_name(path.name.replace(f".{newest.generation}.", ".99.")))
            elif kind == 7:  # the newest's file grown past its header's length
                with path.open("ab") as fh:
                    fh.write(b"\0" * 4096)
    finally:
        tier.close()


def _left(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "v1").glob(f"*/*{RECORD_SUFFIX}"))


def _parallel(root: Path) -> Outcome:
    tier = NvmeTier(root, 1 << 40, direct_io=False, sync_writes=False)
    report = tier.open()
    tier.close()
    return Outcome(
        [(r.header, r.file) for r in report.records],
        report.dropped_corrupt,
        report.dropped_stale,
        report.dropped_deleted,
        _left(root),
    )


def _serial_reference(root: Path) -> Outcome:
    """Recovery as it was before the fans were scanned in parallel: one sorted pass over
    every record file, the tier's own header checks for each."""
    tier = NvmeTier(root, 1 << 40, direct_io=False, sync_writes=False)
    tier._records_dir.mkdir(parents=True, exist_ok=True)
    tombstones = tier._read_tombstones()
    newest: dict[tuple[str, bytes], tuple[RecordHeader, Path]] = {}
    corrupt = stale = deleted = 0
    for path in sorted(tier._records_dir.glob(f"*/*{RECORD_SUFFIX}")):
        try:
            header = tier._read_header(path)
        except (CorruptRecord, OSError):
            path.unlink(missing_ok=True)
            corrupt += 1
            continue
        ident = (header.ns_id, header.key)
        if header.generation <= tombstones.get(ident, 0):
            path.unlink(missing_ok=True)
            deleted += 1
            continue
        old = newest.get(ident)
        if old is not None:
            if old[0].generation >= header.generation:
                path.unlink(missing_ok=True)
                stale += 1
                continue
            old[1].unlink(missing_ok=True)
            stale += 1
        newest[ident] = (header, path)
    return Outcome([(h, str(p)) for h, p in newest.values()], corrupt, stale, deleted, _left(root))


@pytest.mark.parametrize("threads", [1, 8, 16])
def test_the_parallel_scan_matches_a_serial_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    _populate(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    scan_fan = NvmeTier._scan_fan
    scanned_on: set[str] = set()

    def scrambled(self: NvmeTier, fan: str, tombstones: dict[tuple[str, bytes], int]) -> object:
        scanned_on.add(threading.current_thread().name.split("_")[0])
        time.sleep(random.Random(fan).random() * 0.003)  # fans finish out of order
        return scan_fan(self, fan, tombstones)

    monkeypatch.setattr(NvmeTier, "_scan_fan", scrambled)
    monkeypatch.setattr(nvme, "_RECOVERY_THREADS", threads)
    monkeypatch.setattr(nvme, "_CACHED_HEADER_S", 0.0)  # the pool even for cached headers
    got = _parallel(tmp_path / "a")
    want = _serial_reference(tmp_path / "b")
    # The same files on disk under either root, so compare paths relative to it.
    rel = [(h, os.path.relpath(f, tmp_path / "a")) for h, f in got.records]
    assert rel == [(h, os.path.relpath(f, tmp_path / "b")) for h, f in want.records]
    assert (got.corrupt, got.stale, got.deleted) == (want.corrupt, want.stale, want.deleted)
    assert got.left == want.left
    # The tier had every kind of record to sort out (else this compares little).
    assert got.corrupt >= 100 and got.stale >= 20 and got.deleted >= 20
    assert len(got.records) >= 150
    assert ("kvtier-recover" in scanned_on) == (threads > 1)
