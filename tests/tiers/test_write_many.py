"""`write_many`, the tiers' batch write (the demoter's): the segment layout writes a batch
with one reservation, as few pwritev calls as IOV_MAX allows and one fdatasync; a failed
batch is never visible, not even after a restart; the file layout writes each record on
its own, one failure failing only its record."""

from __future__ import annotations

import errno
import os
import threading
from collections import Counter
from pathlib import Path

import pytest

from kvtier.buffers import aligned_buffer
from kvtier.tiers import segment_core as segments
from kvtier.tiers.allocator import round_up
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, encode_header
from kvtier.tiers.segment_file import unpack_location
from kvtier.tiers.segments import SegmentTier
from tests.tiers.test_segments import (
    MiB,
    crash,
    data_for,
    get,
    header_for,
    open_tier,
    put,
    recovered,
)


def batch(
    count: int, first_gen: int, size: int = 4096, prefix: bytes = b"b"
) -> tuple[list[RecordHeader], list[list[memoryview]], list[bytes]]:
    headers, payloads, datas = [], [], []
    for i in range(count):
        data = data_for((first_gen + i) & 0xFFFFFFFF, size)
        buf = aligned_buffer(round_up(size, 4096))
        buf[:size] = data
        headers.append(header_for(prefix + b"%d" % i, data, first_gen + i))
        payloads.append([memoryview(buf)])
        datas.append(data)
    return headers, payloads, datas


def test_a_batch_is_one_piece_per_iov_max_and_one_fdatasync(
    tiers: list[SegmentTier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tiers, tmp_path, 256 * MiB, sync_writes=True)
    gen = tier.first_generation
    assert gen is not None
    put(tier, b"first", data_for(0), gen)  # the segment exists: no rotation in the batch
    headers, payloads, datas = batch(700, gen + 1)  # 1400 buffers: over IOV_MAX once
    pieces: list[int] = []
    syncs = {"n": 0}
    real_pwrite, real_sync = segments.pwritev_all, os.fdatasync

    def pwrite(fd: int, iov: list[memoryview], total: int, offset: int) -> None:
        assert len(iov) <= 1024
        pieces.append(len(iov))
        real_pwrite(fd, iov, total, offset)

    def sync(fd: int) -> None:
        syncs["n"] += 1
        real_sync(fd)

    monkeypatch.setattr(segments, "pwritev_all", pwrite)
    monkeypatch.setattr(os, "fdatasync", sync)
    results = tier.write_many(headers, payloads)
    monkeypatch.undo()
    assert results == [h.record_bytes for h in headers]
    assert sorted(pieces) == [1400 - 1024, 1024]
    assert syncs["n"] == 1  # group commit: the batch is one extent
    crash(tier)
    tier = open_tier(tiers, tmp_path, 256 * MiB)
    for header, data in zip(headers, datas, strict=True):
        assert get(tier, header) == data


def test_a_batch_across_segments_and_beside_other_writers_comes_back(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    tier = open_tier(tiers, tmp_path, 64 * MiB, segment_bytes=4 * MiB, sync_writes=True)
    gen = tier.first_generation
    assert gen is not None
    singles: dict[int, RecordHeader] = {}

    def writer() -> None:
        for i in range(60):
            singles[i] = put(tier, b"s%d" % i, data_for(10_000 + i, 30_000), gen + 10_000 + i)

    thread = threading.Thread(target=writer)
    thread.start()
    written = []
    for round_ in range(4):  # 4 batches of 2.5 MiB through 4 MiB segments: rotations
        headers, payloads, datas = batch(40, gen + 1000 * round_, 64 << 10, b"r%d-" % round_)
        assert tier.write_many(headers, payloads) == [h.record_bytes for h in headers]
        written += zip(headers, datas, strict=True)
    thread.join()
    crash(tier)
    tier = open_tier(tiers, tmp_path, 64 * MiB, segment_bytes=4 * MiB)
    for header, data in written:
        assert get(tier, header) == data
    for i, header in singles.items():
        assert get(tier, header) == data_for(10_000 + i, 30_000)


def test_a_batch_whose_write_fails_beside_another_writer_does_not_wait_for_itself(
    tiers: list[SegmentTier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed write seals its segment once no reservation is in flight. Another writer
    reserves next to a batch (right after the batch's first reservation, or during its
    first write) and the batch's first write fails: both return (a batch that held
    reservations it had not written while it finished a piece waited for itself, and the
    other writer with it), and after a restart every record said written reads back and
    none said failed is there."""
    tier = open_tier(tiers, tmp_path, 256 * MiB, sync_writes=True)
    gen = tier.first_generation
    assert gen is not None
    put(tier, b"first", data_for(0), gen)  # the segment exists: no rotation in the batch
    headers, payloads, datas = batch(6, gen + 1)
    other: list[RecordHeader | BaseException] = []
    real_reserve, real_pwrite = segments.SegmentCore._reserve, segments.pwritev_all

    def other_writer() -> None:
        try:
            other.append(put(tier, b"between", data_for(9, 8192), gen + 99))
        except BaseException as err:  # checked below
            other.append(err)

    helper = threading.Thread(target=other_writer, daemon=True)

    def start_helper() -> None:
        """The other writer, once, until its extent is taken (its write then waits for
        the batch's extents before it)."""
        if helper.ident is not None:
            return
        seg = tier._active
        assert seg is not None
        tail = seg.tail
        helper.start()
        for _ in range(5000):
            if seg.tail != tail or not helper.is_alive():
                return
            helper.join(0.001)

    def reserve(
        core: segments.SegmentCore, header: RecordHeader, relocating: bool
    ) -> tuple[segments.Segment, int]:
        got = real_reserve(core, header, relocating)
        if header is headers[0]:
            start_helper()
        return got

    first_write = [True]

    def pwrite(fd: int, iov: list[memoryview], total: int, offset: int) -> None:
        if threading.current_thread() is not helper and first_write[0]:
            first_write[0] = False
            start_helper()
            raise OSError(errno.EIO, "Input/output error")  # the batch's first write
        real_pwrite(fd, iov, total, offset)

    monkeypatch.setattr(segments.SegmentCore, "_reserve", reserve)
    monkeypatch.setattr(segments, "pwritev_all", pwrite)
    results: list[list[int | OSError]] = []
    batch_writer = threading.Thread(
        target=lambda: results.append(tier.write_many(headers, payloads)), daemon=True
    )
    batch_writer.start()
    batch_writer.join(30)
    helper.join(30)
    assert not batch_writer.is_alive() and not helper.is_alive(), "a writer waits for ever"
    monkeypatch.undo()
    (got,) = results
    assert isinstance(got[0], OSError)  # the failed write's records are failures
    written = [(h, d) for h, d, r in zip(headers, datas, got, strict=True) if r == h.record_bytes]
    assert len(written) + sum(isinstance(r, OSError) for r in got) == len(headers)
    crash(tier)
    tier = open_tier(tiers, tmp_path, 256 * MiB)
    for header, data in written:
        assert get(tier, header) == data
    for header, r in zip(headers, got, strict=True):
        if isinstance(r, OSError):
            with pytest.raises(FileNotFoundError):
                tier.read(header)
    (between,) = other
    if isinstance(between, RecordHeader):
        assert get(tier, between) == data_for(9, 8192)


def test_a_failed_batch_is_never_visible_and_the_next_one_is(
    tiers: list[SegmentTier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tiers, tmp_path)
    gen = tier.first_generation
    assert gen is not None
    before = put(tier, b"before", data_for(1), gen)
    real = segments.pwritev_all
    calls = {"n": 0}

    def failing(fd: int, iov: list[memoryview], total: int, offset: int) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            real(fd, iov[:2], iov[0].nbytes + iov[1].nbytes, offset)  # the first record lands
            raise OSError(errno.EIO, "Input/output error")
        real(fd, iov, total, offset)

    monkeypatch.setattr(segments, "pwritev_all", failing)
    bad, bad_payloads, _ = batch(8, gen + 1, prefix=b"bad")
    results = tier.write_many(bad, bad_payloads)
    assert all(isinstance(r, OSError) for r in results)
    good, good_payloads, good_datas = batch(8, gen + 100, prefix=b"good")
    assert tier.write_many(good, good_payloads) == [h.record_bytes for h in good]
    for header in bad:
        with pytest.raises(FileNotFoundError):
            tier.read(header)
    crash(tier)
    monkeypatch.undo()
    for clean in (False, True):  # after a crash, then after a clean restart
        tier = open_tier(tiers, tmp_path)
        keys = {loc[2].key for loc in tier.record_locations()}
        assert keys == {b"before"} | {h.key for h in good}
        assert get(tier, before) == data_for(1)
        for header, data in zip(good, good_datas, strict=True):
            assert get(tier, header) == data
        if clean:
            break
        tier.close()


def test_the_file_layout_fails_only_the_record_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = NvmeTier(tmp_path, 64 * MiB, True, False)
    tier.open()
    gen = tier.first_generation
    assert gen is not None
    headers, payloads, datas = batch(5, gen)
    real = NvmeTier.write

    def write(self: NvmeTier, header: RecordHeader, payload: list[memoryview]) -> int:
        if header.key == b"b2":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, header, payload)

    monkeypatch.setattr(NvmeTier, "write", write)
    results = tier.write_many(headers, payloads)
    assert isinstance(results[2], OSError) and results[2].errno == errno.ENOSPC
    for i, (header, data) in enumerate(zip(headers, datas, strict=True)):
        if i == 2:
            with pytest.raises(FileNotFoundError):
                tier.read(header)
            continue
        assert results[i] == header.record_bytes
        buf, offset = tier.read(header)
        assert bytes(buf[offset : offset + header.payload_bytes]) == data
    tier.close()


def test_the_open_segment_keeps_no_objects_for_the_garbage_collector(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    """An open segment keeps what its footer will list: as encoded entries (bytes), not a
    header object and a tuple a record that every full collection walked (a segment of
    4 KiB blocks is 32 k records); the footer still lists every record."""
    import gc

    tier = open_tier(tiers, tmp_path, 256 * MiB)
    gen = tier.first_generation
    assert gen is not None
    for start in range(0, 3000, 300):
        headers, payloads, _ = batch(300, gen + start, prefix=b"g%d-" % start)
        # As the daemon writes (its catalog keeps the locations, not the tier).
        for placed in tier.write_many_placed(headers, payloads):
            assert not isinstance(placed, OSError) and placed.record_bytes
            tier.settle(placed.location)
    del headers, payloads
    gc.collect()
    assert sum(type(o) is RecordHeader for o in gc.get_objects()) < 300
    tier.close()  # seals the segment: its footer from the encoded entries
    again = open_tier(tiers, tmp_path, 256 * MiB)
    found = recovered(again)
    assert len(found) == 3000
    for i in (0, 1234, 2999):
        header = found[b"g%d-%d" % (i - i % 300, i % 300)]
        assert get(again, header) == data_for((gen + i) & 0xFFFFFFFF, 4096)


def test_batches_share_the_threads_header_buffer_and_leave_no_stale_bytes(
    tiers: list[SegmentTier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch's headers go into the writing thread's reused buffer, not a new mapping a
    batch (its faults and unmapping were ~6 µs a record); a batch of long keys then one of
    short keys in the same buffer leaves each header as if written alone: both read back,
    and both come back from the footer after a restart."""
    from kvtier.tiers import nvme

    tier = open_tier(tiers, tmp_path)
    gen = tier.first_generation
    assert gen is not None
    first = batch(16, gen, prefix=b"a-long-key-prefix-" * 8)
    second = batch(16, gen + 16, prefix=b"s")
    maps: list[int] = []
    for module in (nvme, segments):  # where the write path takes its buffers from
        monkeypatch.setattr(module, "aligned_buffer", lambda n: maps.append(n) or aligned_buffer(n))
    results = tier.write_many_placed(first[0], first[1])
    made = len(maps)
    results += tier.write_many_placed(second[0], second[1])
    assert len(maps) == made, "the second batch mapped a buffer of its own"
    headers = first[0] + second[0]
    for header, data, placed in zip(headers, first[2] + second[2], results, strict=True):
        assert not isinstance(placed, OSError) and placed.record_bytes
        tier.settle(placed.location)
        buf, offset = tier.read(header, placed.location)  # as the catalog asks for it
        assert bytes(buf[offset : offset + header.payload_bytes]) == data
        # Byte for byte the header a record written alone has: no key of the batch before.
        assert bytes(buf[:offset]) == bytes(encode_header(header))
    tier.close()
    again = open_tier(tiers, tmp_path)
    found = recovered(again)
    for headers, _, datas in (first, second):
        for header, data in zip(headers, datas, strict=True):
            assert found[header.key] == header
            assert get(again, header) == data


def test_settle_many_settles_each_location_once_across_segments(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    """A batch spread over segments (rotations) leaves each record pending until its
    location is settled; `settle_many` is `settle` of each, its segment's count and no
    other's (a segment still pending is not reclaimed)."""
    tier = open_tier(tiers, tmp_path, 64 * MiB, segment_bytes=4 * MiB)
    gen = tier.first_generation
    assert gen is not None
    headers, payloads, _ = batch(40, gen, 256 << 10)  # 10 MiB through 4 MiB segments
    results = tier.write_many_placed(headers, payloads)
    locations = [r.location for r in results if not isinstance(r, OSError)]
    assert len(locations) == 40
    by_segment = Counter(unpack_location(loc)[0] for loc in locations)
    assert len(by_segment) >= 3
    assert {s: tier._segments[s].pending for s in by_segment} == by_segment
    tier.settle_many(locations[:5])
    first = unpack_location(locations[0])[0]
    assert tier._segments[first].pending == by_segment[first] - 5
    tier.settle_many(locations[5:])
    assert all(tier._segments[s].pending == 0 for s in by_segment)
    tier.close()
