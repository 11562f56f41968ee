"""The segment layout's tier below recovery and reclaim: its state, and writing, reading,
removing and closing records (the layout, and what keeps a torn record invisible, are
described in kvtier/tiers/segments.py)."""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from kvtier import failpoints
from kvtier.buffers import aligned_buffer
from kvtier.errors import ConfigError, CorruptRecord
from kvtier.index.reclaim import reserve_bytes_for, segment_bytes_fitting, segment_bytes_for
from kvtier.tiers.crypto import RecordCipher
from kvtier.tiers.nvme import NvmeTier, Placed
from kvtier.tiers.posix_io import advance, preallocate, pwritev_all
from kvtier.tiers.record import (
    ALIGN_BYTES,
    RecordHeader,
    encode_header,
    payload_xxh3,
)
from kvtier.tiers.record_batch import encode_headers
from kvtier.tiers.safe_open import open_regular, remove_entry
from kvtier.tiers.segment_file import (
    NO_LOCATION,
    RecordId,
    Segment,
    pack_location,
    unpack_location,
)
from kvtier.tiers.segment_format import (
    encode_segment_header,
    entry_bytes,
    segment_name,
)
from kvtier.tiers.startup import (
    fsync_dir,
    tombstone_entry,
)

logger = logging.getLogger(__name__)

SEGMENTS_DIR = "segments"
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


class SegmentCore(NvmeTier):
    """The segment tier's state, and writing, reading, removing and closing records;
    recovery (kvtier/tiers/segment_recovery.py) and reclaim (SegmentTier) build on it."""

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
        self.reserve_bytes = reserve_bytes_for(capacity_bytes, self.segment_bytes)
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

    def _reclaim_forever(self) -> None:
        """The reclaimer thread's loop, started by `prepare` (SegmentTier's)."""
        raise NotImplementedError

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
        self.settle_many((location,))

    def settle_many(self, locations: Sequence[int]) -> None:
        """`settle` of each location, under one hold of the lock (a demotion batch's,
        on the loop: most lie in one segment)."""
        if not locations:
            return
        with self._mu:
            segments = self._segments
            for location in locations:
                seg = segments.get(unpack_location(location)[0])
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
        # Each header's sizes read once (Python a record here holds the GIL the loop needs).
        sizes, starts, at = [], [], 0
        for header, payload in zip(headers, payloads, strict=True):
            size, header_bytes = header.record_bytes, header.header_bytes
            total = header_bytes + sum(map(len, payload))
            if total != size:
                raise ValueError(f"payload buffers add up to {total}, expected {size}")
            sizes.append(size)
            starts.append(at)
            at += header_bytes
        todo = _past_failpoint("nvme.write", len(headers), results.__setitem__)
        # The batch's record headers side by side in one aligned buffer of the thread's
        # (each record of the batch needs its own until written; a fresh mapping a batch
        # cost ~6 µs a record in page faults and unmapping: `_scratch`).
        heads = self._scratch(max(at, ALIGN_BYTES), "heads")
        encode_headers(heads, starts, headers)  # in one call (record_batch)
        ends = [*starts[1:], at]
        iovs: list[list[memoryview | mmap.mmap]] = [
            [heads[start:end], *payload]
            for start, end, payload in zip(starts, ends, payloads, strict=True)
        ]
        pos = 0
        while pos < len(todo):
            run: list[tuple[int, int]] = []
            with self._mu:  # as many as fit the active segment, back to back
                active = self._active
                if active is not None and not active.full:
                    seg, run = active, active.reserve_run(headers, todo[pos:], sizes)
            if not run:
                try:  # the next one as `write` takes it: rotating, waiting for room
                    seg, offset = self._reserve(headers[todo[pos]], relocating=False)
                except OSError as err:  # no room for this one: none for those after it either
                    for i in todo[pos:]:
                        results[i] = err
                    break
                run = [(todo[pos], offset)]
            pos += len(run)
            # Each piece written and finished before the next is reserved: a failure seals
            # the segment once no reservation is in flight, so a thread must never hold
            # one it has not written yet while it finishes another (it would wait for
            # itself, and every writer of the segment with it).
            self._write_piece(seg, run, headers, sizes, iovs, results)
        return results

    def _write_piece(
        self,
        seg: Segment,
        piece: list[tuple[int, int]],
        headers: Sequence[RecordHeader],
        sizes: Sequence[int],
        iovs: list[list[memoryview | mmap.mmap]],
        results: list[Placed | OSError],
    ) -> None:
        """Write and publish records reserved back to back in `seg` ((index, offset) in
        order; `sizes`: each header's record_bytes), finishing them as one extent (see
        `write_many`)."""
        first_offset = piece[0][1]
        size = sum(sizes[i] for i, _ in piece)
        with seg.cond:  # reserved one by one, finished as one
            seg.inflight -= len(piece) - 1
        try:
            try:
                chunk = [buffer for i, _ in piece for buffer in iovs[i]]
                if len(chunk) <= _IOV_MAX:  # a demotion batch's: one call
                    pwritev_all(seg.fd, chunk, size, first_offset)
                else:
                    chunk, chunk_at, chunk_bytes = [], first_offset, 0
                    for i, _ in piece:
                        if chunk and len(chunk) + len(iovs[i]) > _IOV_MAX:
                            pwritev_all(seg.fd, chunk, chunk_bytes, chunk_at)
                            chunk, chunk_at, chunk_bytes = [], chunk_at + chunk_bytes, 0
                        chunk += iovs[i]
                        chunk_bytes += sizes[i]
                    pwritev_all(seg.fd, chunk, chunk_bytes, chunk_at)
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
            seg.count_live(size, len(piece))  # `pending` stays up until settled
            self.written_bytes += size
        seg_id = seg.seg_id
        for i, offset in piece:
            results[i] = Placed(sizes[i], pack_location(seg_id, offset))

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
                pwritev_all(seg.fd, list(iov), total, offset)
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
                if seg is not None and not seg.full:
                    run = seg.reserve_run((header,), (0,), (size,))
                    if run:
                        return seg, run[0][1]
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
            # A whole number of records of this one's size: records of one size (an
            # engine's blocks) leave no slack the store would count as free.
            seg_bytes = segment_bytes_fitting(self.segment_bytes, size, entry)
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
            # Sealed after this write (the seal waited for it): the footer that lists it
            # and the trailer were synced. Not `commit_through`: the written prefix stops
            # at the hole, so with sync_writes it would wait for ever (it spun, syncing).
            return
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
        err = self.remove_many([(header, location)])[0]
        if err is not None:
            raise err

    def remove_many(self, removals: Sequence[tuple[RecordHeader, int]]) -> list[OSError | None]:
        """`remove` of each (header, location), their tombstones appended in one write and
        their room counted dead under one hold of the lock: a cache at its capacity evicts
        a record for every one it writes. Per record None or the OSError that failed it."""
        out: list[OSError | None] = [None] * len(removals)
        todo = _past_failpoint("nvme.remove", len(removals), out.__setitem__)
        entries = []
        for i in todo:
            header = removals[i][0]
            entries.append(tombstone_entry(header.ns_id, header.key, header.generation))
        try:
            self._append_tombstones(entries)
        except OSError as err:  # none of them is removed: the caller retries them all
            for i in todo:
                out[i] = err
            return out
        with self._mu:
            for i in todo:
                header, location = removals[i]
                rid = (header.ns_id, header.key, header.generation)
                placed = self._placed.get(rid)
                if placed is not None and location in (NO_LOCATION, placed[0]):
                    del self._placed[rid]
                    location = placed[0]
                if location != NO_LOCATION:
                    self._count_dead_locked(location, header.record_bytes)
        self._reclaim_wake.set()
        return out

    def _append_tombstone(self, ns_id: str, key: bytes, generation: int) -> None:
        self._append_tombstones([tombstone_entry(ns_id, key, generation)])

    def _append_tombstones(self, entries: list[bytes]) -> None:
        """Tombstones in the live log, not synced: as durable as the file layout's unlink
        (survives a SIGKILL; with sync_writes the deletes that are acknowledged sync)."""
        if not entries:
            return
        data = b"".join(entries)
        assert self._tombstone_fd is not None, "open() the tier first"
        with self._tombstone_lock:
            if os.write(self._tombstone_fd, data) != len(data):
                raise OSError(errno.EIO, "short write to the tombstone log")

    def _count_dead_locked(self, location: int, record_bytes: int) -> None:
        seg = self._segments.get(unpack_location(location)[0])
        if seg is not None:
            seg.count_dead(record_bytes)

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


def _past_failpoint(point: str, count: int, failed: Callable[[int, OSError], None]) -> list[int]:
    """The indices of a batch's `count` items past failpoint `point` (each fires it once);
    `failed(index, error)` for each one it failed."""
    todo = []
    for i in range(count):
        try:
            if failpoints.ACTIVE:
                failpoints.fire(point)
        except OSError as err:
            failed(i, err)
            continue
        todo.append(i)
    return todo


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
