"""One segment file of the NVMe segment layout while the tier holds it: what is in it (its
live records, their bytes) and the write protocol on it — extents reserved back to back,
the prefix of them completely written, one fdatasync for many records (group commit), and
sealing (footer, then trailer, synced in that order). Why visibility is a prefix, and which
segment is appended to, rotated, reclaimed or recovered, is the tier's
(kvtier/tiers/segments.py); the bytes of the footer and trailer are
kvtier/tiers/segment_format.py's.

Per segment only aggregates are kept (live and stored bytes and counts), never a Python
object per record: where a record lies is its *location* (`pack_location`: segment id and
page), a u64 the catalog keeps beside the record's other fields (issue 22).

Locking: the tier's lock guards the accounting (`live_*`, `stored_*`, `pending`,
`readers`, reservations); the writers of one segment coordinate on its `cond`, which is
taken inside the tier's lock where both are held, never around it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier import failpoints
from kvtier.buffers import aligned_buffer
from kvtier.tiers.allocator import round_up
from kvtier.tiers.posix_io import pwrite_exact
from kvtier.tiers.record import ALIGN_BYTES, RecordHeader
from kvtier.tiers.segment_format import (
    EMPTY_FOOTER_BYTES,
    encode_footer_entry,
    encode_trailer,
    footer_into,
)

__all__ = ["NO_LOCATION", "RecordId", "Segment", "pack_location", "unpack_location"]

RecordId = tuple[str, bytes, int]  # namespace, key, generation: what a record file named
NO_LOCATION = 0  # segment ids start at 1, so no record lies at location 0
_PAGE_BITS = 32


def pack_location(seg_id: int, offset: int) -> int:
    """A record's location: its segment id over its page in the segment (offsets are whole
    pages; 2**32 pages is 16 TiB a segment, 2**32 segments a tier)."""
    return (seg_id << _PAGE_BITS) | (offset // ALIGN_BYTES)


def unpack_location(location: int) -> tuple[int, int]:
    """(segment id, byte offset) of a location."""
    return location >> _PAGE_BITS, (location & 0xFFFF_FFFF) * ALIGN_BYTES


@dataclass(eq=False, slots=True)
class Segment:
    """One segment file: aggregates of its records (`live_*`: those the owner still holds,
    as far as removals told; reclaim asks the owner rather than trust them), and while it
    is appended to, `log`: every record written to it this run, in order, for its footer.
    Writers coordinate on `cond`."""

    seg_id: int
    path: str
    fd: int
    size_bytes: int
    live_bytes: int = 0
    live_count: int = 0
    stored_bytes: int = 0  # of every record in it, live or dead
    stored_count: int = 0
    loaded: bool = False  # its records are known (recovered, or written by this run)
    sealed: bool = False  # its footer is written (or it is an earlier run's)
    pending: int = 0  # reserved records not yet published or failed (under the tier's lock)
    # ---- while active ----
    cond: threading.Condition = field(default_factory=threading.Condition)
    tail: int = ALIGN_BYTES  # next free offset
    footer_bytes: int = EMPTY_FOOTER_BYTES  # its footer, were it sealed now
    # (offset, its footer entry): encoded when reserved (`encode_footer_entry`), so that
    # the log is no objects for the garbage collector to walk; recovery's scanned
    # segments put (offset, header) here instead.
    log: list[tuple[int, bytes | RecordHeader]] = field(default_factory=list)
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
    close_after_s: float = 0.0  # retired: its descriptor kept for reads already dispatched

    def count_live(self, record_bytes: int, count: int = 1) -> None:
        """`count` records of `record_bytes` in all are live."""
        self.live_bytes += record_bytes
        self.live_count += count

    def count_dead(self, record_bytes: int) -> None:
        # Clamped: a removal told twice (a retry) must not make a segment look emptier
        # than it is (reclaim asks the owner anyway before it deletes anything).
        self.live_bytes = max(0, self.live_bytes - record_bytes)
        self.live_count = max(0, self.live_count - 1)

    def reserve_run(
        self, headers: Sequence[RecordHeader], order: Sequence[int], sizes: Sequence[int]
    ) -> list[tuple[int, int]]:
        """The next extents, back to back, for headers[order[0]], headers[order[1]], ...
        while each fits with its footer entry and the trailer page: (index, offset) of each
        one taken, in order; `sizes`: each header's record_bytes. The caller holds the
        tier's lock and has checked the segment is not full. A demotion batch's records
        in one pass over `cond`, each footer entry encoded once (its length is what the fit
        needs); a single record's is a run of one."""
        taken: list[tuple[int, int]] = []
        tail, footer, log = self.tail, self.footer_bytes, self.log
        limit = self.size_bytes - ALIGN_BYTES
        for index in order:
            size = sizes[index]
            entry = encode_footer_entry(tail, headers[index])
            if tail + size + round_up(footer + len(entry), ALIGN_BYTES) > limit:
                break
            log.append((tail, entry))
            taken.append((index, tail))
            tail += size
            footer += len(entry)
        if taken:
            self.pending += len(taken)
            self.stored_bytes += tail - self.tail
            self.stored_count += len(taken)
            self.tail, self.footer_bytes = tail, footer
            with self.cond:
                self.inflight += len(taken)
        return taken

    def mark_written(self, offset: int, size: int, ok: bool) -> bool:
        """Mark the extent at `offset` written (or failed), then wait until every extent
        before it is written too or one has failed; whether it is in the written prefix."""
        end = offset + size
        with self.cond:
            self.inflight -= 1
            if ok:
                self.done[offset] = size
                while self.done_upto in self.done:
                    self.done_upto += self.done.pop(self.done_upto)
            else:
                self.failed.add(offset)
                self.broken = True
            self.cond.notify_all()
            while ok and not self.broken and self.done_upto < end:
                self.cond.wait()
            return ok and self.done_upto >= end

    def commit_through(self, end: int) -> None:
        """Make every extent before `end` durable. One fdatasync covers every record written
        before it started: the first writer to need it syncs, the others wait for it."""
        with self.cond:
            while self.synced_upto < end:
                if self.syncing:
                    self.cond.wait()
                    continue
                self.syncing = True
                target = self.done_upto
                self.cond.release()
                try:
                    os.fdatasync(self.fd)
                except BaseException:
                    self.cond.acquire()
                    self.syncing = False
                    self.cond.notify_all()
                    raise
                self.cond.acquire()
                self.syncing = False
                self.synced_upto = max(self.synced_upto, target)
                self.cond.notify_all()

    def seal_when_idle(self) -> None:
        """Once no write to it is in flight, write its footer and trailer (one thread does;
        the others wait until it is done or has failed). An OSError is raised, once, to the
        thread that tried, after `seal_failed` is set and the waiters are woken."""
        with self.cond:
            while self.inflight:
                self.cond.wait()
            if self.sealing:
                while not (self.sealed or self.seal_failed):
                    self.cond.wait()
                return
            self.sealing = True
        try:
            self.write_footer()
        except OSError:
            with self.cond:
                self.seal_failed = True
                self.cond.notify_all()
            raise
        with self.cond:
            self.sealed = True
            self.cond.notify_all()

    def write_footer(self) -> None:
        """The footer of the records in `log` that were written, at `tail`, then the
        trailer in the last page, synced: a crash before the trailer leaves a segment that
        recovery scans."""
        if failpoints.ACTIVE:
            failpoints.fire("segment.seal")
        failed, log = self.failed, self.log

        entries = [
            e if isinstance(e, bytes) else encode_footer_entry(off, e)
            for off, e in log
            if off not in failed
        ]
        footer_at = self.tail
        buf, footer_len = footer_into(entries)
        del entries
        pwrite_exact(self.fd, buf, footer_at)
        with memoryview(buf) as view:
            fixed = encode_trailer(self.seg_id, footer_at, view[:footer_len])
        trailer = aligned_buffer(ALIGN_BYTES)
        trailer[: len(fixed)] = fixed
        os.fdatasync(self.fd)  # the footer before the trailer that points at it
        pwrite_exact(self.fd, trailer, self.size_bytes - ALIGN_BYTES)
        os.fdatasync(self.fd)
        self.log = []
