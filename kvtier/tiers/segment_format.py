"""The on-disk format of an NVMe segment file (the segment layout, kvtier/tiers/segments.py):
its name, header page, footer and trailer — encoded, decoded and checked — and the scan that
finds the complete records of a segment without a valid trailer.

A segment is `segments/<id:016x>.kvs`:

    page 0               segment header: magic "KVTSEG01" | version u16 | 6 zero bytes |
                         segment id u64 | segment bytes u64 | xxh3 of those 32 bytes
    pages 1..            records, each a whole number of pages, back to back
    after the records    the footer, once sealed: magic "KVTSEGF1" | count u32 | entries
                         (offset u64, generation u64, payload u64, xxh3 u64, header u32,
                         codec u16, ns_len u16, key_len u16, namespace, key) | xxh3 u64
    last page            the trailer: magic "KVTSEGT1" | segment id u64 | footer offset u64 |
                         footer bytes u64 | footer xxh3 u64 | xxh3 of those 40 bytes

Each record is the checksummed record of kvtier/tiers/record.py. Format only, as record.py
is for records: bytes in, bytes out; the reads (`read_footer`, `scan_records`) are preads of
a descriptor the caller opened, and nothing here writes. When a footer and its trailer are
written and synced, and what keeps a torn record invisible, is segments.py's.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.errors import CorruptRecord
from kvtier.tiers.record import ALIGN_BYTES, RecordHeader, decode_header, verify_record

__all__ = [
    "EMPTY_FOOTER_BYTES",
    "SEGMENT_SUFFIX",
    "SegmentScan",
    "check_segment_header",
    "encode_footer",
    "encode_segment_header",
    "encode_trailer",
    "entry_bytes",
    "footer_extent",
    "read_footer",
    "scan_records",
    "segment_id_of",
    "segment_name",
]

SEGMENT_SUFFIX = ".kvs"
_NAME = re.compile(r"^([0-9a-f]{16})\.kvs$")
_SEG_MAGIC, _FOOTER_MAGIC, _TRAILER_MAGIC = b"KVTSEG01", b"KVTSEGF1", b"KVTSEGT1"
_SEG_VERSION = 1
_SEG_HEAD = struct.Struct("<8sH6xQQ")
_TRAILER = struct.Struct("<8sQQQQ")
_FOOTER_HEAD = struct.Struct("<8sI")
_ENTRY = struct.Struct("<QQQQIHHH")
_XXH3 = struct.Struct("<Q")
EMPTY_FOOTER_BYTES = _FOOTER_HEAD.size + _XXH3.size  # a footer that lists no record


@dataclass(frozen=True, slots=True)
class SegmentScan:
    """What `scan_records` found: the complete records (offset, header) in order, and the
    offset where they end (the first torn or damaged record, or the last page)."""

    entries: list[tuple[int, RecordHeader]]
    tail: int


def segment_name(seg_id: int) -> str:
    """The file name of segment `seg_id` in `segments/`."""
    return f"{seg_id:016x}{SEGMENT_SUFFIX}"


def segment_id_of(name: str) -> int | None:
    """The segment id a file name in `segments/` gives; None if it is not a segment's."""
    match = _NAME.match(name)
    return None if match is None else int(match.group(1), 16)


def entry_bytes(header: RecordHeader) -> int:
    """What listing the record `header` describes adds to a footer."""
    return _ENTRY.size + len(header.ns_id.encode()) + len(header.key)


def encode_segment_header(seg_id: int, size_bytes: int) -> bytes:
    """The start of page 0 of a new segment (the rest of the page is zero)."""
    fixed = _SEG_HEAD.pack(_SEG_MAGIC, _SEG_VERSION, seg_id, size_bytes)
    return fixed + _XXH3.pack(xxhash.xxh3_64_intdigest(fixed))


def check_segment_header(head: bytes, seg_id: int) -> int:
    """The size a segment's header (`head`: its page 0, as read) gives; CorruptRecord, with
    why, if it is short, fails its checksum or names another segment or version."""
    if len(head) < _SEG_HEAD.size + _XXH3.size:
        raise CorruptRecord("shorter than a segment header")
    magic, version, stored_id, size_bytes = _SEG_HEAD.unpack_from(head)
    (digest,) = _XXH3.unpack_from(head, _SEG_HEAD.size)
    if (
        magic != _SEG_MAGIC
        or digest != xxhash.xxh3_64_intdigest(head[: _SEG_HEAD.size])
        or version != _SEG_VERSION
        or stored_id != seg_id
    ):
        raise CorruptRecord("bad segment header")
    return int(size_bytes)


def encode_footer(entries: Sequence[tuple[int, RecordHeader]]) -> bytes:
    """The footer listing `entries` (offset, header), its xxh3 last."""
    parts = [_FOOTER_HEAD.pack(_FOOTER_MAGIC, len(entries))]
    for off, h in entries:
        ns = h.ns_id.encode()
        parts.append(
            _ENTRY.pack(
                off,
                h.generation,
                h.payload_bytes,
                h.xxh3_64,
                h.header_bytes,
                h.codec,
                len(ns),
                len(h.key),
            )
        )
        parts.append(ns + h.key)
    body = b"".join(parts)
    return body + _XXH3.pack(xxhash.xxh3_64_intdigest(body))


def encode_trailer(seg_id: int, footer_at: int, footer: bytes) -> bytes:
    """The start of a segment's last page: where its `footer` lies, and the footer's xxh3."""
    fixed = _TRAILER.pack(
        _TRAILER_MAGIC, seg_id, footer_at, len(footer), xxhash.xxh3_64_intdigest(footer)
    )
    return fixed + _XXH3.pack(xxhash.xxh3_64_intdigest(fixed))


def read_footer(fd: int, seg_id: int, size_bytes: int) -> list[tuple[int, RecordHeader]] | None:
    """A sealed segment's records from its footer; None if its trailer or footer fails
    its checksum (the segment is then scanned)."""
    trailer = _trailer(fd, seg_id, size_bytes)
    if trailer is None:
        return None
    footer_at, footer_bytes, footer_xxh3 = trailer
    footer = os.pread(fd, footer_bytes, footer_at)
    if len(footer) != footer_bytes or xxhash.xxh3_64_intdigest(footer) != footer_xxh3:
        return None
    end = footer_bytes - _XXH3.size
    (stored,) = _XXH3.unpack_from(footer, end)
    if stored != xxhash.xxh3_64_intdigest(footer[:end]):
        return None
    magic, count = _FOOTER_HEAD.unpack_from(footer, 0)
    if magic != _FOOTER_MAGIC:
        return None
    out: list[tuple[int, RecordHeader]] = []
    pos = _FOOTER_HEAD.size
    try:
        for _ in range(count):
            off, gen, payload, xxh3_64, header_bytes, codec, ns_len, key_len = _ENTRY.unpack_from(
                footer, pos
            )
            pos += _ENTRY.size
            ns_id = footer[pos : pos + ns_len].decode()
            key = footer[pos + ns_len : pos + ns_len + key_len]
            pos += ns_len + key_len
            header = RecordHeader(ns_id, key, gen, payload, xxh3_64, header_bytes, codec)
            # Offsets are checked against the segment only; the record's own header is
            # checked on every read, so a footer that lies about one is a miss.
            if off % ALIGN_BYTES or off + header.record_bytes > footer_at:
                continue
            out.append((off, header))
    except (struct.error, UnicodeDecodeError):
        return None
    return out


def footer_extent(fd: int, seg_id: int, size_bytes: int) -> tuple[int, int] | None:
    """Where a sealed segment's footer lies (offset, bytes) by its trailer; None if the
    trailer fails its checks (the footer itself is not read: `read_footer` checks it)."""
    trailer = _trailer(fd, seg_id, size_bytes)
    return None if trailer is None else (trailer[0], trailer[1])


def _trailer(fd: int, seg_id: int, size_bytes: int) -> tuple[int, int, int] | None:
    """The trailer's (footer offset, footer bytes, footer xxh3) if it verifies."""
    tail = os.pread(fd, ALIGN_BYTES, size_bytes - ALIGN_BYTES)
    if len(tail) < _TRAILER.size + _XXH3.size:
        return None
    fixed = tail[: _TRAILER.size]
    (digest,) = _XXH3.unpack_from(tail, _TRAILER.size)
    magic, stored_id, footer_at, footer_bytes, footer_xxh3 = _TRAILER.unpack(fixed)
    if magic != _TRAILER_MAGIC or digest != xxhash.xxh3_64_intdigest(fixed):
        return None
    if stored_id != seg_id or footer_at + footer_bytes > size_bytes - ALIGN_BYTES:
        return None
    return int(footer_at), int(footer_bytes), int(footer_xxh3)


def scan_records(fd: int, size_bytes: int) -> SegmentScan:
    """Complete records from page 1 on, up to the first torn or damaged one."""
    entries: list[tuple[int, RecordHeader]] = []
    pos = ALIGN_BYTES
    while pos + ALIGN_BYTES <= size_bytes:
        try:
            head = os.pread(fd, ALIGN_BYTES, pos)
            header = decode_header(head + _rest_of_header(fd, head, pos))
            if pos + header.record_bytes > size_bytes - ALIGN_BYTES:
                break
            data = os.pread(fd, header.record_bytes, pos)
            if len(data) != header.record_bytes:
                break
            view = memoryview(data)
            verify_record(view[: header.header_bytes], view[header.header_bytes :], header, None)
        except CorruptRecord:
            break
        entries.append((pos, header))
        pos += header.record_bytes
    return SegmentScan(entries, pos)


def _rest_of_header(fd: int, first_page: bytes, pos: int) -> bytes:
    """The rest of a header region longer than a page (long keys)."""
    if len(first_page) < 24:
        return b""
    header_bytes = struct.unpack_from("<I", first_page, 12)[0]
    if ALIGN_BYTES < header_bytes <= 64 << 10:
        return os.pread(fd, header_bytes - ALIGN_BYTES, pos + ALIGN_BYTES)
    return b""
