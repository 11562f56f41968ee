"""A short, bounded calibration at start-up that seeds the planner's path estimators.

Until engines have fetched enough blocks for the online fit to take over, the planner
needs figures for *this* machine rather than the configured guesses: a drive may give a
tenth of a datasheet's bandwidth to 1 MiB O_DIRECT reads behind a file system, and DRAM
copies in Python run at a fraction of `memcpy`'s peak. So the daemon times the real code
paths on a few block sizes: the NVMe tier's own record write + verified `read_into` (the
promotion path), and a copy between two page-aligned buffers (what a zero-copy client
does out of the arena). Each observation is the median of a few repeats, and only a
handful are made per path, so the first real transfers outweigh them quickly.

Blocking: run it on the I/O pool. It stops at `budget_s` whatever it has.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import statistics
import time
from dataclasses import dataclass

import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.errors import CorruptRecord
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for

# A namespace id no tenant can have ("tenant|namespace" always has a '|'), so a record
# left by a crash mid-calibration is recognised and removed at the next start.
logger = logging.getLogger(__name__)

CALIBRATION_NS_ID = "kvtier-calibration"
SIZES_BYTES = (256 << 10, 1 << 20, 4 << 20)
REPEATS = 3
CALIBRATION_RECORDS = 8  # NVMe records written at most (observations per path)


@dataclass(frozen=True, slots=True)
class Observation:
    path: str  # "dram" or "nvme"
    size_bytes: int
    seconds: float


def calibrate(
    nvme: NvmeTier | None,
    budget_s: float,
    generations: list[int] | None = None,
    observations_per_path: int = CALIBRATION_RECORDS,
) -> list[Observation]:
    """Timed transfers on the DRAM copy path and (if given) the NVMe tier, within budget_s.
    The NVMe records take their `generations` from the caller (default 1, 2, ...): a
    daemon's own, so a recovery running meanwhile leaves them alone."""
    deadline_s = time.perf_counter() + budget_s
    out = _dram(deadline_s, observations_per_path)
    if nvme is not None:
        if generations is None:
            generations = list(range(1, observations_per_path + 1))
        out += _nvme(nvme, deadline_s, generations[:observations_per_path])
    return out


def _sizes(count: int) -> list[int]:
    return [SIZES_BYTES[i % len(SIZES_BYTES)] for i in range(count)]


def _dram(deadline_s: float, count: int) -> list[Observation]:
    largest = max(SIZES_BYTES)
    src, dst = aligned_buffer(largest), aligned_buffer(largest)
    src.write(os.urandom(largest))  # touch every page: first-touch faults are not copies
    dst.write(bytes(largest))
    s, d = memoryview(src), memoryview(dst)
    out: list[Observation] = []
    try:
        for size in _sizes(count):
            if time.perf_counter() >= deadline_s:
                break
            times = []
            for _ in range(REPEATS):
                started = time.perf_counter()
                d[:size] = s[:size]
                times.append(time.perf_counter() - started)
            out.append(Observation("dram", size, statistics.median(times)))
    finally:
        s.release()
        d.release()
        src.close()
        dst.close()
    return out


def _time_one(
    nvme: NvmeTier, header: RecordHeader, payload: mmap.mmap, dest: mmap.mmap
) -> float | None:
    """Write one record, time REPEATS verified reads of it; None if the disk failed (the
    error is handled here, so no view of `payload` or `dest` outlives this call)."""
    size = header.payload_bytes
    try:
        nvme.write(header, [memoryview(payload)[:size]])
        times = []
        for _ in range(REPEATS):
            target = memoryview(dest)[:size]
            started = time.perf_counter()
            nvme.read_into(header, target)
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    except (OSError, CorruptRecord) as err:
        # A full or failing disk must not stop the daemon: the seeds stand in for what
        # could not be measured, and the tier's own error handling takes it from here.
        logger.warning("NVMe calibration stopped early: %s", err)
        return None


def _nvme(nvme: NvmeTier, deadline_s: float, generations: list[int]) -> list[Observation]:
    out: list[Observation] = []
    largest = max(SIZES_BYTES)
    payload = aligned_buffer(largest)
    payload.write(os.urandom(largest))
    dest = aligned_buffer(largest)
    written: list[RecordHeader] = []
    try:
        for generation, size in zip(generations, _sizes(len(generations)), strict=True):
            if time.perf_counter() >= deadline_s:
                break
            key = f"{size}".encode()
            header = RecordHeader(
                ns_id=CALIBRATION_NS_ID,
                key=key,
                generation=generation,
                payload_bytes=size,
                xxh3_64=xxhash.xxh3_64_intdigest(memoryview(payload)[:size]),
                header_bytes=header_size_for(CALIBRATION_NS_ID, key),
            )
            written.append(header)
            median_s = _time_one(nvme, header, payload, dest)
            if median_s is None:
                break
            out.append(Observation("nvme", header.record_bytes, median_s))
    finally:
        for header in written:
            with contextlib.suppress(OSError):  # a leftover is removed at the next start
                nvme.remove(header)
        payload.close()
        dest.close()
    return out
