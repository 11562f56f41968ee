"""`kvtier wipe` on the segment layout: a tenant's records are zeroed inside the segments
they share with other tenants, the footers rewritten without them (a footer of many pages
included, and a segment recovery would have to scan), everyone else's served bit-exact."""

from __future__ import annotations

from pathlib import Path

from kvtier.tiers.record import ALIGN_BYTES
from kvtier.tiers.segments import SegmentTier
from kvtier.tiers.wipe import wipe
from tests.tiers.test_segments import open_tier as segment_tier
from tests.tiers.test_wipe import block, everything_under, write

ALICE, BOB = "alice|llama3-8b/bf16", "bob|llama3-8b/bf16"
MiB = 1 << 20


def open_tier(tiers: list[SegmentTier], root: Path) -> SegmentTier:
    return segment_tier(tiers, root, 64 * MiB, segment_bytes=4 * MiB)


def fill(tiers: list[SegmentTier], root: Path, alices: int) -> dict[bytes, bytes]:
    """`alices` one-page records of alice with one of bob's after every tenth, in shared
    segments, sealed by a clean close; bob's blocks (key -> bytes)."""
    tier = open_tier(tiers, root)
    generation = tier.first_generation
    assert generation is not None
    bob: dict[bytes, bytes] = {}
    for i in range(alices):
        write(tier, ALICE, f"alice-key-{i}".encode(), block("alice", i, 300), generation)
        generation += 1
        if i % 10 == 9:
            key = f"b{i}".encode()
            bob[key] = block("bob", i, 5000)
            write(tier, BOB, key, bob[key], generation)
            generation += 1
    tier.close()
    return bob


def served(tiers: list[SegmentTier], root: Path) -> dict[bytes, bytes]:
    tier = open_tier(tiers, root)
    out = {}
    for loc in tier.recover().records:
        h = loc.header
        buf, offset = tier.read(h)
        out[h.key] = bytes(buf[offset : offset + h.payload_bytes])
        assert h.ns_id == BOB
    return out


def test_a_tenant_is_zeroed_inside_shared_segments_and_the_others_stay(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    # 600 of alice's keys: their footer entries take several pages, so the rewritten
    # footer (bob's 60) is pages shorter and the old one's rest must be zeroed too.
    bob = fill(tiers, tmp_path, 600)
    on_disk = everything_under(tmp_path)
    assert b"<alice-block-" in on_disk and b"alice-key-" in on_disk
    report = wipe(tmp_path, "alice")
    assert report.records == 600 and report.unreadable_records == 0
    assert report.record_bytes == 600 * 2 * ALIGN_BYTES  # header page + payload page
    assert report.segments_rewritten >= 2  # 5.5 MiB of records: two 4 MiB segments
    on_disk = everything_under(tmp_path)
    assert b"<alice-block-" not in on_disk and b"alice-key-" not in on_disk
    assert b"alice|" not in on_disk
    assert on_disk.count(b"<bob-block-") >= len(bob)
    assert served(tiers, tmp_path) == bob


def test_a_segment_recovery_would_scan_is_wiped_and_sealed_again(
    tiers: list[SegmentTier], tmp_path: Path
) -> None:
    bob = fill(tiers, tmp_path, 60)
    segments = sorted((tmp_path / "segments").glob("*.kvs"))
    assert segments
    for path in segments:  # as a crash before the trailer: no footer can be trusted
        with open(path, "r+b") as fh:
            fh.seek(path.stat().st_size - ALIGN_BYTES)
            fh.write(bytes(ALIGN_BYTES))
    report = wipe(tmp_path, "alice")
    assert report.records == 60 and report.segments_rewritten == len(segments)
    assert b"<alice-block-" not in everything_under(tmp_path)
    # Sealed again: found through a trailer, not a scan (a scan would stop at the first
    # zeroed record of alice's and lose bob's records after it).
    assert served(tiers, tmp_path) == bob


def test_wiping_every_tenant_removes_the_segments(tiers: list[SegmentTier], tmp_path: Path) -> None:
    fill(tiers, tmp_path, 30)
    report = wipe(tmp_path, None)
    assert report.records == 33  # alice's 30 and bob's 3
    assert report.overwritten_bytes >= report.record_bytes == 33 * 2 * ALIGN_BYTES + 3 * 4096
    assert list((tmp_path / "segments").iterdir()) == []
    assert served(tiers, tmp_path) == {}


def test_a_segment_with_a_bad_header_is_shredded(tiers: list[SegmentTier], tmp_path: Path) -> None:
    bob = fill(tiers, tmp_path, 10)
    stray = tmp_path / "segments" / f"{0xFFFF:016x}.kvs"
    stray.write_bytes(b"<alice-block-junk>" * 1000)
    report = wipe(tmp_path, "alice")
    assert report.unreadable_records == 1
    assert not stray.exists() and b"<alice-block-" not in everything_under(tmp_path)
    assert served(tiers, tmp_path) == bob
