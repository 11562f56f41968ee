"""The segment layout with an owner (kvtier/tiers/segments.py, issue 22): the tier keeps no
Python object per record, the owner keeps each record's location (as the daemon's catalog
does in a column), reclaim asks the owner which records are live and publishes their
moves, and a stale or lying location is a miss, never wrong bytes. Real files; the owner
here is a dict standing in for the catalog."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.errors import CorruptRecord
from kvtier.tiers.allocator import round_up
from kvtier.tiers.record import RecordHeader, header_size_for
from kvtier.tiers.segment_file import pack_location, unpack_location
from kvtier.tiers.segments import SegmentTier

NS = "default|m/owner"
MiB = 1 << 20
SEG_BYTES = 1 * MiB


class DictOwner:
    """What the catalog answers: (namespace, key, generation) -> location."""

    def __init__(self) -> None:
        self.at: dict[tuple[str, bytes, int], int] = {}
        self.refuse_moves = False
        self.asked = 0

    def live(self, headers: Sequence[RecordHeader], locations: Sequence[int]) -> list[bool]:
        self.asked += len(headers)
        return [
            self.at.get((h.ns_id, h.key, h.generation)) == loc
            for h, loc in zip(headers, locations, strict=True)
        ]

    def moved(
        self, headers: Sequence[RecordHeader], old: Sequence[int], new: Sequence[int]
    ) -> list[bool]:
        out = []
        for h, o, n in zip(headers, old, new, strict=True):
            rid = (h.ns_id, h.key, h.generation)
            took = not self.refuse_moves and self.at.get(rid) == o
            if took:
                self.at[rid] = n
            out.append(took)
        return out


def owned_tier(tiers: list[SegmentTier], root: Path, owner: DictOwner) -> SegmentTier:
    tier = SegmentTier(root, 64 * MiB, True, False, segment_bytes=SEG_BYTES)
    tiers.append(tier)
    tier.prepare()
    tier.attach_owner(owner)
    for fan in tier.recover().records:
        h = fan.header
        owner.at[(h.ns_id, h.key, h.generation)] = fan.location
    tier.owner_ready()
    tier.compact_tombstones()
    return tier


def data_for(i: int, size: int = 50_000) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def put(tier: SegmentTier, owner: DictOwner, key: bytes, data: bytes, gen: int) -> RecordHeader:
    header = RecordHeader(
        NS, key, gen, len(data), xxhash.xxh3_64_intdigest(data), header_size_for(NS, key)
    )
    buf = aligned_buffer(round_up(len(data), 4096))
    buf[: len(data)] = data
    placed = tier.write_placed(header, [memoryview(buf)])
    assert placed.record_bytes == header.record_bytes and placed.location
    owner.at[(NS, key, gen)] = placed.location
    tier.settle(placed.location)
    return header


def get(tier: SegmentTier, owner: DictOwner, header: RecordHeader) -> bytes:
    location = owner.at[(header.ns_id, header.key, header.generation)]
    buf, offset = tier.read(header, location)
    return bytes(buf[offset : offset + header.payload_bytes])


def test_the_tier_keeps_nothing_per_record_and_reads_by_location(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    owner = DictOwner()
    tier = owned_tier(tiers, tmp_path, owner)
    gen = tier.first_generation
    assert gen is not None
    headers = [put(tier, owner, b"k%d" % i, data_for(i), gen + i) for i in range(60)]
    assert tier._placed == {}  # the locations are the owner's
    assert sum(s.live_count for s in tier._segments.values()) == 60
    for i, h in enumerate(headers):
        assert get(tier, owner, h) == data_for(i)
    with pytest.raises(FileNotFoundError):  # no location, none of the tier's own
        tier.read(headers[0])


def test_a_stale_or_lying_location_is_a_miss_never_bytes(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    owner = DictOwner()
    tier = owned_tier(tiers, tmp_path, owner)
    gen = tier.first_generation
    assert gen is not None
    a = put(tier, owner, b"a", data_for(1), gen)
    b = put(tier, owner, b"b", data_for(2), gen + 1)
    loc_b = owner.at[(NS, b"b", b.generation)]
    with pytest.raises(CorruptRecord):  # a's header, b's place: b's header does not match
        tier.read(a, loc_b)
    seg_id, offset = unpack_location(loc_b)
    with pytest.raises(CorruptRecord):  # inside the segment, between records
        tier.read(a, pack_location(seg_id, offset + 4096))
    with pytest.raises(CorruptRecord):  # past the segment's end
        tier.read(a, pack_location(seg_id, 10 * SEG_BYTES))
    with pytest.raises(FileNotFoundError):  # a segment that does not exist
        tier.read(a, pack_location(seg_id + 1000, offset))
    assert get(tier, owner, a) == data_for(1)


def test_reclaim_asks_the_owner_moves_live_records_and_publishes_them(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    owner = DictOwner()
    tier = owned_tier(tiers, tmp_path, owner)
    gen = tier.first_generation
    assert gen is not None
    headers = [put(tier, owner, b"k%d" % i, data_for(i), gen + i) for i in range(80)]
    before = dict(owner.at)
    for h in headers[::2]:
        rid = (NS, h.key, h.generation)
        tier.remove(h, owner.at.pop(rid))
    assert tier.reclaim(force=True) > 0
    assert owner.asked > 0 and tier.relocated_bytes > 0
    moved = [rid for rid, loc in owner.at.items() if before[rid] != loc]
    assert moved  # the owner was told the new places
    for i, h in enumerate(headers):
        if i % 2:
            assert get(tier, owner, h) == data_for(i)
    # A read that took an old location just before the move still gets the right bytes
    # (the deleted segment's descriptor outlives it a few seconds) ...
    old_h = next(h for h in headers if (NS, h.key, h.generation) == moved[0])
    old_buf, off = tier.read(old_h, before[moved[0]])
    assert bytes(old_buf[off : off + old_h.payload_bytes]) == bytes(
        data_for(int(old_h.key[1:].decode()))
    )
    # ... and once it is closed such a location is a miss.
    tier._close_retired(now_s=float("inf"))
    with pytest.raises(FileNotFoundError):
        tier.read(old_h, before[moved[0]])
    # After a crash-free restart the owner learns the same records again.
    tier.close()
    owner2 = DictOwner()
    tier = owned_tier(tiers, tmp_path, owner2)
    assert {k for (_, k, _) in owner2.at} == {h.key for h in headers[1::2]}
    for i, h in enumerate(headers):
        if i % 2:
            assert get(tier, owner2, h) == data_for(i)


def test_counts_that_say_empty_do_not_delete_what_the_owner_holds(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    """A removal told for a record the owner still holds (a retry, a stale location): the
    segment looks empty to the counts, but reclaim asks first and keeps the record."""
    owner = DictOwner()
    tier = owned_tier(tiers, tmp_path, owner)
    gen = tier.first_generation
    assert gen is not None
    h = put(tier, owner, b"held", data_for(7), gen)
    loc = owner.at[(NS, b"held", gen)]
    seg = tier._segments[unpack_location(loc)[0]]
    tier._rotate(seg, 4096, 4096, relocating=False)  # seal it: reclaim only takes sealed ones
    # The same removal told twice by mistake, without a tombstone meaning it (counts only).
    with tier._mu:
        tier._count_dead_locked(loc, h.record_bytes)
    assert seg.live_count == 0
    tier.reclaim(force=True)
    assert unpack_location(owner.at[(NS, b"held", gen)])[0] != seg.seg_id  # moved, not lost
    assert get(tier, owner, h) == data_for(7)


def test_a_move_the_owner_refuses_leaves_the_copy_dead(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    """Removed while reclaim copied it: the owner refuses the move, the copy counts dead
    where it landed (and is not found through the owner)."""
    owner = DictOwner()
    tier = owned_tier(tiers, tmp_path, owner)
    gen = tier.first_generation
    assert gen is not None
    headers = [put(tier, owner, b"k%d" % i, data_for(i), gen + i) for i in range(40)]
    tier.remove(headers[0], owner.at.pop((NS, headers[0].key, gen)))
    owner.refuse_moves = True
    locations = dict(owner.at)
    tier.reclaim(force=True)
    assert owner.at == locations and tier.relocated_bytes > 0  # copied, nothing moved
    live_after = sum(s.live_count for s in tier._segments.values())
    # The originals went with their segment and their copies count dead: only the records
    # of segments not reclaimed count live.
    kept = sum(1 for loc in owner.at.values() if unpack_location(loc)[0] in tier._segments)
    assert kept < len(owner.at) and live_after == kept


def test_reclaim_waits_for_the_owner_to_hold_every_recovered_record(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    owner = DictOwner()
    tier = owned_tier(tiers, tmp_path, owner)
    gen = tier.first_generation
    assert gen is not None
    headers = [put(tier, owner, b"k%d" % i, data_for(i), gen + i) for i in range(40)]
    tier.close()
    late = DictOwner()  # knows nothing yet: as a catalog still filling
    tier = SegmentTier(tmp_path, 64 * MiB, True, False, segment_bytes=SEG_BYTES)
    tiers.append(tier)
    tier.prepare()
    tier.attach_owner(late)
    report = tier.recover()
    assert tier._placed == {} and all(r.location for r in report.records)
    for r in report.records:
        if r.header.key != b"k0":
            continue
        tier.remove(r.header, r.location)  # a dead byte: the segment is a candidate
        headers = headers[1:]
    # Before the owner holds them all, reclaim would delete every record it lacks.
    assert tier.reclaim(force=True) == 0
    for r in report.records:
        if r.header.key != b"k0":
            late.at[(r.header.ns_id, r.header.key, r.header.generation)] = r.location
    tier.owner_ready()
    assert tier.reclaim(force=True) > 0
    for i, h in enumerate(headers, start=1):
        assert get(tier, late, h) == data_for(i)
