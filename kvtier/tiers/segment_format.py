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

import mmap
import os
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.errors import CorruptRecord
from kvtier.tiers.allocator import round_up
from kvtier.tiers.record import ALIGN_BYTES, RecordHeader, decode_header, verify_record

__all__ = [
    "EMPTY_FOOTER_BYTES",
    "SEGMENT_SUFFIX",
    "FooterColumns",
    "SegmentScan",
    "check_segment_header",
    "columns_of_entries",
    "encode_footer",
    "encode_footer_entry",
    "encode_segment_header",
    "encode_trailer",
    "entry_bytes",
    "footer_extent",
    "footer_of",
    "read_footer",
    "read_footer_columns",
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
# Rows that recovery's numpy and tolist calls take at once (`values_of`): each holds the
# GIL ~0.3 ms, so the event loop beside them waits no more than a switch interval.
ROWS_A_CALL = 8192
RUN_WINDOW = 64  # entries compared at first for the end of a run (`_run_columns`)
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
    return footer_of([encode_footer_entry(off, h) for off, h in entries])


def encode_footer_entry(offset: int, h: RecordHeader) -> bytes:
    """One record's entry in a footer (`entry_bytes(h)` long). The write path encodes it
    when the record's extent is reserved: bytes are not objects the garbage collector
    walks, where a segment's worth of headers kept for its seal were (2 a record)."""
    ns = h.ns_id.encode()
    return (
        _ENTRY.pack(
            offset,
            h.generation,
            h.payload_bytes,
            h.xxh3_64,
            h.header_bytes,
            h.codec,
            len(ns),
            len(h.key),
        )
        + ns
        + h.key
    )


def footer_of(entries: Sequence[bytes]) -> bytes:
    """The footer listing the encoded `entries` (`encode_footer_entry`), its xxh3 last."""
    body = _FOOTER_HEAD.pack(_FOOTER_MAGIC, len(entries)) + b"".join(entries)
    return body + _XXH3.pack(xxhash.xxh3_64_intdigest(body))


# A seal joins this many footer entries at a time into its buffer: C speed (a Python loop
# over 32 k entries held the GIL ~10 ms against the event loop's turns), with a join
# small enough (~300 KiB) to leave no large free block in the sealing thread's arena.
_FOOTER_JOIN_ENTRIES = 4096


def footer_into(
    entries: Sequence[bytes], join_entries: int = _FOOTER_JOIN_ENTRIES
) -> tuple[mmap.mmap, int]:
    """`footer_of(entries)` written straight into a page-aligned buffer (what the seal's
    O_DIRECT write needs), and its length; `join_entries` entries joined at a time. No
    bytes object the size of the footer is made: a seal ran on an I/O thread, and the
    joined copies (~3 x 2.3 MiB at 32 k records) stayed resident as that thread's malloc
    arena top once freed (the daemon's trim threshold is 1 GiB, and malloc_trim does not
    shrink a thread arena's top): ~7 MiB for every I/O thread that ever sealed a segment."""
    body = _FOOTER_HEAD.size + sum(map(len, entries))
    size = body + _XXH3.size
    buf = aligned_buffer(round_up(size, ALIGN_BYTES))
    _FOOTER_HEAD.pack_into(buf, 0, _FOOTER_MAGIC, len(entries))
    pos = _FOOTER_HEAD.size
    with memoryview(buf) as view:
        for i in range(0, len(entries), join_entries):
            part = b"".join(entries[i : i + join_entries])
            view[pos : pos + len(part)] = part
            pos += len(part)
        digest = xxhash.xxh3_64_intdigest(view[:body])
    _XXH3.pack_into(buf, body, digest)
    return buf, size


def encode_trailer(seg_id: int, footer_at: int, footer: bytes | memoryview) -> bytes:
    """The start of a segment's last page: where its `footer` lies, and the footer's xxh3."""
    fixed = _TRAILER.pack(
        _TRAILER_MAGIC, seg_id, footer_at, len(footer), xxhash.xxh3_64_intdigest(footer)
    )
    return fixed + _XXH3.pack(xxhash.xxh3_64_intdigest(fixed))


def read_footer(fd: int, seg_id: int, size_bytes: int) -> list[tuple[int, RecordHeader]] | None:
    """A sealed segment's records from its footer; None if its trailer or footer fails
    its checksum (the segment is then scanned)."""
    checked = _checked_footer(fd, seg_id, size_bytes)
    if checked is None:
        return None
    footer, footer_at, count = checked
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


def _checked_footer(fd: int, seg_id: int, size_bytes: int) -> tuple[bytes, int, int] | None:
    """A sealed segment's footer bytes, where it lies and its entry count, once the
    trailer, both checksums and the magic verify; else None."""
    trailer = _trailer(fd, seg_id, size_bytes)
    if trailer is None:
        return None
    footer_at, footer_bytes, footer_xxh3 = trailer
    footer = os.pread(fd, footer_bytes, footer_at)
    if len(footer) != footer_bytes or xxhash.xxh3_64_intdigest(footer) != footer_xxh3:
        return None
    end = footer_bytes - _XXH3.size
    (stored,) = _XXH3.unpack_from(footer, end)
    # Hashed through a view: `footer[:end]` copied the footer (MBs at 32 k records a
    # segment, 0.1-1.7 ms with the GIL held, on a loader thread beside the event loop).
    if stored != xxhash.xxh3_64_intdigest(memoryview(footer)[:end]):
        return None
    magic, count = _FOOTER_HEAD.unpack_from(footer, 0)
    if magic != _FOOTER_MAGIC:
        return None
    return footer, footer_at, count


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


# ---- footers as columns (recovery at scale, issue 22) ------------------------------------
_ENTRY_FIELDS = ("off", "gen", "payload", "xxh3", "header", "codec", "ns_len", "key_len")
_ENTRY_FORMATS = ("<u8", "<u8", "<u8", "<u8", "<u4", "<u2", "<u2", "<u2")
_ENTRY_OFFSETS = (0, 8, 16, 24, 32, 36, 38, 40)


@dataclass(frozen=True, slots=True)
class FooterColumns:
    """A segment's records as columns (numpy, one element a record) instead of a header
    object each: the fixed fields, the namespace as an index into `ns_names`, and the key
    as (offset, length) in `blob` (the footer's own bytes, or the keys of a scan joined).
    Only records whose offset is page-aligned and inside the segment's records are kept,
    as `read_footer` keeps them."""

    offset: np.ndarray  # uint64
    generation: np.ndarray  # uint64
    payload_bytes: np.ndarray  # uint64
    xxh3_64: np.ndarray  # uint64
    header_bytes: np.ndarray  # uint64
    codec: np.ndarray  # uint16
    ns: np.ndarray  # uint32, into ns_names
    key_off: np.ndarray  # int64, into blob
    key_len: np.ndarray  # int64
    ns_names: list[str]
    blob: bytes

    def __len__(self) -> int:
        return len(self.offset)

    @property
    def record_bytes(self) -> np.ndarray:
        page = np.uint64(ALIGN_BYTES)
        out: np.ndarray = self.header_bytes + (self.payload_bytes + (page - 1)) // page * page
        return out

    def key(self, i: int) -> bytes:
        off = int(self.key_off[i])
        return self.blob[off : off + int(self.key_len[i])]

    def header(self, i: int) -> RecordHeader:
        return RecordHeader(
            self.ns_names[int(self.ns[i])],
            self.key(i),
            int(self.generation[i]),
            int(self.payload_bytes[i]),
            int(self.xxh3_64[i]),
            int(self.header_bytes[i]),
            int(self.codec[i]),
        )


def columns_of_entries(entries: Sequence[tuple[int, RecordHeader]]) -> FooterColumns:
    """The columns of (offset, header) pairs (a scanned segment's records)."""
    names: dict[str, int] = {}
    ns = [names.setdefault(h.ns_id, len(names)) for _, h in entries]
    lens = [len(h.key) for _, h in entries]
    key_off = np.zeros(len(entries), np.int64)
    if entries:
        key_off[1:] = np.cumsum(lens[:-1])

    def col(values: list[int], dtype: type[np.generic]) -> np.ndarray:
        return np.array(values, dtype=dtype)

    return FooterColumns(
        offset=col([off for off, _ in entries], np.uint64),
        generation=col([h.generation for _, h in entries], np.uint64),
        payload_bytes=col([h.payload_bytes for _, h in entries], np.uint64),
        xxh3_64=col([h.xxh3_64 for _, h in entries], np.uint64),
        header_bytes=col([h.header_bytes for _, h in entries], np.uint64),
        codec=col([h.codec for _, h in entries], np.uint16),
        ns=col(ns, np.uint32),
        key_off=key_off,
        key_len=col(lens, np.int64),
        ns_names=list(names),
        blob=b"".join(h.key for _, h in entries),
    )


def read_footer_columns(fd: int, seg_id: int, size_bytes: int) -> FooterColumns | None:
    """`read_footer` as columns: the same checks, the same records kept, no object per
    record (entries of one key and namespace length, an engine's fixed-size hashes, are
    read as strided numpy views, a run at a time: `_run_columns`)."""
    checked = _checked_footer(fd, seg_id, size_bytes)
    if checked is None:
        return None
    footer, footer_at, count = checked
    cols = _run_columns(footer, count)
    if cols is None:
        return None
    fields, ns_off, ns_len, key_off = cols
    key_len = fields["key_len"].astype(np.int64)
    # Namespaces: compared as bytes, one decode per distinct one (a footer holds a few);
    # as read_footer's decode, one that is not UTF-8 refuses the footer.
    raw_ns: list[bytes] = []
    ns = _ns_index(footer, ns_off, ns_len, raw_ns)
    try:
        ns_names = [b.decode() for b in raw_ns]
    except UnicodeDecodeError:
        return None
    record = fields["header"].astype(np.uint64) + (
        (fields["payload"] + np.uint64(ALIGN_BYTES - 1)) // np.uint64(ALIGN_BYTES)
    ) * np.uint64(ALIGN_BYTES)
    off = fields["off"]
    keep = (off % np.uint64(ALIGN_BYTES) == 0) & (off + record <= np.uint64(footer_at))
    return FooterColumns(
        offset=off[keep],
        generation=fields["gen"][keep],
        payload_bytes=fields["payload"][keep],
        xxh3_64=fields["xxh3"][keep],
        header_bytes=fields["header"].astype(np.uint64)[keep],
        codec=fields["codec"][keep],
        ns=ns[keep],
        key_off=key_off[keep],
        key_len=key_len[keep],
        ns_names=ns_names,
        blob=footer,
    )


_Cols = tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]


def row_slices(rows: int) -> Iterator[slice]:
    """[0, rows) as slices of ROWS_A_CALL: one numpy or `tolist()` call over a million
    values holds the GIL tens of ms, and recovery's threads run beside the event loop
    (which then waits for the GIL that long)."""
    for lo in range(0, rows, ROWS_A_CALL):
        yield slice(lo, min(lo + ROWS_A_CALL, rows))


def values_of(*columns: np.ndarray) -> Iterator[tuple[int, ...]]:
    """`zip(*(c.tolist() for c in columns))`, a `row_slices` slice at a time."""
    for part in row_slices(len(columns[0])):
        yield from zip(*(c[part].tolist() for c in columns), strict=True)


def _run_columns(footer: bytes, count: int) -> _Cols | None:
    """A footer's entries, decoded a run of equal-length entries at a time (each run a
    strided numpy view); None if the footer ends inside an entry (as read_footer).

    Usually one run (an engine's keys are fixed-size hashes); a tier's first segment
    holds the daemon's calibration records before an engine's, so its footer has two.
    Such a footer was decoded one struct unpack an entry, which held the GIL 37-86 ms
    for 31 k entries at a restart (the event loop waiting behind the loaders).
    A run's end is found by comparing the lengths over windows that double while the
    run goes on (back to RUN_WINDOW after each change), so a footer of n entries in r
    runs costs O(n + r * RUN_WINDOW) comparisons, not one pass per run."""
    limit = len(footer)
    pos = _FOOTER_HEAD.size
    tables: list[np.ndarray] = []
    ns_offs: list[np.ndarray] = []
    done = 0
    window = RUN_WINDOW
    while done < count:
        if pos + _ENTRY.size > limit:
            return None
        *_, ns_len, key_len = _ENTRY.unpack_from(footer, pos)
        stride = _ENTRY.size + ns_len + key_len
        fit = min(count - done, (limit - pos) // stride)  # whole entries of this stride
        if not fit:
            return None
        dtype = _entry_dtype(stride)
        run = 0
        while run < fit:
            n = min(window, fit - run)
            part = np.frombuffer(footer, dtype, n, offset=pos + run * stride)
            same = (part["ns_len"] == ns_len) & (part["key_len"] == key_len)
            if same.all():
                run += n
                window *= 2
                continue
            run += int(np.argmin(same))  # the first entry of another length
            window = RUN_WINDOW
            break
        tables.append(np.frombuffer(footer, dtype, run, offset=pos))
        ns_offs.append(pos + _ENTRY.size + stride * np.arange(run, dtype=np.int64))
        pos += run * stride
        done += run
    fields = {
        f: np.concatenate([t[f] for t in tables]) if tables else np.zeros(0, np.dtype(fmt))
        for f, fmt in zip(_ENTRY_FIELDS, _ENTRY_FORMATS, strict=True)
    }
    ns_off = np.concatenate(ns_offs) if ns_offs else np.zeros(0, np.int64)
    ns_len_all = fields["ns_len"].astype(np.int64)
    return fields, ns_off, ns_len_all, ns_off + ns_len_all


def _entry_dtype(stride: int) -> np.dtype:
    """A footer entry of `stride` bytes (its fixed fields, then namespace and key) as a
    numpy record."""
    return np.dtype(
        {
            "names": list(_ENTRY_FIELDS),
            "formats": list(_ENTRY_FORMATS),
            "offsets": list(_ENTRY_OFFSETS),
            "itemsize": stride,
        }
    )


def _ns_index(
    footer: bytes, ns_off: np.ndarray, ns_len: np.ndarray, raw_ns: list[bytes]
) -> np.ndarray:
    """Each entry's namespace as an index into `raw_ns`, which gets each distinct one
    (compared as bytes, vectorised per length)."""
    out = np.zeros(len(ns_off), np.uint32)
    data = np.frombuffer(footer, np.uint8)
    for length in np.unique(ns_len).tolist():
        rows = np.nonzero(ns_len == length)[0]
        if length == 0:
            out[rows] = raw_ns.index(b"") if b"" in raw_ns else _append(raw_ns, b"")
            continue
        grid = data[ns_off[rows][:, None] + np.arange(length)]
        if (grid == grid[0]).all():
            # One namespace (the usual footer): np.unique over rows sorts a void dtype,
            # holding the GIL ~70 ms a footer of 8 k entries (the event loop waits).
            distinct, inverse = grid[:1], np.zeros(len(rows), np.int64)
        else:
            distinct, inverse = np.unique(grid, axis=0, return_inverse=True)
        for j, row in enumerate(distinct):
            name = row.tobytes()
            index = raw_ns.index(name) if name in raw_ns else _append(raw_ns, name)
            out[rows[inverse.reshape(-1) == j]] = index
    return out


def _append(names: list[bytes], name: bytes) -> int:
    names.append(name)
    return len(names) - 1
