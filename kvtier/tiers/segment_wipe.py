"""`kvtier wipe` on the segment layout (`nvme.layout = "segments"`): a tenant's records are
overwritten in place inside the segments that hold them, and each such segment's footer is
rewritten without them (the command, the lock and the file layout: kvtier/tiers/wipe.py).

A segment mixes tenants, so it cannot simply be shredded like a record file. Per segment:
the records it lists (its footer if sealed, else the complete records a scan finds, as
recovery reads them) are split into the tenant's and the others'. Every byte of the
record area that is not one of the others' records is overwritten with zeros: the
tenant's records, and also any bytes no listing accounts for (a record whose write failed
before the segment was sealed: anyone's bytes, as the file layout's unreadable records
are). Then the footer is rewritten listing only the others' records, the rest of the old
footer (it named the tenant's keys) zeroed, and the trailer pointed at the new one, synced
in that order. A segment left with no record of anyone is shredded whole.

A crash in the middle leaves no wrong bytes, only fewer blocks: zeroed records fail their
header check (a miss), and a footer whose trailer no longer matches makes the next start
scan the segment, which stops at the first zeroed record (the others' records after it
are then not found; running the wipe again finishes it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import CorruptRecord, NotRegularFile
from kvtier.keys import tenant_of
from kvtier.tiers.allocator import round_up
from kvtier.tiers.record import ALIGN_BYTES, RecordHeader
from kvtier.tiers.safe_open import open_regular, open_subdir
from kvtier.tiers.segment_format import (
    check_segment_header,
    encode_footer,
    encode_trailer,
    footer_extent,
    read_footer,
    scan_records,
    segment_id_of,
)
from kvtier.tiers.startup import LAYOUT_DIRS

__all__ = ["SegmentWipe", "wipe_segments"]

SEGMENTS_DIR = LAYOUT_DIRS["segments"]
# Overwrite with zeros, sync and unlink one file in a directory; the bytes overwritten.
ShredFn = Callable[[int, str, bytes], int]


@dataclass(slots=True)
class SegmentWipe:
    """What a wipe of `segments/` did."""

    records: int = 0  # the tenant's records overwritten
    record_bytes: int = 0
    unreadable: int = 0  # segments (or strays) whose header fails: shredded whole
    overwritten_bytes: int = 0  # every byte overwritten with zeros
    rewritten: int = 0  # segments whose footer was rewritten
    removed: int = 0  # segments shredded whole


def wipe_segments(root_fd: int, tenant: str | None, zeros: bytes, shred: ShredFn) -> SegmentWipe:
    """Wipe `tenant`'s records (None: everyone's) from the segments under `root_fd`; the
    caller holds the tier's lock. `shred(dir_fd, name, zeros)` overwrites, syncs and
    unlinks one file, returning the bytes overwritten (wipe.py's, links refused)."""
    out = SegmentWipe()
    seg_fd = open_subdir(root_fd, SEGMENTS_DIR)
    if seg_fd is None:
        return out
    try:
        for name in sorted(os.listdir(seg_fd)):
            seg_id = segment_id_of(name)
            if seg_id is None:  # not a segment's name: nothing the daemon wrote or reads
                out.overwritten_bytes += shred(seg_fd, name, zeros)
                out.unreadable += 1
                continue
            _wipe_one(seg_fd, name, seg_id, tenant, zeros, shred, out)
        os.fsync(seg_fd)
    finally:
        os.close(seg_fd)
    return out


def _wipe_one(
    seg_fd: int,
    name: str,
    seg_id: int,
    tenant: str | None,
    zeros: bytes,
    shred: ShredFn,
    out: SegmentWipe,
) -> None:
    try:
        opened = open_regular(name, os.O_RDWR, dir_fd=seg_fd, sole=True)
    except (NotRegularFile, OSError):
        out.overwritten_bytes += shred(seg_fd, name, zeros)  # unlinked, never written
        return
    fd = opened.fd
    try:
        try:
            size_bytes = min(
                opened.info.st_size, check_segment_header(os.pread(fd, ALIGN_BYTES, 0), seg_id)
            )
        except CorruptRecord:
            size_bytes = 0
        if size_bytes < 3 * ALIGN_BYTES:  # no header, or no room for a record: anyone's bytes
            out.unreadable += 1
            close_fd, fd = fd, -1
            os.close(close_fd)
            out.overwritten_bytes += shred(seg_fd, name, zeros)
            out.removed += 1
            return
        listed = read_footer(fd, seg_id, size_bytes)
        extent = footer_extent(fd, seg_id, size_bytes) if listed is not None else None
        if listed is None or extent is None:
            scan = scan_records(fd, size_bytes)
            listed, records_end, old_footer = scan.entries, scan.tail, (scan.tail, 0)
            sealed = False
        else:
            records_end, old_footer, sealed = extent[0], extent, True
        kept = [(off, h) for off, h in listed if tenant and tenant_of(h.ns_id) != tenant]
        gone = [h for _, h in listed if not tenant or tenant_of(h.ns_id) == tenant]
        area_end = records_end if sealed else size_bytes - ALIGN_BYTES
        holes = _unlisted(kept, area_end)
        if sealed and not gone and not holes:
            return  # nothing of the tenant's, nothing of unknown owner: untouched
        out.records += len(gone)
        out.record_bytes += sum(h.record_bytes for h in gone)
        if not kept:
            os.close(fd)
            fd = -1
            out.overwritten_bytes += shred(seg_fd, name, zeros)
            out.removed += 1
            return
        for start, end in holes:
            out.overwritten_bytes += _zero(fd, start, end, zeros)
        os.fdatasync(fd)  # the tenant's bytes are gone before any footer stops naming them
        out.overwritten_bytes += _rewrite_footer(
            fd,
            seg_id,
            size_bytes,
            kept,
            records_end if sealed else _end_of(kept),
            old_footer,
            zeros,
        )
        out.rewritten += 1
    finally:
        if fd >= 0:
            os.close(fd)


def _unlisted(kept: list[tuple[int, RecordHeader]], area_end: int) -> list[tuple[int, int]]:
    """The byte ranges of the record area [page 1, area_end) no kept record covers."""
    holes = []
    cursor = ALIGN_BYTES
    for off, h in sorted(kept, key=lambda item: item[0]):
        if off > cursor:
            holes.append((cursor, off))
        cursor = max(cursor, off + h.record_bytes)
    if cursor < area_end:
        holes.append((cursor, area_end))
    return holes


def _end_of(kept: list[tuple[int, RecordHeader]]) -> int:
    return max(off + h.record_bytes for off, h in kept)


def _zero(fd: int, start: int, end: int, zeros: bytes) -> int:
    done = start
    while done < end:
        done += os.pwrite(fd, zeros[: min(len(zeros), end - done)], done)
    return end - start


def _rewrite_footer(
    fd: int,
    seg_id: int,
    size_bytes: int,
    kept: list[tuple[int, RecordHeader]],
    footer_at: int,
    old_footer: tuple[int, int],
    zeros: bytes,
) -> int:
    """A footer listing `kept` at `footer_at`, the old one's rest zeroed, then the trailer;
    synced in that order. Returns the bytes zeroed. A segment with no room for a footer
    stays unsealed (scanned at the next start)."""
    footer = encode_footer(sorted(kept, key=lambda item: item[0]))
    padded = round_up(len(footer), ALIGN_BYTES)
    trailer_at = size_bytes - ALIGN_BYTES
    if footer_at + padded > trailer_at:
        return _zero(fd, trailer_at, size_bytes, zeros)
    os.pwrite(fd, footer + bytes(padded - len(footer)), footer_at)
    zeroed = 0
    old_at, old_bytes = old_footer
    old_end = round_up(old_at + old_bytes, ALIGN_BYTES)
    if old_end > footer_at + padded:
        zeroed += _zero(fd, footer_at + padded, min(old_end, trailer_at), zeros)
    os.fdatasync(fd)  # the footer before the trailer that points at it
    fixed = encode_trailer(seg_id, footer_at, footer)
    os.pwrite(fd, fixed + bytes(ALIGN_BYTES - len(fixed)), trailer_at)
    os.fdatasync(fd)
    return zeroed
