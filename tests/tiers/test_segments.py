"""The segment layout (kvtier/tiers/segments.py) on real files: records survive a restart
(from footers and from scans), a torn record is never visible, a lying footer costs misses
not bytes, reclaim keeps live records, the other layout is refused; and a property test of
random put/delete/reclaim/crash sequences against a dict."""

from __future__ import annotations

import os
import struct
import tempfile
import threading
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import failpoints
from kvtier.buffers import aligned_buffer
from kvtier.errors import ConfigError, CorruptRecord
from kvtier.tiers.allocator import round_up
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for
from kvtier.tiers.segment_file import NO_LOCATION
from kvtier.tiers.segments import SegmentTier

NS = "default|m/seg"
MiB = 1 << 20


def open_tier(
    tiers: list[SegmentTier],
    root: Path,
    capacity_bytes: int = 64 * MiB,
    segment_bytes: int | None = None,
    sync_writes: bool = False,
) -> SegmentTier:
    tier = SegmentTier(root, capacity_bytes, True, sync_writes, segment_bytes=segment_bytes)
    tiers.append(tier)
    tier.open()
    return tier


def crash(tier: SegmentTier) -> None:
    """Let go of the tier as a SIGKILL would: no seal, no sync, descriptors just closed."""
    tier._closing.set()
    tier._reclaim_wake.set()
    if tier._reclaimer is not None:
        tier._reclaimer.join(10)
    for seg in list(tier._segments.values()):
        os.close(seg.fd)
    tier._segments.clear()
    NvmeTier.close(tier)


def header_for(key: bytes, data: bytes, generation: int) -> RecordHeader:
    return RecordHeader(
        NS, key, generation, len(data), xxhash.xxh3_64_intdigest(data), header_size_for(NS, key)
    )


def put(tier: SegmentTier, key: bytes, data: bytes, generation: int) -> RecordHeader:
    header = header_for(key, data, generation)
    buf = aligned_buffer(round_up(len(data), 4096))
    buf[: len(data)] = data
    assert tier.write(header, [memoryview(buf)[: round_up(len(data), 4096)]]) == (
        header.record_bytes
    )
    return header


def get(tier: SegmentTier, header: RecordHeader) -> bytes:
    buf, offset = tier.read(header)
    return bytes(buf[offset : offset + header.payload_bytes])


def recovered(tier: SegmentTier) -> dict[bytes, RecordHeader]:
    report = tier.recover()
    return {r.header.key: r.header for r in report.records}


def data_for(i: int, size: int = 20_000) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def test_records_survive_a_clean_restart_through_the_footer(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    tier = open_tier(tiers, tmp_path)
    gen = tier.first_generation
    assert gen is not None
    headers = [put(tier, b"k%d" % i, data_for(i), gen + i) for i in range(30)]
    tier.close()
    tier = SegmentTier(tmp_path, 64 * MiB, True, False)
    tiers.append(tier)
    tier.prepare()
    found = recovered(tier)
    assert found == {h.key: h for h in headers}
    for i, h in enumerate(headers):
        assert get(tier, h) == data_for(i)


def test_a_crash_keeps_every_written_record_and_no_torn_one(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    tier = open_tier(tiers, tmp_path)
    gen = tier.first_generation
    assert gen is not None
    headers = [put(tier, b"k%d" % i, data_for(i), gen + i) for i in range(5)]
    (seg_path, offset, last) = max(tier.record_locations(), key=lambda x: x[1])
    crash(tier)
    # Tear the last record: its payload's last page never reached the disk.
    with open(seg_path, "r+b") as fh:
        fh.seek(offset + last.record_bytes - 4096)
        fh.write(b"\xff" * 4096)
    tier = open_tier(tiers, tmp_path)
    keys = {loc[2].key for loc in tier.record_locations()}
    assert keys == {h.key for h in headers} - {last.key}
    for i, h in enumerate(headers):
        if h.key != last.key:
            assert get(tier, h) == data_for(i)
    with pytest.raises(FileNotFoundError):
        tier.read(last)


def test_a_footer_that_lies_costs_misses_never_bytes(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    tier = open_tier(tiers, tmp_path)
    gen = tier.first_generation
    assert gen is not None
    headers = [put(tier, b"k%d" % i, data_for(i), gen + i) for i in range(6)]
    seg_path = tier.record_locations()[0][0]
    tier.close()
    # Swap the offsets of the first two entries and fix every checksum: a footer that is
    # well formed and wrong.
    raw = bytearray(Path(seg_path).read_bytes())
    trailer_at = len(raw) - 4096
    magic, seg_id, footer_at, footer_bytes, _ = struct.unpack_from("<8sQQQQ", raw, trailer_at)
    assert magic == b"KVTSEGT1"
    first = footer_at + 12
    entry = struct.Struct("<QQQQIHHH")
    second = first + entry.size + len(NS) + len(b"k0")
    off0, off1 = struct.unpack_from("<Q", raw, first)[0], struct.unpack_from("<Q", raw, second)[0]
    struct.pack_into("<Q", raw, first, off1)
    struct.pack_into("<Q", raw, second, off0)
    end = footer_at + footer_bytes - 8
    struct.pack_into("<Q", raw, end, xxhash.xxh3_64_intdigest(bytes(raw[footer_at:end])))
    footer_xxh3 = xxhash.xxh3_64_intdigest(bytes(raw[footer_at : footer_at + footer_bytes]))
    fixed = struct.pack("<8sQQQQ", magic, seg_id, footer_at, footer_bytes, footer_xxh3)
    raw[trailer_at : trailer_at + 40] = fixed
    struct.pack_into("<Q", raw, trailer_at + 40, xxhash.xxh3_64_intdigest(fixed))
    Path(seg_path).write_bytes(bytes(raw))
    tier = open_tier(tiers, tmp_path)
    misses = 0
    for i, h in enumerate(headers):
        try:
            assert get(tier, h) == data_for(i)
        except CorruptRecord:
            misses += 1
    assert misses == 2  # the two records the footer misplaces, and only those


def test_reclaim_keeps_live_records_and_counts_write_amplification(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    tier = open_tier(tiers, tmp_path)
    gen = tier.first_generation
    assert gen is not None
    headers = [put(tier, b"k%d" % i, data_for(i, 100_000), gen + i) for i in range(100)]
    before = tier.allocated_bytes
    for h in headers[::2]:
        tier.remove(h)
    assert tier.reclaim(force=True) > 0
    assert tier.allocated_bytes < before
    assert tier.relocated_bytes > 0 and tier.write_amplification > 1.0
    for i, h in enumerate(headers):
        if i % 2:
            assert get(tier, h) == data_for(i, 100_000)
    crash(tier)
    tier = open_tier(tiers, tmp_path)
    assert {loc[2].key for loc in tier.record_locations()} == {h.key for h in headers[1::2]}


def test_writes_past_the_limit_wait_for_reclaim_not_corrupt(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    """A store that keeps within capacity_bytes (evicting, i.e. removing) never needs more
    disk than the limit: the reclaimer frees segments behind it."""
    tier = open_tier(tiers, tmp_path, capacity_bytes=64 * MiB)
    gen = tier.first_generation
    assert gen is not None
    live: list[tuple[int, RecordHeader]] = []
    used = 0
    for i in range(2000):  # ~8x the capacity written
        header = put(tier, b"k%d" % i, data_for(i, 250_000), gen + i)
        live.append((i, header))
        used += header.record_bytes
        while used > tier.capacity_bytes:
            _, old = live.pop(0)
            tier.remove(old)
            used -= old.record_bytes
        assert tier.allocated_bytes <= tier.disk_limit_bytes + tier.segment_bytes
    for i, h in live[-20:]:
        assert get(tier, h) == data_for(i, 250_000)


@pytest.mark.parametrize("how", ["remove", "tombstone"])
def test_a_removed_record_stays_removed_across_restarts(
    how: str, tiers: list[SegmentTier], tmp_path: Path
) -> None:
    """Its bytes stay in a segment another live record keeps: the tombstone must be
    carried past the start that removes the log it was written to."""
    tier = open_tier(tiers, tmp_path)
    gen = tier.first_generation
    assert gen is not None
    gone = put(tier, b"gone", data_for(1), gen)
    kept = put(tier, b"kept", data_for(2), gen + 1)
    if how == "tombstone":
        tier.tombstone(NS, gone.key, gone.generation)
    tier.remove(gone)
    for _ in range(3):
        crash(tier)
        tier = open_tier(tiers, tmp_path)
        assert {loc[2].key for loc in tier.record_locations()} == {b"kept"}
        assert get(tier, kept) == data_for(2)


def test_remove_many_is_remove_of_each_and_a_failed_one_stays(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    """A batch of evictions in one call (one tombstone write, one hold of the lock): each
    removed record stays removed across restarts and its room is counted dead, the others
    stay readable; a record whose removal fails is reported (for the caller to retry) and
    is still there, and removing one already removed is no error."""
    tier = open_tier(tiers, tmp_path)
    gen = tier.first_generation
    assert gen is not None
    headers = [put(tier, b"k%d" % i, data_for(i), gen + i) for i in range(12)]
    gone = headers[:6]
    failpoints.configure("nvme.remove=eio*1")  # the first removal of the batch fails
    try:
        results = tier.remove_many([(h, NO_LOCATION) for h in gone])
    finally:
        failpoints.configure("")
    assert isinstance(results[0], OSError) and results[1:] == [None] * 5
    assert tier.remove_many([(gone[1], NO_LOCATION)]) == [None]
    live = sum(seg.live_bytes for seg in tier._segments.values())
    assert live == sum(h.record_bytes for h in [gone[0], *headers[6:]])
    for _ in range(2):
        crash(tier)
        tier = open_tier(tiers, tmp_path)
        assert {loc[2].key for loc in tier.record_locations()} == {
            h.key for h in [gone[0], *headers[6:]]
        }
    for i, h in enumerate(headers):
        if h not in gone[1:]:
            assert get(tier, h) == data_for(i)


def test_concurrent_writers_with_group_commit(tiers: list[SegmentTier], tmp_path: Path) -> None:
    tier = open_tier(tiers, tmp_path, sync_writes=True)
    gen = tier.first_generation
    assert gen is not None
    out: dict[int, RecordHeader] = {}

    def writer(first: int) -> None:
        for i in range(first, first + 40):
            out[i] = put(tier, b"k%d" % i, data_for(i, 30_000), gen + i)

    threads = [threading.Thread(target=writer, args=(n * 1000,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    crash(tier)
    tier = open_tier(tiers, tmp_path)
    for i, h in out.items():
        assert get(tier, h) == data_for(i, 30_000)


def test_a_failed_write_seals_the_segment_and_later_records_stay_findable(
    tiers: list[SegmentTier], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tiers, tmp_path)
    gen = tier.first_generation
    assert gen is not None
    first = put(tier, b"a", data_for(1), gen)
    from kvtier.tiers import segment_core as segments

    real = segments.pwritev_all
    calls = {"n": 0}

    def failing(fd: int, iov: list[memoryview], total: int, offset: int) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(5, "Input/output error")
        real(fd, iov, total, offset)

    monkeypatch.setattr(segments, "pwritev_all", failing)
    with pytest.raises(OSError):
        put(tier, b"b", data_for(2), gen + 1)
    third = put(tier, b"c", data_for(3), gen + 2)
    crash(tier)
    monkeypatch.undo()
    tier = open_tier(tiers, tmp_path)
    assert {loc[2].key for loc in tier.record_locations()} == {b"a", b"c"}
    assert get(tier, first) == data_for(1) and get(tier, third) == data_for(3)


@pytest.mark.parametrize(
    ("mine", "other"), [(SegmentTier, NvmeTier), (NvmeTier, SegmentTier)], ids=["seg", "files"]
)
def test_a_tier_in_the_other_layout_is_refused(
    mine: type[NvmeTier], other: type[NvmeTier], tmp_path: Path
) -> None:
    first = other(tmp_path, 64 * MiB, True, False)
    first.open()
    gen = first.first_generation
    assert gen is not None
    data = data_for(0)
    header = header_for(b"k", data, gen)
    buf = aligned_buffer(round_up(len(data), 4096))
    buf[: len(data)] = data
    first.write(header, [memoryview(buf)])
    first.close()
    second = mine(tmp_path, 64 * MiB, True, False)
    with pytest.raises(ConfigError, match=r"nvme\.layout.*" + other.layout):
        second.prepare()
    second.close()


# ---- the property test ------------------------------------------------------------------
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 5), st.integers(1, 40_000)),
        st.tuples(st.just("delete"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("evict"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("reclaim"), st.just(0), st.just(0)),
        st.tuples(st.just("crash"), st.just(0), st.just(0)),
        st.tuples(st.just("restart"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_random_sequences_match_a_dict(ops: list[tuple[str, int, int]]) -> None:
    """Whatever happens, the tier after a restart holds exactly the last value written of
    every block not deleted since (writes return once visible; deletes tombstone first, as
    the store does), and reads give exactly those bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        seg = 256 << 10
        tier = SegmentTier(root, 16 * MiB, True, False, segment_bytes=seg)
        tier.open()
        model: dict[bytes, tuple[RecordHeader, bytes]] = {}
        next_gen = tier.first_generation
        assert next_gen is not None
        try:
            for op, k, size in ops:
                key = b"k%d" % k
                if op == "put":
                    data = os.urandom(size)
                    header = put(tier, key, data, next_gen)
                    next_gen += 1
                    old = model.get(key)
                    model[key] = (header, data)
                    if old is not None:  # the store removes the old record after
                        tier.remove(old[0])
                elif op == "delete":
                    old = model.pop(key, None)
                    if old is not None:
                        tier.tombstone(NS, key, old[0].generation)
                        tier.remove(old[0])
                elif op == "evict":  # the store drops it from NVMe: only `remove`
                    old = model.pop(key, None)
                    if old is not None:
                        tier.remove(old[0])
                elif op == "reclaim":
                    tier.reclaim(force=True)
                else:
                    if op == "crash":
                        crash(tier)
                    else:
                        tier.close()
                    tier = SegmentTier(root, 16 * MiB, True, False, segment_bytes=seg)
                    tier.open()
                    next_gen = tier.first_generation
                    assert next_gen is not None
                    held = {loc[2].key: loc[2] for loc in tier.record_locations()}
                    assert held == {key: h for key, (h, _) in model.items()}
                for h, data in model.values():
                    assert get(tier, h) == data
        finally:
            if tier._tombstone_fd is not None:
                tier.close()
