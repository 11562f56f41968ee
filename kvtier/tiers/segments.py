"""The NVMe tier as a log of segments (`nvme.layout = "segments"`): records appended to large
preallocated files instead of one file per record.

A million record files cost the kernel ~1.35 GB of inode and dentry cache and 80 s to
delete, and every record paid a file creation and a rename. Here a record is the same
checksummed record (kvtier/tiers/record.py: full key, generation, length, xxh3) written
at the tail of a segment, `segments/<id:016x>.kvs`: a header page, the records, and once
sealed a footer listing them and a trailer in the last page pointing at it (the format,
its encoding and its checks: kvtier/tiers/segment_format.py).

What keeps a torn record invisible. Writers reserve consecutive extents of the active
segment under a lock and write them concurrently (queue depth > 1), but a record becomes
visible (`read` finds it, `write` returns) only once every record before it in the
segment is completely written (and, with `sync_writes`, one fdatasync of the segment
covers them all: group commit). So the records that were ever visible are a prefix of
complete records: recovery of a segment without a valid trailer reads records from page 1
on, each header and payload checked, and stops at the first that fails, never looking
inside a payload for a header (a tenant's bytes could hold a forged one). A write that
fails (EIO, ENOSPC) breaks the prefix: the segment is sealed at once with the records
written so far, so the records after the hole are found through the footer; if even the
seal fails, they fail too (the store keeps the blocks elsewhere), never half-visible.

A sealed segment's footer is read instead of its records. It is trusted only for where
records are: every read verifies the record's own header and checksum against the
catalog, so a footer that lies (checksum right, offsets wrong) costs misses, never wrong
bytes. Segment files are never reused: a reclaimed one is deleted and new ones are
fallocated, so no stale record of an earlier life is found past a segment's tail.

Deletes, overwrites and removals append tombstones to the tier's tombstone log (as the
file layout's deletes do); the dead record stays in its segment until the segment is
reclaimed, so after a complete recovery the tombstones that still cover a record on disk
are carried into the live log before the older logs are removed.

Where a record lies is its *location* (segment_file.pack_location: segment id and page), a
u64 the tier reports from `write_placed` and its owner keeps — the daemon's catalog, as a
column beside the record's other fields — and hands back to `read` / `read_into` /
`remove`: the tier keeps no Python object per record (a dict entry per record cost ~1 KB a
block at a million). Per segment it keeps only aggregates (live and stored bytes and
counts) and, while the segment is appended to, the log its footer is made from. Which
records are live is the owner's to say (`RecordOwner`): reclaim reads a victim's footer for
its candidates and asks. Records written with the plain `write` (tests, the calibration,
the health probe, a tier used without an owner) are the tier's own: their locations are in
a map of the tier's (`_placed`), which in the daemon holds a handful.

Reclaim (a background thread of the tier): segments without a live record are deleted at
once (after the owner confirms none is); when the segments come within two segments of
`nvme.capacity_bytes` (or fill more than half of it and one is at most half live) the
sealed segment with the smallest live share is emptied: its live records (those the owner
still holds at the victim's location, i.e. the ones the policy kept) are re-appended, the
copies synced, the moves published to the owner (which takes each only where it still
names the old location), then the segment deleted — unlinked at once, its descriptor kept
a few seconds for reads that took the old location just before the move (their bytes are
still there, still verified); `relocated_bytes` over `written_bytes` is the write
amplification. The room reclaim needs is kept back from the capacity the store sees
(`capacity_bytes` below the configured one by `reserve_bytes`).

Not done in this layout yet: encryption (refused at start with a message naming the
option), a migration from the file layout (refused likewise), and `kvtier wipe`.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import xxhash

from kvtier import failpoints
from kvtier.buffers import aligned_buffer
from kvtier.errors import ConfigError, CorruptRecord
from kvtier.tiers.allocator import round_up
from kvtier.tiers.crypto import RecordCipher
from kvtier.tiers.nvme import NvmeTier, Placed, fan_of
from kvtier.tiers.posix_io import advance, preallocate, supports_o_direct
from kvtier.tiers.record import (
    ALIGN_BYTES,
    RecordHeader,
    encode_header,
    payload_xxh3,
    verify_record,
)
from kvtier.tiers.safe_open import open_regular, private_dir, remove_entry
from kvtier.tiers.segment_file import (
    NO_LOCATION,
    RecordId,
    Segment,
    pack_location,
    unpack_location,
)
from kvtier.tiers.segment_format import (
    EMPTY_FOOTER_BYTES,
    FooterColumns,
    check_segment_header,
    columns_of_entries,
    encode_segment_header,
    entry_bytes,
    read_footer,
    read_footer_columns,
    scan_records,
    segment_id_of,
    segment_name,
)
from kvtier.tiers.startup import (
    FanScan,
    RecoveredRecord,
    RecoveryReport,
    fsync_dir,
    refuse_other_layout,
    set_aside_tombstone_logs,
    tombstone_entry,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SEGMENTS_DIR",
    "RecordOwner",
    "SegmentTier",
    "segment_bytes_for",
]

SEGMENTS_DIR = "segments"
_MAX_SEGMENT_BYTES = 256 << 20
_MIN_SEGMENT_BYTES = 4 << 20
_LOAD_THREADS = 8  # segments whose footers (or records) are read at once at start
_RECLAIM_POLL_S = 1.0  # the reclaimer also looks this often without being woken
_SPACE_WAIT_S = 5.0  # a write at the limit waits this long for the reclaimer, then ENOSPC
_SPACE_POLL_S = 0.005
_IOV_MAX = 1024  # buffers one pwritev takes (Linux's IOV_MAX); a batch writes in pieces
_OWNER_CHUNK = 2048  # records per question to the owner (each answered on its event loop)
_RETIRED_GRACE_S = 5.0  # a deleted segment's descriptor serves reads dispatched before


class RecordOwner(Protocol):
    """Who keeps the locations of the records the tier reports from `write_placed` and
    `recover` (the daemon's catalog, through kvtier/engine/nvme.py). Asked from the
    reclaimer's thread, at most _OWNER_CHUNK records a call; an OSError gives the pass up."""

    def live(self, headers: Sequence[RecordHeader], locations: Sequence[int]) -> list[bool]:
        """Whether each record is still held, at that location."""
        ...

    def moved(
        self, headers: Sequence[RecordHeader], old: Sequence[int], new: Sequence[int]
    ) -> list[bool]:
        """Take each new location where the owner still names the old one; which it took."""
        ...


def segment_bytes_for(capacity_bytes: int) -> int:
    """A segment's size: 1/16 of the tier within [4 MiB, 256 MiB], whole pages. Large
    enough that files are few (4 TB: ~16 k), small enough that reclaim has choices."""
    size = min(_MAX_SEGMENT_BYTES, max(_MIN_SEGMENT_BYTES, capacity_bytes // 16))
    return size & ~(ALIGN_BYTES - 1)


@dataclass(slots=True)
class _Loaded:
    """What recovery read from one segment of an earlier run."""

    segment: Segment
    entries: list[tuple[int, RecordHeader]]
    sealed: bool
    why: str = ""  # why the segment could not be read at all ("" if it could)


class SegmentTier(NvmeTier):
    """The NVMe tier in segments (see the module docstring). The same lifecycle and
    methods as NvmeTier, whose start-up it shares (lock, epoch, tombstone logs): `open()`
    or `prepare()` -> `recover()` -> `compact_tombstones()`, then `write` / `read` /
    `read_into` / `remove` / `tombstone` from I/O threads, `close()` last. `reclaim()` runs
    one reclaim pass on the caller's thread (the tier's own thread does it otherwise)."""

    layout = "segments"

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        direct_io: bool,
        sync_writes: bool,
        cipher: RecordCipher | None = None,
        segment_bytes: int | None = None,
    ) -> None:
        if cipher is not None:
            raise ConfigError(
                'nvme.layout = "segments" does not encrypt records yet: unset '
                'nvme.encryption_key_file or use nvme.layout = "files"'
            )
        super().__init__(root, capacity_bytes, direct_io, sync_writes, None)
        self.disk_limit_bytes = capacity_bytes
        self.segment_bytes = segment_bytes or segment_bytes_for(capacity_bytes)
        # Room reclaim needs: a segment being filled, one being relocated into, one being
        # emptied, and a margin so that reclaim starts before writes must wait for it.
        self.reserve_bytes = max(capacity_bytes // 8, 4 * self.segment_bytes)
        if self.reserve_bytes >= capacity_bytes // 2:
            raise ConfigError(
                f"nvme.capacity_bytes: {capacity_bytes} bytes is too small for the segment "
                f"layout ({self.segment_bytes}-byte segments); give it at least "
                f'{8 * self.segment_bytes} or use nvme.layout = "files"'
            )
        self.capacity_bytes = capacity_bytes - self.reserve_bytes
        self._seg_dir = root / SEGMENTS_DIR
        self._seg_str = str(self._seg_dir)
        self._mu = threading.Lock()  # the maps below, segment accounting, `_active`
        self._rotate_lock = threading.Lock()  # one thread opens the next segment
        # Locations of the records the tier itself holds (see the module docstring).
        self._placed: dict[RecordId, tuple[int, RecordHeader]] = {}
        self._owner: RecordOwner | None = None
        self._owner_ready = threading.Event()  # the owner holds every recovered record
        self._owner_ready.set()
        self._segments: dict[int, Segment] = {}
        self._retired: dict[int, Segment] = {}  # deleted, descriptor kept for late reads
        # The segment callers append to, and the one reclaim copies into: apart, so that
        # callers at the limit cannot use up the room reclaim needs to free some.
        self._active: Segment | None = None
        self._relocating: Segment | None = None
        self._next_id = 1
        self._old: list[Segment] = []  # earlier runs' segments, for `recover`
        self.allocated_bytes = 0  # of segment files on disk
        self.written_bytes = 0  # records written by callers
        self.relocated_bytes = 0  # records re-appended by reclaim
        self.reclaimed_segments = 0
        self._carry: list[tuple[str, bytes, int]] = []  # tombstones still covering records
        self._recovered = threading.Event()  # every old segment loaded: reclaim may run
        self._reclaim_wake = threading.Event()
        self._closing = threading.Event()
        self._reclaimer: threading.Thread | None = None
        self._reclaim_lock = threading.Lock()

    def attach_owner(self, owner: RecordOwner) -> None:
        """Hand the locations of the records `recover` finds and `write_placed` writes to
        `owner` (before `recover`); reclaim waits for `owner_ready()`."""
        self._owner = owner
        self._owner_ready.clear()

    def owner_ready(self) -> None:
        """The owner holds every record `recover` reported: reclaim may ask it."""
        self._owner_ready.set()
        self._reclaim_wake.set()

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    @property
    def write_amplification(self) -> float:
        """Bytes written to the segments per byte callers wrote (1.0: nothing relocated)."""
        if not self.written_bytes:
            return 1.0
        return (self.written_bytes + self.relocated_bytes) / self.written_bytes

    # ---- start-up ---------------------------------------------------------------------------
    def prepare(self) -> None:
        """Lock the tier, refuse one in the file layout, list the segments of earlier runs
        (read by `recover`), claim this run's generations, start the reclaimer."""
        self._refused_before = self.refused.count
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        private_dir(self.root, self.refused, "directory", follow=True)
        self._lock_tier()
        refuse_other_layout(self.root, self.layout)
        had_records = self._seg_dir.is_dir()
        private_dir(self._seg_dir, self.refused, "segments/")
        self.direct_io = self._want_direct and supports_o_direct(self._seg_dir)
        if self._want_direct and not self.direct_io:
            logger.warning(
                "O_DIRECT is not supported on %s; the NVMe segments use buffered I/O", self.root
            )
        self._old = []
        for name in sorted(os.listdir(self._seg_str)):
            seg_id = segment_id_of(name)
            path = f"{self._seg_str}/{name}"
            if seg_id is None:
                remove_entry(path)  # a stray: nothing this layout wrote
                continue
            try:
                opened = open_regular(path, self._flags(os.O_RDWR))
            except OSError as err:
                logger.warning("dropping unreadable segment %s: %s", name, err)
                remove_entry(path)
                continue
            seg = Segment(seg_id, path, opened.fd, opened.info.st_size)
            seg.full = seg.sealing = seg.sealed = True  # never appended to again
            self._old.append(seg)
            self._segments[seg_id] = seg
            self.allocated_bytes += seg.size_bytes
            self._next_id = max(self._next_id, seg_id + 1)
        self._removed_tmp = 0
        self._old_tombstone_logs, self._tombstone_fd = set_aside_tombstone_logs(
            self.root, self.refused
        )
        if not self.epoch.claim_next(self.refused) and not had_records:
            self.epoch.claim(1)
        self._reclaimer = threading.Thread(
            target=self._reclaim_forever, name="kvtier-reclaim", daemon=True
        )
        self._reclaimer.start()

    def _lock_tier(self) -> None:
        self._lock()

    def recover(self, on_fan: Callable[[FanScan], None] | None = None) -> RecoveryReport:
        """Load every earlier segment (footer if sealed, else its records; on threads),
        keep each block's newest record not tombstoned, index them, hand them out by fan.

        The cyclic collector is paused meanwhile: the objects made here (a header and a few
        tuples per record) live as long as the tier, and each full collection their number
        triggers would walk all of them again (4 s of an 8 s open at 100 k records here)."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._recover_all(on_fan)
        finally:
            if collecting:
                gc.enable()

    def _recover_all(self, on_fan: Callable[[FanScan], None] | None) -> RecoveryReport:
        if self._owner is not None:
            return self._recover_columns(on_fan)
        tombstones = self._read_tombstones()
        report = RecoveryReport([], 0, 0, 0, 0, max(tombstones.values(), default=0))
        with ThreadPoolExecutor(_LOAD_THREADS, thread_name_prefix="kvtier-segload") as pool:
            loaded = list(pool.map(self._load, self._old))
        if self._stop_recovery.is_set():
            report.complete = False
            return report
        newest: dict[tuple[str, bytes], tuple[Segment, int, RecordHeader]] = {}
        covered: dict[tuple[str, bytes], int] = {}
        for item in loaded:
            seg = item.segment
            if item.why:
                report.dropped_corrupt += 1
                logger.warning("dropping unreadable segment %s: %s", seg.path, item.why)
                self._retire(seg, delete=True)
                continue
            seg.loaded = True
            seg.stored_bytes = sum(h.record_bytes for _, h in item.entries)
            seg.stored_count = len(item.entries)
            for offset, header in item.entries:
                ident = (header.ns_id, header.key)
                dead_up_to = tombstones.get(ident, 0)
                if header.generation <= dead_up_to:
                    report.dropped_deleted += 1
                    covered[ident] = dead_up_to
                    continue
                old = newest.get(ident)
                if old is not None:
                    report.dropped_stale += 1
                    if old[2].generation >= header.generation:
                        continue
                newest[ident] = (seg, offset, header)
        fans: dict[str, FanScan] = {}
        owned = self._owner is not None
        with self._mu:
            for (ns_id, key), (seg, offset, header) in newest.items():
                location = pack_location(seg.seg_id, offset)
                seg.count_live(header.record_bytes)
                if not owned:
                    self._placed[(ns_id, key, header.generation)] = (location, header)
                report.max_generation = max(report.max_generation, header.generation)
                fan = fan_of(ns_id, key)
                scan = fans.get(fan)
                if scan is None:
                    scan = fans[fan] = FanScan(fan)
                scan.records.append(RecoveredRecord(header, seg.path, location))
                scan.files += 1
        # Tombstones that still kill a record on disk must outlive the logs they are in.
        self._carry = [(ns, key, gen) for (ns, key), gen in covered.items()]
        self._recovered.set()
        self._reclaim_wake.set()
        for fan in sorted(fans):
            if on_fan is None:
                report.records += fans[fan].records
            else:
                on_fan(fans[fan])
        return report

    def _recover_columns(self, on_fan: Callable[[FanScan], None] | None) -> RecoveryReport:
        """`_recover_all` for a tier with an owner, in columns: each segment's footer
        decoded into numpy arrays (segment_format.read_footer_columns), the newest record
        of each block chosen by one sort (digest, generation descending, load order), the
        tombstones applied; a `RecordHeader` is made only for the records handed out, fan
        by fan (so no million objects are alive at once: their heap, fragmented by what
        the catalog allocates meanwhile, stayed resident after the restart). The same
        records, counts and locations as the per-record path (property test)."""
        tombstones = self._read_tombstones()
        report = RecoveryReport([], 0, 0, 0, 0, max(tombstones.values(), default=0))
        with ThreadPoolExecutor(_LOAD_THREADS, thread_name_prefix="kvtier-segload") as pool:
            loaded = list(pool.map(self._load_columns, self._old))
        if self._stop_recovery.is_set():
            report.complete = False
            return report
        parts: list[tuple[Segment, FooterColumns]] = []
        for seg, cols, why in loaded:
            if why or cols is None:
                report.dropped_corrupt += 1
                logger.warning("dropping unreadable segment %s: %s", seg.path, why)
                self._retire(seg, delete=True)
                continue
            seg.loaded = True
            seg.stored_bytes = int(cols.record_bytes.sum())
            seg.stored_count = len(cols)
            parts.append((seg, cols))
        chosen = _newest(parts, tombstones, report)
        if chosen is None:  # two keys with one digest: the per-record path tells them apart
            return self._recover_records(tombstones, parts, report, on_fan)
        rows_of, self._carry = chosen
        fan_parts: list[np.ndarray] = []
        with self._mu:
            for (seg, cols), rows in zip(parts, rows_of, strict=True):
                seg.live_bytes += int(cols.record_bytes[rows].sum())
                seg.live_count += len(rows)
                if len(rows):
                    top = int(cols.generation[rows].max())
                    report.max_generation = max(report.max_generation, top)
                names = cols.ns_names
                # A fan number per record (small ints: no object kept per record).
                fan_parts.append(
                    np.fromiter(
                        (
                            int(fan_of(names[int(cols.ns[r])], cols.key(r)), 16)
                            for r in rows.tolist()
                        ),
                        dtype=np.uint8,
                        count=len(rows),
                    )
                )
        self._recovered.set()
        self._reclaim_wake.set()
        part_ids = np.repeat(np.arange(len(parts)), [len(r) for r in rows_of])
        all_rows = np.concatenate(rows_of) if rows_of else np.zeros(0, np.int64)
        fan_ids = np.concatenate(fan_parts) if fan_parts else np.zeros(0, np.uint8)
        by_fan = np.argsort(fan_ids, kind="stable")  # each fan's records in load order
        bounds = np.searchsorted(fan_ids[by_fan], np.arange(257))
        for fan in range(256):
            picked = by_fan[bounds[fan] : bounds[fan + 1]]
            if not len(picked):
                continue
            scan = FanScan(f"{fan:02x}")
            for i in picked.tolist():
                seg, cols = parts[int(part_ids[i])]
                row = int(all_rows[i])
                location = pack_location(seg.seg_id, int(cols.offset[row]))
                scan.records.append(RecoveredRecord(cols.header(row), seg.path, location))
            scan.files = len(scan.records)
            if on_fan is None:
                report.records += scan.records
            else:
                on_fan(scan)  # may wait for the records before it to be added
            del scan
        return report

    def _recover_records(
        self,
        tombstones: dict[tuple[str, bytes], int],
        parts: list[tuple[Segment, FooterColumns]],
        report: RecoveryReport,
        on_fan: Callable[[FanScan], None] | None,
    ) -> RecoveryReport:
        """The per-record choice over columns already loaded (a digest collision)."""
        report.dropped_stale = report.dropped_deleted = 0
        self._carry = []
        newest: dict[tuple[str, bytes], tuple[Segment, int, RecordHeader]] = {}
        covered: dict[tuple[str, bytes], int] = {}
        for seg, cols in parts:
            for row in range(len(cols)):
                header = cols.header(row)
                ident = (header.ns_id, header.key)
                dead_up_to = tombstones.get(ident, 0)
                if header.generation <= dead_up_to:
                    report.dropped_deleted += 1
                    covered[ident] = dead_up_to
                    continue
                old = newest.get(ident)
                if old is not None:
                    report.dropped_stale += 1
                    if old[2].generation >= header.generation:
                        continue
                newest[ident] = (seg, int(cols.offset[row]), header)
        fans: dict[str, FanScan] = {}
        with self._mu:
            for (ns_id, key), (seg, offset, header) in newest.items():
                seg.count_live(header.record_bytes)
                report.max_generation = max(report.max_generation, header.generation)
                scan = fans.setdefault(fan_of(ns_id, key), FanScan(fan_of(ns_id, key)))
                location = pack_location(seg.seg_id, offset)
                scan.records.append(RecoveredRecord(header, seg.path, location))
                scan.files += 1
        self._carry = [(ns, key, gen) for (ns, key), gen in covered.items()]
        self._recovered.set()
        self._reclaim_wake.set()
        for fan in sorted(fans):
            if on_fan is None:
                report.records += fans[fan].records
            else:
                on_fan(fans[fan])
        return report

    def _load_columns(self, seg: Segment) -> tuple[Segment, FooterColumns | None, str]:
        """`_load` as columns: (segment, its records, why it could not be read)."""
        if self._stop_recovery.is_set():
            return seg, None, "recovery stopped"
        if failpoints.ACTIVE:
            failpoints.fire("nvme.recover_fan")
        fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            try:
                size_bytes = check_segment_header(os.pread(fd, ALIGN_BYTES, 0), seg.seg_id)
            except CorruptRecord as err:
                return seg, None, str(err)
            seg.size_bytes = min(seg.size_bytes, size_bytes)
            cols = read_footer_columns(fd, seg.seg_id, seg.size_bytes)
            if cols is not None:
                return seg, cols, ""
            scan = scan_records(fd, seg.size_bytes)
        finally:
            os.close(fd)
        self._seal_scanned(seg, scan.entries, scan.tail)
        return seg, columns_of_entries(scan.entries), ""

    def compact_tombstones(self) -> None:
        """Carry the tombstones that still cover records on disk into the live log (synced),
        then remove the older logs (a crash between: the entries are there twice)."""
        if failpoints.ACTIVE:
            failpoints.fire("nvme.compact")
        if self._carry:
            assert self._tombstone_fd is not None
            data = b"".join(tombstone_entry(*entry) for entry in self._carry)
            with self._tombstone_lock:
                if os.write(self._tombstone_fd, data) != len(data):
                    raise OSError(errno.EIO, "short write to the tombstone log")
                os.fdatasync(self._tombstone_fd)
            self._carry = []
        for name in self._old_tombstone_logs:
            remove_entry(self.root / name)
        self._old_tombstone_logs = []

    def _load(self, seg: Segment) -> _Loaded:
        """One earlier segment's records: from its footer when its trailer is valid, else
        read one by one from the start until the first that fails (then sealed here, so the
        next start reads a footer)."""
        if self._stop_recovery.is_set():
            return _Loaded(seg, [], False, "recovery stopped")
        if failpoints.ACTIVE:
            failpoints.fire("nvme.recover_fan")
        fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            try:
                size_bytes = check_segment_header(os.pread(fd, ALIGN_BYTES, 0), seg.seg_id)
            except CorruptRecord as err:
                return _Loaded(seg, [], False, str(err))
            seg.size_bytes = min(seg.size_bytes, size_bytes)
            entries = read_footer(fd, seg.seg_id, seg.size_bytes)
            if entries is not None:
                return _Loaded(seg, entries, True)
            scan = scan_records(fd, seg.size_bytes)
        finally:
            os.close(fd)
        self._seal_scanned(seg, scan.entries, scan.tail)
        return _Loaded(seg, scan.entries, False)

    def _seal_scanned(
        self, seg: Segment, entries: list[tuple[int, RecordHeader]], tail: int
    ) -> None:
        """Write the footer of a segment recovery had to scan, where the records end."""
        seg.tail = tail
        seg.log = list(entries)
        seg.footer_bytes = EMPTY_FOOTER_BYTES + sum(entry_bytes(h) for _, h in entries)
        if tail + round_up(seg.footer_bytes, ALIGN_BYTES) + ALIGN_BYTES > seg.size_bytes:
            seg.log = []
            return  # no room for one: scanned again at the next start
        try:
            seg.write_footer()
        except OSError as err:
            logger.warning("could not seal recovered segment %s: %s", seg.path, err)
        seg.log = []

    # ---- writing ------------------------------------------------------------------------------
    def write(self, header: RecordHeader, payload: Sequence[memoryview | mmap.mmap]) -> int:
        """Append one record the tier keeps the location of itself (see the module
        docstring); returns its size on disk once it is visible (and durable with
        sync_writes). `payload` as for NvmeTier.write."""
        seg, offset = self._write(header, payload)
        rid = (header.ns_id, header.key, header.generation)
        with self._mu:
            old = self._placed.get(rid)
            self._placed[rid] = (pack_location(seg.seg_id, offset), header)
            if old is not None:  # a rewrite of the same generation: the old copy is dead
                self._count_dead_locked(old[0], header.record_bytes)
            seg.pending -= 1
        return header.record_bytes

    def write_placed(
        self, header: RecordHeader, payload: Sequence[memoryview | mmap.mmap]
    ) -> Placed:
        """`write` for a record whose location the owner keeps: returns it. The segment
        holds still (reclaim skips it) until `settle(location)`, called where the owner
        records the location, so that reclaim never asks about a record the owner has
        not been told of yet."""
        seg, offset = self._write(header, payload)
        return Placed(header.record_bytes, pack_location(seg.seg_id, offset))

    def settle(self, location: int) -> None:
        """The owner has recorded the location `write_placed` gave (cheap: the event loop
        may call it)."""
        with self._mu:
            seg = self._segments.get(unpack_location(location)[0])
            if seg is not None:
                seg.pending -= 1

    def _write(
        self, header: RecordHeader, payload: Sequence[memoryview | mmap.mmap]
    ) -> tuple[Segment, int]:
        if failpoints.ACTIVE:
            failpoints.fire("nvme.write")
        total = header.header_bytes + sum(len(b) for b in payload)
        if total != header.record_bytes:
            raise ValueError(f"payload buffers add up to {total}, expected {header.record_bytes}")
        head = encode_header(header, self._scratch(header.header_bytes, "head"))
        placed = self._append(header, [head, *payload], relocating=False)
        with self._mu:
            self.written_bytes += total
        return placed

    def write_many(
        self, headers: Sequence[RecordHeader], payloads: Sequence[Sequence[memoryview | mmap.mmap]]
    ) -> list[int | OSError]:
        """`write_many_placed` for records the tier keeps the locations of itself (as
        `write`); per record its size on disk or the OSError that failed it."""
        out: list[int | OSError] = []
        for header, placed in zip(headers, self.write_many_placed(headers, payloads), strict=True):
            if isinstance(placed, OSError):
                out.append(placed)
                continue
            rid = (header.ns_id, header.key, header.generation)
            with self._mu:
                old = self._placed.get(rid)
                self._placed[rid] = (placed.location, header)
                if old is not None:
                    self._count_dead_locked(old[0], header.record_bytes)
                seg = self._segments.get(unpack_location(placed.location)[0])
                if seg is not None:
                    seg.pending -= 1
            out.append(placed.record_bytes)
        return out

    def write_many_placed(
        self, headers: Sequence[RecordHeader], payloads: Sequence[Sequence[memoryview | mmap.mmap]]
    ) -> list[Placed | OSError]:
        """Append several records (a demotion batch) back to back: consecutive extents of
        the active segment reserved together, written by as few `pwritev` calls as IOV_MAX
        allows and marked written as one extent, so with sync_writes one fdatasync covers
        the batch. The visibility rule is `write`'s: a record is visible (returned here)
        only once every extent before it is written. Per record where it lies (each to be
        `settle`d, as for `write_placed`) or the OSError that failed it; `payloads` as for
        `write`."""
        results: list[Placed | OSError] = [Placed(0)] * len(headers)
        todo: list[int] = []
        for i, (header, payload) in enumerate(zip(headers, payloads, strict=True)):
            total = header.header_bytes + sum(len(b) for b in payload)
            if total != header.record_bytes:
                raise ValueError(
                    f"payload buffers add up to {total}, expected {header.record_bytes}"
                )
            try:
                if failpoints.ACTIVE:
                    failpoints.fire("nvme.write")
            except OSError as err:
                results[i] = err
                continue
            todo.append(i)
        # The batch's record headers side by side in one aligned buffer (the thread's
        # scratch holds one header: each record of the batch needs its own until written).
        starts, at = [], 0
        for header in headers:
            starts.append(at)
            at += header.header_bytes
        heads = memoryview(aligned_buffer(max(at, ALIGN_BYTES)))
        iovs: list[list[memoryview | mmap.mmap]] = []
        for header, start, payload in zip(headers, starts, payloads, strict=True):
            head = encode_header(header, heads[start : start + header.header_bytes])
            iovs.append([head, *payload])
        pos = 0
        while pos < len(todo):
            try:  # the first extent as `write` takes it: rotating, waiting for room
                seg, offset = self._reserve(headers[todo[pos]], relocating=False)
            except OSError as err:  # no room for this one: none for those after it either
                for i in todo[pos:]:
                    results[i] = err
                break
            run = [(todo[pos], offset)]
            pos += 1
            with self._mu:  # the rest of the batch while it fits, without rotating
                while pos < len(todo) and self._active is seg and not seg.full:
                    header = headers[todo[pos]]
                    entry = entry_bytes(header)
                    if not seg.fits(header.record_bytes, entry):
                        break
                    run.append((todo[pos], seg.reserve(header, entry)))
                    pos += 1
            for piece in _contiguous(run, headers):
                self._write_piece(seg, piece, headers, iovs, results)
        return results

    def _write_piece(
        self,
        seg: Segment,
        piece: list[tuple[int, int]],
        headers: Sequence[RecordHeader],
        iovs: list[list[memoryview | mmap.mmap]],
        results: list[Placed | OSError],
    ) -> None:
        """Write and publish records reserved back to back in `seg` ((index, offset) in
        order), finishing them as one extent (see `write_many`)."""
        first_offset = piece[0][1]
        size = sum(headers[i].record_bytes for i, _ in piece)
        with seg.cond:  # reserved one by one, finished as one
            seg.inflight -= len(piece) - 1
        try:
            try:
                chunk: list[memoryview | mmap.mmap] = []
                chunk_at, chunk_bytes = first_offset, 0
                for i, _ in piece:
                    if chunk and len(chunk) + len(iovs[i]) > _IOV_MAX:
                        _pwrite_at(seg.fd, chunk, chunk_bytes, chunk_at)
                        chunk, chunk_at, chunk_bytes = [], chunk_at + chunk_bytes, 0
                    chunk += iovs[i]
                    chunk_bytes += headers[i].record_bytes
                _pwrite_at(seg.fd, chunk, chunk_bytes, chunk_at)
            except BaseException:
                with seg.cond:  # none of the piece may be listed in the footer
                    seg.failed.update(offset for _, offset in piece[1:])
                self._finish(seg, first_offset, size, ok=False)
                raise
            self._finish(seg, first_offset, size, ok=True)
        except BaseException as err:
            with self._mu:
                seg.pending -= len(piece)
            for i, _ in piece:
                # As in `_append`: a record reported failed must never come back.
                with contextlib.suppress(OSError):
                    self._append_tombstone(headers[i].ns_id, headers[i].key, headers[i].generation)
            if not isinstance(err, OSError):
                raise
            for i, _ in piece:
                results[i] = err
            return
        with self._mu:  # as `_append` counts one record (keep the two in step)
            for i, offset in piece:
                header = headers[i]
                seg.count_live(header.record_bytes)  # `pending` stays up until settled
                results[i] = Placed(header.record_bytes, pack_location(seg.seg_id, offset))
            self.written_bytes += size

    def _append(
        self, header: RecordHeader, iov: list[memoryview | mmap.mmap], relocating: bool
    ) -> tuple[Segment, int]:
        """Write one record at the tail; (segment, offset) once visible. A caller's write
        leaves the segment's `pending` raised for the caller to lower once the location is
        recorded; a relocated copy lowers it here (its move is published by reclaim)."""
        seg, offset = self._reserve(header, relocating)
        total = header.record_bytes
        try:
            try:
                _pwrite_at(seg.fd, list(iov), total, offset)
            except BaseException:
                self._finish(seg, offset, total, ok=False)
                raise
            self._finish(seg, offset, total, ok=True)
        except BaseException:
            with self._mu:
                seg.pending -= 1
            if not relocating:
                # The bytes may be complete on disk (a failed sync, a write after a hole)
                # and listed in a footer: the caller was told it failed, so it must never
                # come back at a restart (a newer value that stayed in DRAM could be lost).
                with contextlib.suppress(OSError):
                    self._append_tombstone(header.ns_id, header.key, header.generation)
            raise
        with self._mu:
            if relocating:
                seg.pending -= 1
            seg.count_live(total)
        return seg, offset

    def _reserve(self, header: RecordHeader, relocating: bool) -> tuple[Segment, int]:
        """An extent of the active segment for this record (a new segment if it is full)."""
        size, entry = header.record_bytes, entry_bytes(header)
        give_up_s: float | None = None
        while True:
            with self._mu:
                seg = self._relocating if relocating else self._active
                if seg is not None and not seg.full and seg.fits(size, entry):
                    return seg, seg.reserve(header, entry)
            if self._rotate(seg, size, entry, relocating):
                continue
            # At the limit: the store keeps its live bytes below capacity_bytes, so the
            # reclaimer frees room behind a stream of writes; wait for it, briefly.
            now_s = time.monotonic()
            if give_up_s is None:
                give_up_s = now_s + _SPACE_WAIT_S
            if relocating or now_s >= give_up_s:
                raise OSError(errno.ENOSPC, "NVMe segments full (reclaim has not caught up)")
            time.sleep(_SPACE_POLL_S)

    def _rotate(self, full: Segment | None, size: int, entry: int, relocating: bool) -> bool:
        """Seal the full active segment and open the next one (one thread at a time); False
        if the segments are at the limit (the reclaimer is woken)."""
        with self._rotate_lock:
            with self._mu:
                if (self._relocating if relocating else self._active) is not full:
                    return True  # another writer rotated meanwhile
                if full is not None:
                    full.full = True
                    self._set_active(None, relocating)
            if full is not None:
                self._seal_when_idle(full)
            seg_bytes = max(
                self.segment_bytes, round_up(size + entry, ALIGN_BYTES) + 4 * ALIGN_BYTES
            )
            # Reclaim's own copies may use the reserve; callers' writes stop at the limit.
            limit = self.disk_limit_bytes + (self.segment_bytes if relocating else 0)
            if self.allocated_bytes + seg_bytes > limit:
                self._reclaim_wake.set()
                return False  # the caller waits for the reclaimer (lock released)
            new = self._create_segment(seg_bytes)
            with self._mu:
                self._set_active(new, relocating)
            if self.allocated_bytes + 2 * self.segment_bytes > self.disk_limit_bytes:
                self._reclaim_wake.set()
            return True

    def _set_active(self, seg: Segment | None, relocating: bool) -> None:
        if relocating:
            self._relocating = seg
        else:
            self._active = seg

    def _create_segment(self, size_bytes: int) -> Segment:
        with self._mu:
            seg_id = self._next_id
            self._next_id += 1
        path = f"{self._seg_str}/{segment_name(seg_id)}"
        fd = open_regular(path, self._flags(os.O_RDWR | os.O_CREAT | os.O_EXCL)).fd
        try:
            preallocate(fd, size_bytes)
            head = aligned_buffer(ALIGN_BYTES)
            fixed = encode_segment_header(seg_id, size_bytes)
            head[: len(fixed)] = fixed
            if os.pwritev(fd, [head], 0) != ALIGN_BYTES:
                raise OSError(errno.EIO, "short write of a segment header")
            if self.sync_writes:
                os.fdatasync(fd)
                fsync_dir(self._seg_dir)
        except BaseException:
            os.close(fd)
            remove_entry(path)
            raise
        seg = Segment(seg_id, path, fd, size_bytes, loaded=True)
        with self._mu:
            self._segments[seg_id] = seg
            self.allocated_bytes += size_bytes
        return seg

    def _finish(self, seg: Segment, offset: int, size: int, ok: bool) -> None:
        """Mark an extent written (or failed), then wait until the record may be visible:
        every extent before it written (and synced with sync_writes). A failure seals the
        segment with what was written, so records after the hole are found through its
        footer; raises OSError if such a record cannot be made findable."""
        if not seg.mark_written(offset, size, ok):  # this write failed, or one before it did
            with self._mu:
                if self._active is seg:
                    self._active = None
                if self._relocating is seg:
                    self._relocating = None
                seg.full = True
            self._seal_when_idle(seg)
            if not ok:
                return
            with seg.cond:
                if seg.seal_failed:
                    raise OSError(
                        errno.EIO, "NVMe segment could not be sealed after a failed write"
                    )
        if self.sync_writes:
            seg.commit_through(offset + size)

    def _seal_when_idle(self, seg: Segment) -> None:
        """Seal `seg` once no write to it is in flight (see Segment.seal_when_idle); a
        failure is logged and left in `seg.seal_failed`."""
        try:
            seg.seal_when_idle()
        except OSError as err:
            logger.warning("could not seal NVMe segment %s: %s", seg.path, err.strerror or err)

    # ---- reading ------------------------------------------------------------------------------
    def _locate(self, header: RecordHeader, location: int) -> tuple[Segment, int]:
        with self._mu:
            if location == NO_LOCATION:
                placed = self._placed.get((header.ns_id, header.key, header.generation))
                location = NO_LOCATION if placed is None else placed[0]
            seg_id, offset = unpack_location(location)
            seg = self._segments.get(seg_id) or self._retired.get(seg_id)
            if location == NO_LOCATION or seg is None:
                raise FileNotFoundError(errno.ENOENT, "no such record in the NVMe segments")
            if offset < ALIGN_BYTES or offset + header.record_bytes > seg.size_bytes:
                raise CorruptRecord("record location outside its segment")
            seg.readers += 1
        return seg, offset

    def _release(self, seg: Segment) -> None:
        with self._mu:
            seg.readers -= 1
            close = seg.retired and not seg.readers and time.monotonic() >= seg.close_after_s
            if close:
                self._retired.pop(seg.seg_id, None)
        if close:
            os.close(seg.fd)

    def _read_record(
        self, header: RecordHeader, iov: list[memoryview], location: int = NO_LOCATION
    ) -> None:
        """Fill `iov` (the record's size) from where the record lies in its segment (the
        record's own header and checksum are verified by the caller, so a stale or lying
        location is a miss, never wrong bytes)."""
        seg, offset = self._locate(header, location)
        try:
            if failpoints.ACTIVE:
                failpoints.fire("nvme.read")
            done, size = 0, header.record_bytes
            while done < size:
                got = os.preadv(seg.fd, iov, offset + done)
                if got <= 0:
                    raise CorruptRecord("record ended early")
                done += got
                advance(iov, got)
        finally:
            self._release(seg)

    # ---- removing ------------------------------------------------------------------------------
    def remove(self, header: RecordHeader, location: int = NO_LOCATION) -> None:
        """Take a record out: a tombstone (its bytes stay in the segment until reclaimed,
        so without one a restart would find it again), its room counted dead. `location`:
        where the owner had it (NO_LOCATION: a record the tier holds itself)."""
        if failpoints.ACTIVE:
            failpoints.fire("nvme.remove")
        rid = (header.ns_id, header.key, header.generation)
        self._append_tombstone(header.ns_id, header.key, header.generation)
        with self._mu:
            placed = self._placed.get(rid)
            if placed is not None and location in (NO_LOCATION, placed[0]):
                del self._placed[rid]
                location = placed[0]
            if location != NO_LOCATION:
                self._count_dead_locked(location, header.record_bytes)
        self._reclaim_wake.set()

    def _append_tombstone(self, ns_id: str, key: bytes, generation: int) -> None:
        """A tombstone in the live log, not synced: as durable as the file layout's unlink
        (survives a SIGKILL; with sync_writes the deletes that are acknowledged sync)."""
        entry = tombstone_entry(ns_id, key, generation)
        assert self._tombstone_fd is not None, "open() the tier first"
        with self._tombstone_lock:
            if os.write(self._tombstone_fd, entry) != len(entry):
                raise OSError(errno.EIO, "short write to the tombstone log")

    def _count_dead_locked(self, location: int, record_bytes: int) -> None:
        seg = self._segments.get(unpack_location(location)[0])
        if seg is not None:
            seg.count_dead(record_bytes)

    # ---- reclaiming ------------------------------------------------------------------------------
    def _reclaim_forever(self) -> None:
        while not self._closing.is_set():
            self._reclaim_wake.wait(_RECLAIM_POLL_S)
            self._reclaim_wake.clear()
            if self._closing.is_set():
                return
            try:
                self.reclaim()
            except OSError as err:
                if self._closing.is_set():
                    return  # the owner stopped answering because the tier is closing
                logger.warning("NVMe segment reclaim failed: %s", err.strerror or err)
                time.sleep(_RECLAIM_POLL_S)
            except Exception:  # the reclaimer must outlive any one failure
                logger.exception("NVMe segment reclaim failed")
                time.sleep(_RECLAIM_POLL_S)

    def reclaim(self, force: bool = False) -> int:
        """Empty sealed segments while the tier is within two segments of its limit (or, with
        `force`, every sealed one with a dead byte): those without live records deleted,
        the emptiest one's live records re-appended first. Returns segments reclaimed."""
        if not (self._recovered.is_set() and self._owner_ready.is_set()):
            return 0
        done = 0
        with self._reclaim_lock:
            self._close_retired()
            with self._mu:
                before = set(self._segments)  # `force` ends: copies land in newer ones
            while not self._closing.is_set():
                done += self._retire_emptied()
                with self._mu:
                    pressed = self.allocated_bytes + 2 * self.segment_bytes > self.disk_limit_bytes
                    candidates = [
                        s
                        for s in self._segments.values()
                        if s.sealed
                        and s.loaded
                        and not s.pending
                        and not s.seal_failed
                        and s is not self._active
                        and s is not self._relocating
                        and s.live_bytes < s.stored_bytes
                        and (not force or s.seg_id in before)
                    ]
                    half_full = self.allocated_bytes > self.disk_limit_bytes // 2
                if not candidates:
                    break
                victim = min(candidates, key=lambda s: s.live_bytes / max(1, s.stored_bytes))
                live_share = victim.live_bytes / max(1, victim.stored_bytes)
                # Under pressure anything but a nearly full segment is worth emptying; on a
                # tier past half full, a segment at most half live is (copying its live
                # half frees the other: write amplification at most 2 for it).
                if not (
                    force or (pressed and live_share <= 0.9) or (half_full and live_share <= 0.5)
                ):
                    break
                before.discard(victim.seg_id)
                self._relocate(victim)
                done += 1
        return done

    def _retire_emptied(self) -> int:
        """Delete the sealed segments the removals say hold no live record, once the owner
        agrees (a live one it names is re-appended first: the counts are not trusted with
        a block)."""
        with self._mu:
            empty = [s for s in self._segments.values() if self._emptied(s)]
        for seg in empty:
            self._relocate(seg)
        return len(empty)

    def _emptied(self, seg: Segment) -> bool:
        return (
            seg.sealed
            and seg.loaded
            and not seg.live_count
            and not seg.pending
            and seg is not self._active
            and seg is not self._relocating
            and seg.seg_id in self._segments
        )

    def _entries_of(self, seg: Segment) -> list[tuple[int, RecordHeader]]:
        """Every record a sealed segment lists (its footer; a segment sealed without room
        for one is scanned)."""
        # A buffered descriptor of its own: the tier's may be O_DIRECT (aligned I/O only).
        fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            entries = read_footer(fd, seg.seg_id, seg.size_bytes)
            if entries is None:
                entries = scan_records(fd, seg.size_bytes).entries
        finally:
            os.close(fd)
        return entries

    def _live_of(self, seg: Segment) -> list[tuple[int, RecordHeader]]:
        """The records of `seg` still held (by the tier itself or its owner) there."""
        out: list[tuple[int, RecordHeader]] = []
        entries = self._entries_of(seg)
        for start in range(0, len(entries), _OWNER_CHUNK):
            chunk = entries[start : start + _OWNER_CHUNK]
            locations = [pack_location(seg.seg_id, off) for off, _ in chunk]
            asked: list[int] = []
            with self._mu:
                for i, (off, h) in enumerate(chunk):
                    placed = self._placed.get((h.ns_id, h.key, h.generation))
                    if placed is not None:
                        if placed[0] == locations[i]:
                            out.append((off, h))
                    else:
                        asked.append(i)
            if asked and self._owner is not None:
                held = self._owner.live([chunk[i][1] for i in asked], [locations[i] for i in asked])
                out.extend(chunk[i] for i, yes in zip(asked, held, strict=True) if yes)
        return out

    def _publish(self, moves: list[tuple[RecordHeader, int, Segment, int]]) -> None:
        """Tell whoever holds each relocated record its new place; a copy nobody takes
        (removed while it was copied: tombstoned) is counted dead where it landed."""
        for start in range(0, len(moves), _OWNER_CHUNK):
            chunk = moves[start : start + _OWNER_CHUNK]
            news = [pack_location(seg.seg_id, off) for _, _, seg, off in chunk]
            asked: list[int] = []
            taken = [False] * len(chunk)
            with self._mu:
                for i, (h, old, _, _) in enumerate(chunk):
                    rid = (h.ns_id, h.key, h.generation)
                    placed = self._placed.get(rid)
                    if placed is None:
                        asked.append(i)
                    elif placed[0] == old:
                        self._placed[rid] = (news[i], h)
                        taken[i] = True
            if asked and self._owner is not None:
                got = self._owner.moved(
                    [chunk[i][0] for i in asked],
                    [chunk[i][1] for i in asked],
                    [news[i] for i in asked],
                )
                for i, yes in zip(asked, got, strict=True):
                    taken[i] = yes
            with self._mu:
                for (h, _, seg, _), yes in zip(chunk, taken, strict=True):
                    if not yes:
                        seg.count_dead(h.record_bytes)

    def _relocate(self, victim: Segment) -> None:
        """Re-append the records of `victim` still held (each checked first: a damaged one
        is dropped, not copied), make the copies durable, publish the moves, then delete
        it."""
        live = self._live_of(victim)
        buf: mmap.mmap | None = None
        touched: set[Segment] = set()
        moves: list[tuple[RecordHeader, int, Segment, int]] = []
        for offset, header in live:
            if failpoints.ACTIVE:
                failpoints.fire("segment.relocate")
            if buf is None or len(buf) < header.record_bytes:
                buf = aligned_buffer(header.record_bytes)
            view = memoryview(buf)[: header.record_bytes]
            try:
                _pread_exact(victim.fd, view, offset)
                verify_record(
                    view[: header.header_bytes], view[header.header_bytes :], header, None
                )
            except (CorruptRecord, OSError) as err:
                logger.warning("dropping an unreadable record while reclaiming: %s", err)
                continue
            seg, new_offset = self._append(header, [view], relocating=True)
            touched.add(seg)
            moves.append((header, pack_location(victim.seg_id, offset), seg, new_offset))
            with self._mu:
                self.relocated_bytes += header.record_bytes
        for seg in touched:  # the copies survive a power loss before the originals go
            os.fdatasync(seg.fd)
        if failpoints.ACTIVE:
            failpoints.fire("segment.reclaim")
        self._publish(moves)
        with self._mu:
            self._retire_locked(victim)
        logger.debug(
            "reclaimed NVMe segment %s: %d live records re-appended", victim.path, len(live)
        )

    def _retire(self, seg: Segment, delete: bool) -> None:
        with self._mu:
            self._retire_locked(seg, delete)

    def _retire_locked(self, seg: Segment, delete: bool = True) -> None:
        """Forget a segment and delete its file (its fd closed once no read uses it)."""
        if self._segments.pop(seg.seg_id, None) is None:
            return
        self.allocated_bytes -= seg.size_bytes
        self.reclaimed_segments += 1
        if delete:
            remove_entry(seg.path)
        seg.retired = True
        # A read may have taken a location in it just before its records moved: the
        # unlinked file keeps serving (verified) bytes for a few seconds.
        seg.close_after_s = time.monotonic() + _RETIRED_GRACE_S
        self._retired[seg.seg_id] = seg

    def _close_retired(self, now_s: float | None = None) -> None:
        """Close the descriptors of deleted segments past their grace with no read."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._mu:
            done = [s for s in self._retired.values() if not s.readers and now_s >= s.close_after_s]
            for seg in done:
                del self._retired[seg.seg_id]
        for seg in done:
            os.close(seg.fd)

    # ---- stopping ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the reclaimer, seal the active segment (the next start reads its footer),
        close every file."""
        self._closing.set()
        self._reclaim_wake.set()
        if self._reclaimer is not None:
            self._reclaimer.join(timeout=30)
            self._reclaimer = None
        with self._mu:
            active = [s for s in (self._active, self._relocating) if s is not None]
            self._active = self._relocating = None
        for seg in active:
            seg.full = True
            self._seal_when_idle(seg)
        with self._mu:
            for seg in self._retired.values():
                seg.close_after_s = 0.0
        self._close_retired()
        with self._mu:
            for seg in list(self._segments.values()):
                self._segments.pop(seg.seg_id)
                seg.retired = True
                if not seg.readers:
                    os.close(seg.fd)
            self._placed.clear()
        super().close()

    def record_locations(self) -> list[tuple[str, int, RecordHeader]]:
        """(segment file, offset, header) of every record the tier holds itself (for tests
        and tools: with an owner, the owner's records are the owner's to list)."""
        with self._mu:
            out = []
            for location, header in self._placed.values():
                seg_id, offset = unpack_location(location)
                seg = self._segments.get(seg_id)
                if seg is not None:
                    out.append((seg.path, offset, header))
            return out


def _contiguous(
    run: list[tuple[int, int]], headers: Sequence[RecordHeader]
) -> Iterator[list[tuple[int, int]]]:
    """`run` ((index, offset) in reservation order) cut where an extent does not start at
    the end of the one before (another writer reserved in between)."""
    piece = [run[0]]
    for index, offset in run[1:]:
        last_index, last_offset = piece[-1]
        if offset != last_offset + headers[last_index].record_bytes:
            yield piece
            piece = []
        piece.append((index, offset))
    yield piece


def _pwrite_at(fd: int, iov: list[memoryview | mmap.mmap], total: int, offset: int) -> None:
    """Write `iov` (`total` bytes) at `offset`, continuing after short writes (the
    nvme.pwrite failpoint acts one out, as the file layout's writer does)."""
    done = 0
    views = [memoryview(b) for b in iov]
    while done < total:
        if failpoints.ACTIVE and failpoints.fire("nvme.pwrite") == "short":
            part = max(ALIGN_BYTES, (len(views[0]) // 2) & ~(ALIGN_BYTES - 1))
            written = os.pwritev(fd, [views[0][:part]], offset + done)
        else:
            written = os.pwritev(fd, views, offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += written
        advance(views, written)


def _pread_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CorruptRecord("record ended early")
        done += got


def payload_checksum(data: bytes) -> int:
    """The xxh3 a record header carries for `data` (re-exported for tests)."""
    return payload_xxh3(data)


def _newest(
    parts: list[tuple[Segment, FooterColumns]],
    tombstones: dict[tuple[str, bytes], int],
    report: RecoveryReport,
) -> tuple[list[np.ndarray], list[tuple[str, bytes, int]]] | None:
    """The rows to keep of each part (every block's newest record, the first loaded of
    equal generations as the per-record path keeps, not covered by a tombstone; the
    dropped ones counted in `report`) and the tombstones that still cover a record (to
    carry). None if two distinct blocks share a key digest (the caller then chooses per
    record)."""
    seeds: dict[str, int] = {}

    def seed(name: str) -> int:
        got = seeds.get(name)
        if got is None:
            got = seeds[name] = xxhash.xxh3_64_intdigest(name.encode())
        return got

    digests: list[np.ndarray] = []
    for _, cols in parts:
        view = memoryview(cols.blob)
        ns_seeds = [seed(n) for n in cols.ns_names]
        h = xxhash.xxh3_64_intdigest
        digests.append(
            np.fromiter(
                (
                    h(view[o : o + n], ns_seeds[s])
                    for o, n, s in zip(
                        cols.key_off.tolist(), cols.key_len.tolist(), cols.ns.tolist(), strict=True
                    )
                ),
                dtype=np.uint64,
                count=len(cols),
            )
        )
    sizes = [len(cols) for _, cols in parts]
    total = sum(sizes)
    part_of = np.repeat(np.arange(len(parts), dtype=np.int64), sizes)
    row_of = (
        np.concatenate([np.arange(n, dtype=np.int64) for n in sizes])
        if parts
        else np.zeros(0, np.int64)
    )
    digest = np.concatenate(digests) if parts else np.zeros(0, np.uint64)
    gen = np.concatenate([c.generation for _, c in parts]) if parts else np.zeros(0, np.uint64)

    def ident(i: int) -> tuple[str, bytes]:
        _, cols = parts[int(part_of[i])]
        row = int(row_of[i])
        return cols.ns_names[int(cols.ns[row])], cols.key(row)

    # Tombstones: only records whose digest a tombstone's matches are compared in full.
    dead = np.zeros(total, dtype=bool)
    covered: dict[tuple[str, bytes], int] = {}
    if tombstones:
        tomb = np.fromiter(
            (xxhash.xxh3_64_intdigest(key, seed(ns)) for ns, key in tombstones),
            dtype=np.uint64,
            count=len(tombstones),
        )
        for i in np.nonzero(np.isin(digest, tomb))[0].tolist():
            who = ident(i)
            dead_up_to = tombstones.get(who, 0)
            if int(gen[i]) <= dead_up_to:
                dead[i] = True
                covered[who] = dead_up_to
    report.dropped_deleted = int(dead.sum())
    alive = np.nonzero(~dead)[0]
    # Newest first within a digest, then load order: the first of each digest wins.
    order = alive[np.lexsort((alive, ~gen[alive], digest[alive]))]
    d = digest[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = d[1:] != d[:-1]
    winners = order[first]
    report.dropped_stale = len(order) - len(winners)
    # Records that share a winner's digest must be the same block (else: a collision).
    group_start = np.cumsum(first) - 1
    for j in np.nonzero(~first)[0].tolist():
        if ident(int(order[j])) != ident(int(winners[group_start[j]])):
            return None
    winners.sort()
    parts_of_winners = part_of[winners]
    rows = [row_of[winners[parts_of_winners == p]] for p in range(len(parts))]
    return rows, [(ns, key, g) for (ns, key), g in covered.items()]
