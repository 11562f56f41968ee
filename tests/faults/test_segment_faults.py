"""Faults under the NVMe segment layout (nvme.layout = "segments", kvtier/tiers/segments.py):
SIGKILL at every write, seal and reclaim point, a full disk, short writes, I/O errors, a
torn segment and a segment footer that lies. Each row: a real daemon, real gRPC, real
files; every get checked against the shadow (a miss is never wrong), and the blocks that
must survive checked after a restart."""

from __future__ import annotations

import functools
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

import kvtier
from tests.conftest import DaemonProcess
from tests.faults import harness
from tests.faults.harness import (
    Report,
    Row,
    Shadow,
    check_all,
    fired,
    random_workload,
    still_serves,
)
from tests.faults.test_nvme_faults import can_unshare

StartDaemon = Callable[..., DaemonProcess]
NS = "faults/segments"
put_blocks = functools.partial(harness.put_blocks, ns=NS)
MiB = 1 << 20
SEGMENTS = {"KVTIER_NVME__LAYOUT": "segments", "KVTIER_PLANNER__CALIBRATION_S": "0"}
KILL_POINTS = (
    ("nvme.write", "kill@0.2*1"),  # a record about to be appended
    ("nvme.pwrite", "kill@0.2*1"),  # a record half written
    ("segment.seal", "kill*1"),  # a full segment's footer about to be written
    ("segment.reclaim", "kill*1"),  # emptied segments about to be deleted
    ("nvme.remove", "kill@0.2*1"),  # a removal's tombstone about to be appended
    ("nvme.tombstone", "kill@0.2*1"),  # a delete about to be made durable
)


def env(**extra: str) -> dict[str, str]:
    return {**SEGMENTS, **extra}


def segment_files(daemon: DaemonProcess) -> list[Path]:
    return sorted((daemon.nvme_path / "segments").glob("*.kvs"))


@pytest.mark.parametrize(("point", "action"), KILL_POINTS, ids=[p for p, _ in KILL_POINTS])
def test_sigkill_at(point: str, action: str, start_daemon: StartDaemon, report: Report) -> None:
    row = report.row(f"segments: SIGKILL at {point}", f"failpoint {point}={action} per round")
    shadow = Shadow()
    rng = random.Random(point)
    # 40 MiB: 4 MiB segments and reclaim from 32 MiB on, so the workload (~40 MiB written
    # a round) fills, seals and reclaims several.
    daemon = start_daemon(dram="3MiB", nvme="40MiB", env=env())
    with daemon.client() as c:
        base = put_blocks(c, shadow, "b", 8, 256 << 10, seed=5)
    daemon.terminate()  # the base blocks are on NVMe now
    for round_ in range(3):
        daemon.env = env(KVTIER_FAILPOINTS=f"{point}={action}", KVTIER_FAILPOINTS_SEED=str(round_))
        try:
            daemon.start()
        except AssertionError:  # killed at start-up (reclaim runs once the index is in)
            assert daemon.proc is not None and daemon.proc.wait(10) == -9, daemon.log()
            died = True
        else:
            with daemon.client(timeout_s=10) as c:
                died = random_workload(c, shadow, rng, row, ns=NS, ops=160)
        if died:
            assert daemon.proc is not None
            assert daemon.proc.wait(10) == -9, "the client failed but the daemon did not die"
            daemon.kill()
        else:
            daemon.terminate()
        row.injected = fired(daemon.log(), point)
        daemon.env = env()
        daemon.start()
        with daemon.client() as c:
            check_all(row, c, shadow, must_survive=set(base))
            row.serving = still_serves(c)
        daemon.terminate()
    row.assert_ok()


def test_sigkill_while_relocating(start_daemon: StartDaemon, report: Report) -> None:
    """Reclaim copying live records out of half-dead segments, killed mid-copy: the blocks
    never touched (the ones being copied) must all survive, once per round."""
    row = report.row(
        "segments: SIGKILL at segment.relocate", "failpoint segment.relocate=kill@0.3*1"
    )
    shadow = Shadow()
    daemon = start_daemon(dram="2MiB", nvme="40MiB", env=env())
    with daemon.client() as c:
        stable = []
        for i in range(16):  # interleaved: every segment half stable, half overwritten
            stable += put_blocks(c, shadow, f"s{i}-", 1, 512 << 10, seed=30 + i)
            put_blocks(c, shadow, f"o{i}-", 1, 512 << 10, seed=60 + i)
    daemon.terminate()
    for round_ in range(3):
        daemon.env = env(
            KVTIER_FAILPOINTS="segment.relocate=kill@0.3*1", KVTIER_FAILPOINTS_SEED=str(round_)
        )
        died = False
        logged = len(daemon.log())
        try:
            daemon.start()
        except AssertionError:
            # Reclaim may relocate (and the failpoint kill) as soon as the index is whole,
            # before the daemon has said so: a round that died starting, as any other.
            if "failpoint segment.relocate fired: kill" not in daemon.log()[logged:]:
                raise
            died = True
        if not died:
            with daemon.client(timeout_s=10) as c:
                for step in range(12):  # overwrites leave the older segments half dead
                    try:
                        for i in range(16):
                            seed = 100 + round_ * 20 + step
                            put_blocks(c, shadow, f"o{i}-", 1, 512 << 10, seed=seed * 16 + i)
                    except kvtier.KVTierError:
                        died = True
                        break
        if died:
            assert daemon.proc is not None and daemon.proc.wait(10) == -9
            daemon.kill()
        else:
            daemon.terminate()
        row.injected = fired(daemon.log(), "segment.relocate")
        daemon.env = env()
        daemon.start()
        with daemon.client() as c:
            check_all(row, c, shadow, must_survive=set(stable))
            row.serving = still_serves(c)
        daemon.terminate()
    row.assert_ok()


def test_enospc(start_daemon: StartDaemon, workdir: Path, report: Report) -> None:
    shadow = Shadow()
    nvme_dir = workdir / "nvme"
    if can_unshare():
        how = "segments on a 10 MiB tmpfs (unshare -m), tier capacity 64 MiB"
        prefix = [
            "unshare",
            "-m",
            "sh",
            "-c",
            'mkdir -p "$0" && mount -t tmpfs -o size=10m tmpfs "$0" && exec "$@"',
            str(nvme_dir),
        ]
        extra: dict[str, str] = {}
    else:
        how = "failpoint nvme.pwrite=enospc@0.5"
        prefix, extra = [], {"KVTIER_FAILPOINTS": "nvme.pwrite=enospc@0.5"}
    row = report.row("segments: ENOSPC", how)
    daemon = start_daemon(dram="4MiB", nvme="64MiB", env=env(**extra), prefix=prefix)
    with daemon.client() as c:
        base = put_blocks(c, shadow, "base", 4, 1 * MiB, seed=1)
        for round_ in range(3):
            put_blocks(c, shadow, f"fill{round_}-", 8, 1 * MiB, seed=10 + round_)
        on_nvme = {k for k in base if c.stat(NS, k) is not None}
        check_all(row, c, shadow, must_survive=on_nvme if prefix else set())
        row.serving = still_serves(c)
    row.injected = daemon.log().count("No space left on device")
    row.notes.append(f"{len(on_nvme)} of {len(base)} base blocks were on NVMe when full")
    row.assert_ok()


@pytest.mark.parametrize(
    ("fault", "spec"),
    [
        ("short writes", "nvme.pwrite=short@0.5"),
        ("EIO on writes", "nvme.pwrite=eio@0.3"),
        ("EIO on reads", "nvme.read=eio@0.3"),
    ],
)
def test_write_and_read_errors(
    fault: str, spec: str, start_daemon: StartDaemon, report: Report
) -> None:
    row = report.row(f"segments: {fault}", f"failpoint {spec}")
    shadow = Shadow()
    daemon = start_daemon(dram="4MiB", nvme="128MiB", env=env())
    with daemon.client() as c:
        base = put_blocks(c, shadow, "b", 12, 1 * MiB, seed=2)
    daemon.env = env(
        KVTIER_FAILPOINTS=spec,
        KVTIER_FAILPOINTS_SEED="3",
        KVTIER_NVME__OFFLINE_AFTER_ERRORS="1000",  # this row is about single records
    )
    daemon.restart()  # flushes DRAM to NVMe on stop
    with daemon.client() as c:
        put_blocks(c, shadow, "w", 12, 1 * MiB + 4096, seed=3)  # demotions under the fault
        check_all(row, c, shadow, must_survive=set())
    daemon.restart()  # its flush writes through the fault as well
    row.injected = fired(daemon.log(), spec.split("=")[0])
    daemon.env = env()
    daemon.restart()
    with daemon.client() as c:
        # Written before the fault and only read under it: still there.
        check_all(row, c, shadow, must_survive=set(base))
        row.serving = still_serves(c)
    row.assert_ok()


def _fill_and_stop(daemon: DaemonProcess, shadow: Shadow) -> list[str]:
    with daemon.client() as c:
        keys = put_blocks(c, shadow, "t", 24, 512 << 10, seed=7)
    daemon.terminate()  # sealed segments, every block on NVMe
    return keys


def _after_damage(row: Row, daemon: DaemonProcess, shadow: Shadow) -> None:
    """Every get right or a miss; new blocks then survive a restart of the damaged tier."""
    daemon.start()
    with daemon.client() as c:
        check_all(row, c, shadow, must_survive=set())
        fresh = put_blocks(c, shadow, "after", 6, 256 << 10, seed=8)
    daemon.restart()
    with daemon.client() as c:
        check_all(row, c, shadow, must_survive=set(fresh))
        row.serving = still_serves(c)


def test_torn_segment(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row(
        "segments: torn segment", "a segment cut short mid-record, one with garbage pages"
    )
    shadow = Shadow()
    daemon = start_daemon(dram="2MiB", nvme="128MiB", env=env())
    _fill_and_stop(daemon, shadow)
    files = segment_files(daemon)
    assert files, "no segment written"
    rng = random.Random(22)
    for path in files:
        size = path.stat().st_size
        with path.open("r+b") as fh:
            for _ in range(4):  # garbage over whole pages among the records
                fh.seek(rng.randrange(1, size // 4096 // 2) * 4096)
                fh.write(rng.randbytes(4096))
            row.injected += 4
        # ...and the last one cut short in the middle of a record (its trailer gone too).
    with files[-1].open("r+b") as fh:
        fh.truncate(files[-1].stat().st_size // 3 + 1234)
    row.injected += 1
    _after_damage(row, daemon, shadow)
    row.assert_ok()


def test_footer_that_lies(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row(
        "segments: a footer that lies",
        "footer offsets rotated, footer and trailer checksums made right",
    )
    shadow = Shadow()
    daemon = start_daemon(dram="2MiB", nvme="128MiB", env=env())
    _fill_and_stop(daemon, shadow)
    for path in segment_files(daemon):
        row.injected += _rotate_footer_offsets(path)
    _after_damage(row, daemon, shadow)
    row.assert_ok()


_TRAILER = struct.Struct("<8sQQQQ")
_ENTRY = struct.Struct("<QQQQIHHH")


def _rotate_footer_offsets(path: Path) -> int:
    """Give each footer entry the next one's offset, checksums made valid; entries moved."""
    raw = bytearray(path.read_bytes())
    at = len(raw) - 4096
    magic, seg_id, footer_at, footer_bytes, _ = _TRAILER.unpack_from(raw, at)
    if magic != b"KVTSEGT1":
        return 0
    (count,) = struct.unpack_from("<I", raw, footer_at + 8)
    positions, pos = [], footer_at + 12
    for _ in range(count):
        positions.append(pos)
        fields = _ENTRY.unpack_from(raw, pos)
        pos += _ENTRY.size + fields[6] + fields[7]
    if count < 2:
        return 0
    offsets = [struct.unpack_from("<Q", raw, p)[0] for p in positions]
    for p, off in zip(positions, offsets[1:] + offsets[:1], strict=True):
        struct.pack_into("<Q", raw, p, off)
    end = footer_at + footer_bytes - 8
    struct.pack_into("<Q", raw, end, xxhash.xxh3_64_intdigest(bytes(raw[footer_at:end])))
    digest = xxhash.xxh3_64_intdigest(bytes(raw[footer_at : footer_at + footer_bytes]))
    fixed = _TRAILER.pack(magic, seg_id, footer_at, footer_bytes, digest)
    raw[at : at + _TRAILER.size] = fixed
    struct.pack_into("<Q", raw, at + _TRAILER.size, xxhash.xxh3_64_intdigest(fixed))
    path.write_bytes(bytes(raw))
    return count


def test_a_files_tier_is_refused_by_the_segment_layout(
    start_daemon: StartDaemon, report: Report
) -> None:
    row = report.row("segments: a tier in the file layout", "nvme.layout switched on a full tier")
    shadow = Shadow()
    daemon = start_daemon(dram="2MiB", nvme="128MiB")
    keys = _fill_and_stop(daemon, shadow)
    daemon.env = env()
    with pytest.raises(AssertionError, match=r"failed to start|did not start"):
        daemon.start(timeout_s=20)
    row.injected = 1
    assert "nvme.layout" in daemon.log()
    assert daemon.proc is not None and daemon.proc.wait(10) == 2
    daemon.kill()
    daemon.env = {}
    daemon.start()
    with daemon.client() as c:
        check_all(row, c, shadow, must_survive=set(keys))
        row.serving = still_serves(c)
    row.assert_ok()
