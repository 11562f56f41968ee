from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import xxhash

from kvtier import failpoints
from kvtier.buffers import aligned_buffer
from kvtier.errors import CorruptRecord
from kvtier.tiers.allocator import round_up
from kvtier.tiers.nvme import NvmeTier, RecoveryReport
from kvtier.tiers.record import RecordHeader, encode_header, header_size_for

NS = "default|m/l"


_open: list[NvmeTier] = []


def make_tier(root: Path, direct: bool = True) -> NvmeTier:
    """A tier over `root`, as a restarted daemon would open it (the last one lets go)."""
    while _open:
        _open.pop().close()
    tier = NvmeTier(root, 1 << 30, direct_io=direct, sync_writes=True)
    tier.open()
    _open.append(tier)
    return tier


def reopen(root: Path) -> RecoveryReport:
    while _open:
        _open.pop().close()
    tier = NvmeTier(root, 1 << 30, direct_io=True, sync_writes=False)
    _open.append(tier)
    return tier.open()


def payload_buffers(data: bytes) -> list[memoryview]:
    buf = aligned_buffer(round_up(max(len(data), 1), 4096))
    buf[: len(data)] = data
    return [memoryview(buf)[: round_up(len(data), 4096)]] if data else []


def header_for(key: bytes, data: bytes, generation: int = 1) -> RecordHeader:
    return RecordHeader(
        NS, key, generation, len(data), xxhash.xxh3_64_intdigest(data), header_size_for(NS, key)
    )


def write(tier: NvmeTier, key: bytes, data: bytes, generation: int = 1) -> RecordHeader:
    header = header_for(key, data, generation)
    assert tier.write(header, payload_buffers(data)) == header.record_bytes
    return header


def read(tier: NvmeTier, header: RecordHeader) -> bytes:
    buf, offset = tier.read(header)
    return bytes(buf[offset : offset + header.payload_bytes])


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, (1 << 20) + 3])
def test_round_trip(tmp_path: Path, direct: bool, size: int) -> None:
    tier = make_tier(tmp_path, direct)
    data = os.urandom(size)
    header = write(tier, b"key", data)
    assert read(tier, header) == data
    path = tier.record_path(NS, b"key", 1)
    assert path.stat().st_size == header.record_bytes and path.stat().st_size % 4096 == 0


def test_long_keys_get_a_longer_header(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    key = b"k" * 4096
    header = write(tier, key, b"data")
    assert header.header_bytes == 8192
    assert read(tier, header) == b"data"
    assert reopen(tmp_path).records[0].header == header


def test_every_flipped_byte_is_detected(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    data = os.urandom(10_000)
    header = write(tier, b"key", data)
    path = tier.record_path(NS, b"key", 1)
    original = path.read_bytes()
    for offset in range(0, len(original), 97):
        damaged = bytearray(original)
        damaged[offset] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptRecord):
            read(tier, header)
    path.write_bytes(original)
    assert read(tier, header) == data


def test_truncated_or_swapped_records_are_detected(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    a = write(tier, b"a", b"A" * 5000)
    b = write(tier, b"b", b"B" * 5000)
    path_a, path_b = tier.record_path(NS, b"a", 1), tier.record_path(NS, b"b", 1)
    path_a.write_bytes(path_b.read_bytes())  # b's record under a's name
    with pytest.raises(CorruptRecord, match="catalog"):
        read(tier, a)
    assert read(tier, b) == b"B" * 5000
    os.truncate(path_b, 4096)
    with pytest.raises(CorruptRecord):
        read(tier, b)
    report = reopen(tmp_path)
    assert report.records == [] and report.dropped_corrupt == 2
    assert not path_a.exists() and not path_b.exists()


def test_recovery_keeps_the_newest_generation(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    write(tier, b"k", b"old", generation=3)
    newest = write(tier, b"k", b"new", generation=7)
    write(tier, b"other", b"x", generation=5)
    report = reopen(tmp_path)
    by_key = {r.header.key: r.header for r in report.records}
    assert by_key[b"k"] == newest and report.dropped_stale == 1
    assert not tier.record_path(NS, b"k", 3).exists()


def test_enospc_leaves_no_visible_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier(tmp_path)
    real = os.pwritev
    calls = 0

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            return real(fd, buffers[:1], offset)  # a short write first...
        raise OSError(errno.ENOSPC, "No space left on device")  # ...then the disk is full

    monkeypatch.setattr(os, "pwritev", failing)
    with pytest.raises(OSError, match="No space"):
        write(tier, b"full", os.urandom(50_000))
    monkeypatch.setattr(os, "pwritev", real)
    assert not tier.record_path(NS, b"full", 1).exists()
    assert list((tmp_path / "tmp").iterdir()) == []
    assert reopen(tmp_path).records == []


def test_short_writes_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make_tier(tmp_path, direct=False)
    real = os.pwritev

    def one_page_at_a_time(fd: int, buffers: list[memoryview], offset: int) -> int:
        first = memoryview(buffers[0])[:4096]
        return real(fd, [first], offset)

    monkeypatch.setattr(os, "pwritev", one_page_at_a_time)
    data = os.urandom(30_000)
    header = write(tier, b"short", data)
    monkeypatch.setattr(os, "pwritev", real)
    assert read(tier, header) == data


def test_temporary_files_are_removed_at_open(tmp_path: Path) -> None:
    make_tier(tmp_path)
    (tmp_path / "tmp" / "x.tmp").write_bytes(b"half")
    report = reopen(tmp_path)
    assert report.removed_temporary == 1 and not (tmp_path / "tmp" / "x.tmp").exists()


def test_buffered_fallback_is_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(NvmeTier, "_probe_direct_io", lambda self: False)
    with caplog.at_level(logging.WARNING):
        tier = make_tier(tmp_path, direct=True)
        header = write(tier, b"k", b"v" * 9000)
        assert read(tier, header) == b"v" * 9000
    assert not tier.direct_io
    assert sum("O_DIRECT is not supported" in r.message for r in caplog.records) == 1


def test_a_second_daemon_cannot_open_the_same_directory(tmp_path: Path) -> None:
    from kvtier.errors import ConfigError

    make_tier(tmp_path)
    with pytest.raises(ConfigError, match="in use by another kvtier daemon"):
        NvmeTier(tmp_path, 1 << 30, direct_io=True, sync_writes=False).open()


@pytest.mark.parametrize("direct", [True, False])
def test_removed_record_files_are_recycled_for_records_of_the_same_size(
    tmp_path: Path, direct: bool
) -> None:
    tier = make_tier(tmp_path, direct)
    old = write(tier, b"old", b"a" * 70_000)
    tier.remove(old)
    [spare] = list((tmp_path / "free").iterdir())
    inode = spare.stat().st_ino
    new = write(tier, b"new", b"b" * 70_000)  # same record size: reuses the file
    assert list((tmp_path / "free").iterdir()) == []
    path = tier.record_path(new.ns_id, new.key, new.generation)
    assert path.stat().st_ino == inode and path.stat().st_size == new.record_bytes
    assert read(tier, new) == b"b" * 70_000  # every byte of the old record overwritten
    with pytest.raises(FileNotFoundError):
        read(tier, old)
    other = write(tier, b"other", b"c" * 5_000)  # another size: a new file
    assert path.stat().st_ino != tier.record_path(NS, b"other", 1).stat().st_ino
    assert read(tier, other) == b"c" * 5_000


@pytest.mark.parametrize("fault", ["nvme.pwrite=eio", "nvme.rename=eio"])
def test_a_failed_write_over_a_recycled_file_leaves_no_record_and_no_stray(
    tmp_path: Path, fault: str
) -> None:
    """The spare is written where it lies in free/, out of the pool: a write that fails
    on it must not leave a record, nor a spare holding half of one in the pool."""
    tier = make_tier(tmp_path)
    old = write(tier, b"old", b"a" * 9000)
    tier.remove(old)
    failpoints.configure(fault)
    try:
        with pytest.raises(OSError):
            write(tier, b"new", b"b" * 9000)
    finally:
        failpoints.configure("")
    with pytest.raises(FileNotFoundError):
        read(tier, header_for(b"new", b"b" * 9000))
    assert list((tmp_path / "free").iterdir()) == []
    assert list((tmp_path / "tmp").iterdir()) == []
    assert tier._free_bytes == 0
    header = write(tier, b"new", b"c" * 9000)  # a new file now: the pool is empty
    assert read(tier, header) == b"c" * 9000


def test_a_spare_left_half_written_by_a_crash_is_only_ever_a_spare(tmp_path: Path) -> None:
    """A daemon killed while overwriting a spare in free/ leaves it there, half new bytes:
    the next start must take it as a spare, never a record, and overwrite all of it."""
    tier = make_tier(tmp_path)
    template = write(tier, b"x", b"x" * 9000)
    tier.remove(template)
    [spare] = list((tmp_path / "free").iterdir())
    wanted = header_for(b"torn", b"t" * 9000)
    half = encode_header(wanted).tobytes() + b"t" * 4096  # the header and part of the payload
    with open(spare, "r+b") as f:
        f.write(half)
    tier.close()
    assert reopen(tmp_path).records == []  # not a record
    tier = make_tier(tmp_path)
    with pytest.raises(FileNotFoundError):
        read(tier, wanted)
    again = write(tier, b"again", b"g" * 9000)  # reuses the spare: every byte rewritten
    assert read(tier, again) == b"g" * 9000
    assert list((tmp_path / "free").iterdir()) == []


def test_the_recycled_pool_is_bounded_and_survives_a_restart(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    tier.free_limit_bytes = 3 * (4096 + 8192)
    headers = [write(tier, f"k{i}".encode(), bytes([i]) * 8192) for i in range(5)]
    for header in headers:
        tier.remove(header)
    spares = list((tmp_path / "free").iterdir())
    assert len(spares) == 3  # the other two were deleted
    assert reopen(tmp_path).records == []  # spares are not records
    tier = make_tier(tmp_path)
    header = write(tier, b"again", b"z" * 8192)
    assert read(tier, header) == b"z" * 8192
    assert len(list((tmp_path / "free").iterdir())) == 2


def test_remove_many_removes_each_file_and_reports_a_failed_one(tmp_path: Path) -> None:
    """The file layout's batch of evictions: each record's file goes (a read is then a
    miss), one whose removal fails is reported and still readable, one already gone is no
    error."""
    tier = make_tier(tmp_path)
    headers = [write(tier, b"k%d" % i, bytes([i]) * 9000) for i in range(5)]
    failpoints.configure("nvme.remove=eio*1")
    try:
        results = tier.remove_many([(h, 0) for h in headers[:3]])
    finally:
        failpoints.configure("")
    assert isinstance(results[0], OSError) and results[1:] == [None, None]
    assert tier.remove_many([(headers[1], 0)]) == [None]
    assert read(tier, headers[0]) == bytes([0]) * 9000
    for h in headers[1:3]:
        with pytest.raises(FileNotFoundError):
            read(tier, h)
    for i, h in enumerate(headers[3:], start=3):
        assert read(tier, h) == bytes([i]) * 9000
