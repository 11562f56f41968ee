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
`nvme.capacity_bytes` the sealed segment with the smallest live share (at most 90 % live)
is emptied: its live records (those the owner
still holds at the victim's location, i.e. the ones the policy kept) are re-appended, the
copies synced, the moves published to the owner (which takes each only where it still
names the old location), then the segment deleted — unlinked at once, its descriptor kept
a few seconds for reads that took the old location just before the move (their bytes are
still there, still verified); `relocated_bytes` over `written_bytes` is the write
amplification. The room reclaim needs is kept back from the capacity the store sees
(`capacity_bytes` below the configured one by `reserve_bytes`).

Which segment reclaim empties, and when, is kvtier/index/reclaim.py's rule (greedy, only
under pressure), as are segment sizes (a whole number of the record that opens one) and
the reserve: the replay models the layout's write amplification with the same functions.

Not done in this layout yet: encryption (refused at start with a message naming the
option) and a migration from the file layout (refused likewise). `kvtier wipe` rewrites
segments in place (kvtier/tiers/segment_wipe.py).
"""

from __future__ import annotations

import logging
import mmap
import os
import time

from kvtier import failpoints
from kvtier.buffers import aligned_buffer
from kvtier.errors import CorruptRecord
from kvtier.index.reclaim import reclaim_victim, segment_bytes_for
from kvtier.tiers.record import (
    RecordHeader,
    verify_record,
)
from kvtier.tiers.segment_core import (
    _OWNER_CHUNK,
    _RECLAIM_POLL_S,
    SEGMENTS_DIR,
    RecordOwner,
    _pread_exact,
)
from kvtier.tiers.segment_file import (
    Segment,
    pack_location,
)
from kvtier.tiers.segment_format import (
    read_footer,
    scan_records,
)
from kvtier.tiers.segment_recovery import SegmentRecovery
from kvtier.workers import lower_priority

logger = logging.getLogger(__name__)

__all__ = [
    "SEGMENTS_DIR",
    "RecordOwner",
    "SegmentTier",
    "segment_bytes_for",
]


class SegmentTier(SegmentRecovery):
    """The NVMe tier in segments (see the module docstring). The same lifecycle and
    methods as NvmeTier, whose start-up it shares (lock, epoch, tombstone logs): `open()`
    or `prepare()` -> `recover()` -> `compact_tombstones()`, then `write` / `read` /
    `read_into` / `remove` / `tombstone` from I/O threads, `close()` last. `reclaim()` runs
    one reclaim pass on the caller's thread (the tier's own thread does it otherwise)."""

    # ---- reclaiming ------------------------------------------------------------------------------
    def _reclaim_forever(self) -> None:
        lower_priority()
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
                if not candidates:
                    break
                by_id = {s.seg_id: s for s in candidates}
                chosen = reclaim_victim(
                    ((s.seg_id, s.live_bytes, s.stored_bytes) for s in candidates),
                    self.allocated_bytes,
                    self.segment_bytes,
                    self.disk_limit_bytes,
                    force,
                )
                if chosen is None:
                    break
                victim = by_id[chosen]
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
