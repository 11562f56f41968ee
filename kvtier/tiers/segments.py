"""The NVMe tier as a log of segments (`nvme.layout = "segments"`): records appended to large
preallocated files instead of one file per record.

A million record files cost the kernel ~1.35 GB of inode and dentry cache and 80 s to
delete, and every record paid a file creation and a rename. Here a record is the same
checksummed record (kvtier/tiers/record.py: full key, generation, length, xxh3) written
at the tail of a segment, `segments/<id:016x>.kvs`:

    page 0               segment header: magic "KVTSEG01" | version u16 | 6 zero bytes |
                         segment id u64 | segment bytes u64 | xxh3 of those 32 bytes
    pages 1..            records, each a whole number of pages, back to back
    after the records    the footer, once sealed: magic "KVTSEGF1" | count u32 | entries
                         (offset u64, generation u64, payload u64, xxh3 u64, header u32,
                         codec u16, ns_len u16, key_len u16, namespace, key) | xxh3 u64
    last page            the trailer: magic "KVTSEGT1" | segment id u64 | footer offset u64 |
                         footer bytes u64 | footer xxh3 u64 | xxh3 of those 40 bytes

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

Reclaim (a background thread of the tier): segments without a live record are deleted at
once; when the segments come within two segments of `nvme.capacity_bytes` (or fill more
than half of it and one is at most half live) the sealed segment with the smallest live
share is emptied: its live
records (those the catalog still holds, i.e. the ones the policy kept) are re-appended,
the copies synced, then the segment deleted; `relocated_bytes` over `written_bytes` is
the write amplification. The room reclaim needs is kept back from the capacity the store
sees (`capacity_bytes` below the configured one by `reserve_bytes`).

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
import re
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvtier import failpoints
from kvtier.buffers import aligned_buffer
from kvtier.errors import ConfigError, CorruptRecord
from kvtier.tiers.allocator import round_up
from kvtier.tiers.crypto import RecordCipher
from kvtier.tiers.nvme import NvmeTier, fan_of, supports_o_direct
from kvtier.tiers.record import (
    ALIGN_BYTES,
    RecordHeader,
    decode_header,
    encode_header,
    payload_xxh3,
    verify_record,
)
from kvtier.tiers.safe_open import open_regular, private_dir, remove_entry
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
    "SegmentTier",
    "segment_bytes_for",
]

SEGMENTS_DIR = "segments"
SEGMENT_SUFFIX = ".kvs"
_NAME = re.compile(r"^([0-9a-f]{16})\.kvs$")
_SEG_MAGIC, _FOOTER_MAGIC, _TRAILER_MAGIC = b"KVTSEG01", b"KVTSEGF1", b"KVTSEGT1"
_SEG_VERSION = 1
_SEG_HEAD = struct.Struct("<8sH6xQQ")
_TRAILER = struct.Struct("<8sQQQQ")
_FOOTER_HEAD = struct.Struct("<8sI")
_ENTRY = struct.Struct("<QQQQIHHH")
_XXH3 = struct.Struct("<Q")
_MAX_SEGMENT_BYTES = 256 << 20
_MIN_SEGMENT_BYTES = 4 << 20
_LOAD_THREADS = 8  # segments whose footers (or records) are read at once at start
_RECLAIM_POLL_S = 1.0  # the reclaimer also looks this often without being woken
_SPACE_WAIT_S = 5.0  # a write at the limit waits this long for the reclaimer, then ENOSPC
_SPACE_POLL_S = 0.005


def segment_bytes_for(capacity_bytes: int) -> int:
    """A segment's size: 1/16 of the tier within [4 MiB, 256 MiB], whole pages. Large
    enough that files are few (4 TB: ~16 k), small enough that reclaim has choices."""
    size = min(_MAX_SEGMENT_BYTES, max(_MIN_SEGMENT_BYTES, capacity_bytes // 16))
    return size & ~(ALIGN_BYTES - 1)


def _entry_bytes(header: RecordHeader) -> int:
    return _ENTRY.size + len(header.ns_id.encode()) + len(header.key)


RecordId = tuple[str, bytes, int]  # namespace, key, generation: what a record file named


@dataclass(eq=False, slots=True)
class _Segment:
    """One segment file. `records`: its live records (offset, header); `log`: every record
    written to it this run, in order, for its footer. Writers coordinate on `cond`."""

    seg_id: int
    path: str
    fd: int
    size_bytes: int
    records: dict[RecordId, tuple[int, RecordHeader]] = field(default_factory=dict)
    live_bytes: int = 0
    stored_bytes: int = 0  # of every record in it, live or dead
    loaded: bool = False  # its records are known (recovered, or written by this run)
    sealed: bool = False  # its footer is written (or it is an earlier run's)
    pending: int = 0  # reserved records not yet published or failed (under the tier's lock)
    # ---- while active ----
    cond: threading.Condition = field(default_factory=threading.Condition)
    tail: int = ALIGN_BYTES  # next free offset
    footer_bytes: int = _FOOTER_HEAD.size + _XXH3.size  # its footer, were it sealed now
    log: list[tuple[int, RecordHeader]] = field(default_factory=list)
    inflight: int = 0  # reserved extents not yet written (or failed)
    done: dict[int, int] = field(default_factory=dict)  # finished extents past `done_upto`
    done_upto: int = ALIGN_BYTES  # every extent before is written
    synced_upto: int = ALIGN_BYTES
    syncing: bool = False
    sealing: bool = False  # a thread is writing its footer
    full: bool = False  # takes no more reservations
    broken: bool = False  # a write failed: sealed as soon as the writes in flight end
    seal_failed: bool = False
    failed: set[int] = field(default_factory=set)  # offsets whose write failed
    # ---- lifetime ----
    readers: int = 0
    retired: bool = False

    def fits(self, record_bytes: int, entry_bytes: int) -> bool:
        footer_end = round_up(self.footer_bytes + entry_bytes, ALIGN_BYTES)
        return self.tail + record_bytes + footer_end + ALIGN_BYTES <= self.size_bytes


@dataclass(slots=True)
class _Loaded:
    """What recovery read from one segment of an earlier run."""

    segment: _Segment
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
        self._where: dict[RecordId, _Segment] = {}
        self._segments: dict[int, _Segment] = {}
        # The segment callers append to, and the one reclaim copies into: apart, so that
        # callers at the limit cannot use up the room reclaim needs to free some.
        self._active: _Segment | None = None
        self._relocating: _Segment | None = None
        self._next_id = 1
        self._old: list[_Segment] = []  # earlier runs' segments, for `recover`
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
            match = _NAME.match(name)
            path = f"{self._seg_str}/{name}"
            if match is None:
                remove_entry(path)  # a stray: nothing this layout wrote
                continue
            seg_id = int(match.group(1), 16)
            try:
                opened = open_regular(path, self._flags(os.O_RDWR))
            except OSError as err:
                logger.warning("dropping unreadable segment %s: %s", name, err)
                remove_entry(path)
                continue
            seg = _Segment(seg_id, path, opened.fd, opened.info.st_size)
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
        tombstones = self._read_tombstones()
        report = RecoveryReport([], 0, 0, 0, 0, max(tombstones.values(), default=0))
        with ThreadPoolExecutor(_LOAD_THREADS, thread_name_prefix="kvtier-segload") as pool:
            loaded = list(pool.map(self._load, self._old))
        if self._stop_recovery.is_set():
            report.complete = False
            return report
        newest: dict[tuple[str, bytes], tuple[_Segment, int, RecordHeader]] = {}
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
        with self._mu:
            for (ns_id, key), (seg, offset, header) in newest.items():
                rid = (ns_id, key, header.generation)
                seg.records[rid] = (offset, header)
                seg.live_bytes += header.record_bytes
                self._where[rid] = seg
                report.max_generation = max(report.max_generation, header.generation)
                fan = fan_of(ns_id, key)
                scan = fans.get(fan)
                if scan is None:
                    scan = fans[fan] = FanScan(fan)
                scan.records.append(RecoveredRecord(header, f"{seg.path}@{offset}"))
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

    def _load(self, seg: _Segment) -> _Loaded:
        """One earlier segment's records: from its footer when its trailer is valid, else
        read one by one from the start until the first that fails (then sealed here, so the
        next start reads a footer)."""
        if self._stop_recovery.is_set():
            return _Loaded(seg, [], False, "recovery stopped")
        if failpoints.ACTIVE:
            failpoints.fire("nvme.recover_fan")
        fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            head = os.pread(fd, ALIGN_BYTES, 0)
            if len(head) < _SEG_HEAD.size + _XXH3.size:
                return _Loaded(seg, [], False, "shorter than a segment header")
            magic, version, seg_id, size_bytes = _SEG_HEAD.unpack_from(head)
            (digest,) = _XXH3.unpack_from(head, _SEG_HEAD.size)
            if (
                magic != _SEG_MAGIC
                or digest != xxhash.xxh3_64_intdigest(head[: _SEG_HEAD.size])
                or version != _SEG_VERSION
                or seg_id != seg.seg_id
            ):
                return _Loaded(seg, [], False, "bad segment header")
            seg.size_bytes = min(seg.size_bytes, size_bytes)
            entries = _read_footer(fd, seg)
            if entries is not None:
                return _Loaded(seg, entries, True)
            entries, tail = self._scan(fd, seg)
        finally:
            os.close(fd)
        self._seal_scanned(seg, entries, tail)
        return _Loaded(seg, entries, False)

    def _scan(self, fd: int, seg: _Segment) -> tuple[list[tuple[int, RecordHeader]], int]:
        """Complete records from page 1 on, up to the first torn or damaged one."""
        entries: list[tuple[int, RecordHeader]] = []
        pos = ALIGN_BYTES
        while pos + ALIGN_BYTES <= seg.size_bytes:
            try:
                head = os.pread(fd, ALIGN_BYTES, pos)
                header = decode_header(head + _rest_of_header(fd, head, pos))
                if pos + header.record_bytes > seg.size_bytes - ALIGN_BYTES:
                    break
                data = os.pread(fd, header.record_bytes, pos)
                if len(data) != header.record_bytes:
                    break
                view = memoryview(data)
                verify_record(
                    view[: header.header_bytes], view[header.header_bytes :], header, None
                )
            except CorruptRecord:
                break
            entries.append((pos, header))
            pos += header.record_bytes
        return entries, pos

    def _seal_scanned(
        self, seg: _Segment, entries: list[tuple[int, RecordHeader]], tail: int
    ) -> None:
        """Write the footer of a segment recovery had to scan, where the records end."""
        seg.tail = tail
        seg.log = list(entries)
        seg.footer_bytes = _FOOTER_HEAD.size + _XXH3.size + sum(_entry_bytes(h) for _, h in entries)
        if tail + round_up(seg.footer_bytes, ALIGN_BYTES) + ALIGN_BYTES > seg.size_bytes:
            seg.log = []
            return  # no room for one: scanned again at the next start
        try:
            self._write_footer(seg)
        except OSError as err:
            logger.warning("could not seal recovered segment %s: %s", seg.path, err)
        seg.log = []

    # ---- writing ------------------------------------------------------------------------------
    def write(self, header: RecordHeader, payload: Sequence[memoryview | mmap.mmap]) -> int:
        """Append one record; returns its size on disk once it is visible (and durable with
        sync_writes). `payload` as for NvmeTier.write."""
        if failpoints.ACTIVE:
            failpoints.fire("nvme.write")
        total = header.header_bytes + sum(len(b) for b in payload)
        if total != header.record_bytes:
            raise ValueError(f"payload buffers add up to {total}, expected {header.record_bytes}")
        head = encode_header(header, self._scratch(header.header_bytes, "head"))
        self._append(header, [head, *payload], relocating=False)
        with self._mu:
            self.written_bytes += total
        return total

    def _append(
        self, header: RecordHeader, iov: list[memoryview | mmap.mmap], relocating: bool
    ) -> _Segment:
        seg, offset = self._reserve(header, relocating)
        total = header.record_bytes
        rid = (header.ns_id, header.key, header.generation)
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
            seg.pending -= 1
            old = self._where.get(rid)
            if relocating and old is None:
                return seg  # removed while it was copied: the copy is dead (tombstoned)
            if old is not None:  # the original of a relocated copy, or a rewrite
                self._drop_locked(rid, old)
            seg.records[rid] = (offset, header)
            seg.live_bytes += total
            self._where[rid] = seg
        return seg

    def _reserve(self, header: RecordHeader, relocating: bool) -> tuple[_Segment, int]:
        """An extent of the active segment for this record (a new segment if it is full)."""
        size, entry = header.record_bytes, _entry_bytes(header)
        give_up_s: float | None = None
        while True:
            with self._mu:
                seg = self._relocating if relocating else self._active
                if seg is not None and not seg.full and seg.fits(size, entry):
                    offset = seg.tail
                    seg.tail += size
                    seg.footer_bytes += entry
                    seg.log.append((offset, header))
                    seg.pending += 1
                    seg.stored_bytes += size
                    with seg.cond:
                        seg.inflight += 1
                    return seg, offset
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

    def _rotate(self, full: _Segment | None, size: int, entry: int, relocating: bool) -> bool:
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

    def _set_active(self, seg: _Segment | None, relocating: bool) -> None:
        if relocating:
            self._relocating = seg
        else:
            self._active = seg

    def _create_segment(self, size_bytes: int) -> _Segment:
        with self._mu:
            seg_id = self._next_id
            self._next_id += 1
        path = f"{self._seg_str}/{seg_id:016x}{SEGMENT_SUFFIX}"
        fd = open_regular(path, self._flags(os.O_RDWR | os.O_CREAT | os.O_EXCL)).fd
        try:
            _preallocate(fd, size_bytes)
            head = aligned_buffer(ALIGN_BYTES)
            fixed = _SEG_HEAD.pack(_SEG_MAGIC, _SEG_VERSION, seg_id, size_bytes)
            head[: _SEG_HEAD.size] = fixed
            head[_SEG_HEAD.size : _SEG_HEAD.size + _XXH3.size] = _XXH3.pack(
                xxhash.xxh3_64_intdigest(fixed)
            )
            if os.pwritev(fd, [head], 0) != ALIGN_BYTES:
                raise OSError(errno.EIO, "short write of a segment header")
            if self.sync_writes:
                os.fdatasync(fd)
                fsync_dir(self._seg_dir)
        except BaseException:
            os.close(fd)
            remove_entry(path)
            raise
        seg = _Segment(seg_id, path, fd, size_bytes, loaded=True)
        with self._mu:
            self._segments[seg_id] = seg
            self.allocated_bytes += size_bytes
        return seg

    def _finish(self, seg: _Segment, offset: int, size: int, ok: bool) -> None:
        """Mark an extent written (or failed), then wait until the record may be visible:
        every extent before it written (and synced with sync_writes). A failure seals the
        segment with what was written, so records after the hole are found through its
        footer; raises OSError if such a record cannot be made findable."""
        end = offset + size
        with seg.cond:
            seg.inflight -= 1
            if ok:
                seg.done[offset] = size
                while seg.done_upto in seg.done:
                    seg.done_upto += seg.done.pop(seg.done_upto)
            else:
                seg.failed.add(offset)
                seg.broken = True
            seg.cond.notify_all()
            while ok and not seg.broken and seg.done_upto < end:
                seg.cond.wait()
            in_prefix = ok and seg.done_upto >= end
        if not in_prefix:  # this write failed, or one before it did
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
            self._group_commit(seg, end)

    def _group_commit(self, seg: _Segment, end: int) -> None:
        """One fdatasync covers every record written before it started: the first writer
        to need it syncs, the others wait for it."""
        with seg.cond:
            while seg.synced_upto < end:
                if seg.syncing:
                    seg.cond.wait()
                    continue
                seg.syncing = True
                target = seg.done_upto
                seg.cond.release()
                try:
                    os.fdatasync(seg.fd)
                except BaseException:
                    seg.cond.acquire()
                    seg.syncing = False
                    seg.cond.notify_all()
                    raise
                seg.cond.acquire()
                seg.syncing = False
                seg.synced_upto = max(seg.synced_upto, target)
                seg.cond.notify_all()

    def _seal_when_idle(self, seg: _Segment) -> None:
        """Once no write to `seg` is in flight, write its footer and trailer (one thread
        does; the others wait until it is done or has failed)."""
        with seg.cond:
            while seg.inflight:
                seg.cond.wait()
            if seg.sealing:
                while not (seg.sealed or seg.seal_failed):
                    seg.cond.wait()
                return
            seg.sealing = True
        try:
            self._write_footer(seg)
        except OSError as err:
            logger.warning("could not seal NVMe segment %s: %s", seg.path, err.strerror or err)
            with seg.cond:
                seg.seal_failed = True
                seg.cond.notify_all()
            return
        with seg.cond:
            seg.sealed = True
            seg.cond.notify_all()

    def _write_footer(self, seg: _Segment) -> None:
        """The footer of the records in `seg.log` that were written, at `seg.tail`, then the
        trailer in the last page, synced: a crash before the trailer leaves a segment that
        recovery scans."""
        if failpoints.ACTIVE:
            failpoints.fire("segment.seal")
        entries = [(off, h) for off, h in seg.log if off not in seg.failed]
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
        footer = body + _XXH3.pack(xxhash.xxh3_64_intdigest(body))
        footer_at = seg.tail
        buf = aligned_buffer(round_up(len(footer), ALIGN_BYTES))
        buf[: len(footer)] = footer
        _pwrite_exact(seg.fd, buf, footer_at)
        fixed = _TRAILER.pack(
            _TRAILER_MAGIC, seg.seg_id, footer_at, len(footer), xxhash.xxh3_64_intdigest(footer)
        )
        trailer = aligned_buffer(ALIGN_BYTES)
        trailer[: _TRAILER.size] = fixed
        trailer[_TRAILER.size : _TRAILER.size + _XXH3.size] = _XXH3.pack(
            xxhash.xxh3_64_intdigest(fixed)
        )
        os.fdatasync(seg.fd)  # the footer before the trailer that points at it
        _pwrite_exact(seg.fd, trailer, seg.size_bytes - ALIGN_BYTES)
        os.fdatasync(seg.fd)
        seg.log = []

    # ---- reading ------------------------------------------------------------------------------
    def _locate(self, header: RecordHeader) -> tuple[_Segment, int]:
        rid = (header.ns_id, header.key, header.generation)
        with self._mu:
            seg = self._where.get(rid)
            if seg is None:
                raise FileNotFoundError(errno.ENOENT, "no such record in the NVMe segments")
            offset = seg.records[rid][0]
            seg.readers += 1
        return seg, offset

    def _release(self, seg: _Segment) -> None:
        with self._mu:
            seg.readers -= 1
            close = seg.retired and not seg.readers
        if close:
            os.close(seg.fd)

    def _read_record(self, header: RecordHeader, iov: list[memoryview]) -> None:
        """Fill `iov` (the record's size) from where the record lies in its segment."""
        seg, offset = self._locate(header)
        try:
            if failpoints.ACTIVE:
                failpoints.fire("nvme.read")
            done, size = 0, header.record_bytes
            while done < size:
                got = os.preadv(seg.fd, iov, offset + done)
                if got <= 0:
                    raise CorruptRecord("record ended early")
                done += got
                _advance(iov, got)
        finally:
            self._release(seg)

    # ---- removing ------------------------------------------------------------------------------
    def remove(self, header: RecordHeader) -> None:
        """Take a record out: a tombstone (its bytes stay in the segment until reclaimed,
        so without one a restart would find it again), its room counted dead."""
        if failpoints.ACTIVE:
            failpoints.fire("nvme.remove")
        rid = (header.ns_id, header.key, header.generation)
        self._append_tombstone(header.ns_id, header.key, header.generation)
        with self._mu:
            seg = self._where.get(rid)
            if seg is not None:
                self._drop_locked(rid, seg)
        self._reclaim_wake.set()

    def _append_tombstone(self, ns_id: str, key: bytes, generation: int) -> None:
        """A tombstone in the live log, not synced: as durable as the file layout's unlink
        (survives a SIGKILL; with sync_writes the deletes that are acknowledged sync)."""
        entry = tombstone_entry(ns_id, key, generation)
        assert self._tombstone_fd is not None, "open() the tier first"
        with self._tombstone_lock:
            if os.write(self._tombstone_fd, entry) != len(entry):
                raise OSError(errno.EIO, "short write to the tombstone log")

    def _drop_locked(self, rid: RecordId, seg: _Segment) -> None:
        offset_header = seg.records.pop(rid, None)
        if offset_header is not None:
            seg.live_bytes -= offset_header[1].record_bytes
        if self._where.get(rid) is seg:
            del self._where[rid]

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
                logger.warning("NVMe segment reclaim failed: %s", err.strerror or err)
                time.sleep(_RECLAIM_POLL_S)
            except Exception:  # the reclaimer must outlive any one failure
                logger.exception("NVMe segment reclaim failed")
                time.sleep(_RECLAIM_POLL_S)

    def reclaim(self, force: bool = False) -> int:
        """Empty sealed segments while the tier is within two segments of its limit (or, with
        `force`, every sealed one with a dead byte): those without live records deleted,
        the emptiest one's live records re-appended first. Returns segments reclaimed."""
        if not self._recovered.is_set():
            return 0
        done = 0
        with self._reclaim_lock:
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
        """Delete the sealed segments without a live record: free, nothing to read."""
        with self._mu:
            empty = [s for s in self._segments.values() if self._emptied(s)]
        if empty and failpoints.ACTIVE:
            failpoints.fire("segment.reclaim")
        with self._mu:
            empty = [s for s in empty if self._emptied(s)]  # none revived meanwhile
            for seg in empty:
                self._retire_locked(seg)
        return len(empty)

    def _emptied(self, seg: _Segment) -> bool:
        return (
            seg.sealed
            and seg.loaded
            and not seg.records
            and not seg.pending
            and seg is not self._active
            and seg is not self._relocating
            and seg.seg_id in self._segments
        )

    def _relocate(self, victim: _Segment) -> None:
        """Re-append the live records of `victim` (each checked first: a damaged one is
        dropped, not copied), make the copies durable, then delete it."""
        with self._mu:
            live = list(victim.records.items())
        buf: mmap.mmap | None = None
        touched: set[_Segment] = set()
        for _rid, (offset, header) in live:
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
            touched.add(self._append(header, [view], relocating=True))
            with self._mu:
                self.relocated_bytes += header.record_bytes
        for seg in touched:  # the copies survive a power loss before the originals go
            os.fdatasync(seg.fd)
        if failpoints.ACTIVE:
            failpoints.fire("segment.reclaim")
        with self._mu:
            for rid in list(victim.records):
                self._drop_locked(rid, victim)  # removed or dropped while copying
            self._retire_locked(victim)
        logger.debug(
            "reclaimed NVMe segment %s: %d live records re-appended", victim.path, len(live)
        )

    def _retire(self, seg: _Segment, delete: bool) -> None:
        with self._mu:
            self._retire_locked(seg, delete)

    def _retire_locked(self, seg: _Segment, delete: bool = True) -> None:
        """Forget a segment and delete its file (its fd closed once no read uses it)."""
        if self._segments.pop(seg.seg_id, None) is None:
            return
        self.allocated_bytes -= seg.size_bytes
        self.reclaimed_segments += 1
        if delete:
            remove_entry(seg.path)
        seg.retired = True
        if not seg.readers:
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
            for seg in list(self._segments.values()):
                self._segments.pop(seg.seg_id)
                seg.retired = True
                if not seg.readers:
                    os.close(seg.fd)
            self._where.clear()
        super().close()

    def record_locations(self) -> list[tuple[str, int, RecordHeader]]:
        """(segment file, offset, header) of every live record (for tests and tools)."""
        with self._mu:
            return [
                (seg.path, offset, header)
                for seg in self._segments.values()
                for offset, header in seg.records.values()
            ]


def _read_footer(fd: int, seg: _Segment) -> list[tuple[int, RecordHeader]] | None:
    """A sealed segment's records from its footer; None if its trailer or footer fails
    its checksum (the segment is then scanned)."""
    tail = os.pread(fd, ALIGN_BYTES, seg.size_bytes - ALIGN_BYTES)
    if len(tail) < _TRAILER.size + _XXH3.size:
        return None
    fixed = tail[: _TRAILER.size]
    (digest,) = _XXH3.unpack_from(tail, _TRAILER.size)
    magic, seg_id, footer_at, footer_bytes, footer_xxh3 = _TRAILER.unpack(fixed)
    if magic != _TRAILER_MAGIC or digest != xxhash.xxh3_64_intdigest(fixed):
        return None
    if seg_id != seg.seg_id or footer_at + footer_bytes > seg.size_bytes - ALIGN_BYTES:
        return None
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


def _rest_of_header(fd: int, first_page: bytes, pos: int) -> bytes:
    """The rest of a header region longer than a page (long keys)."""
    if len(first_page) < 24:
        return b""
    header_bytes = struct.unpack_from("<I", first_page, 12)[0]
    if ALIGN_BYTES < header_bytes <= 64 << 10:
        return os.pread(fd, header_bytes - ALIGN_BYTES, pos + ALIGN_BYTES)
    return b""


def _preallocate(fd: int, size_bytes: int) -> None:
    """Reserve the segment's blocks now (ENOSPC here, not mid-record); where the file
    system cannot, a sparse file of that size."""
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size_bytes)


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
        _advance(views, written)


def _pwrite_exact(fd: int, buf: mmap.mmap, offset: int) -> None:
    view = memoryview(buf)
    done = 0
    while done < len(view):
        written = os.pwritev(fd, [view[done:]], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += written


def _pread_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CorruptRecord("record ended early")
        done += got


def _advance(iov: list[memoryview], done_bytes: int) -> None:
    while iov and done_bytes >= len(iov[0]):
        done_bytes -= len(iov[0])
        iov.pop(0)
    if done_bytes:
        iov[0] = iov[0][done_bytes:]


def payload_checksum(data: bytes) -> int:
    """The xxh3 a record header carries for `data` (re-exported for tests)."""
    return payload_xxh3(data)
