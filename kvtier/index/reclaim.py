"""Which segment of the NVMe segment layout to empty next, and what that costs in writes.

The rule (`reclaim_victim`) is the segment tier's (kvtier/tiers/segments.py runs it on its
reclaim thread); `SegmentSpace` applies the same rule to a model of the layout's space, so
the replay (kvtier/sim) reports the write amplification a trace would cause without disks:
records appended to an open segment until it is full, dead when the policy evicts or a put
replaces them, and a sealed segment emptied by re-appending its live records.

Why this rule. Emptying a segment costs writing its live bytes again and frees its dead
ones, so the emptiest is always the best buy (greedy cleaning), and only when the room is
needed: when the tier is within two segments of its limit (`pressed`), anything but a
nearly full segment (live share <= 0.9) is emptied, else writes stall. Not sooner: a
segment whose records are dying (the oldest, under an eviction order close to FIFO) would
be copied for nothing. An earlier rule also emptied any segment at most half live once the
tier was past half full; measured with `SegmentSpace` (records of 1 MiB, a 1 GiB store
kept full, 20 k writes) it made FIFO eviction's write amplification 1.47 instead of 1.00,
and random eviction's was 4.70 either way. A segment without a live byte costs nothing
and goes at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

__all__ = [
    "SegmentSpace",
    "reclaim_victim",
    "reserve_bytes_for",
    "segment_bytes_fitting",
    "segment_bytes_for",
]

_PRESSED_LIVE_SHARE = 0.9
_MAX_SEGMENT_BYTES = 256 << 20
_MIN_SEGMENT_BYTES = 4 << 20
_PAGE_BYTES = 4096
# A segment's header page, trailer page, and the footer's head rounded up to whole pages.
_OVERHEAD_BYTES = 4 * _PAGE_BYTES


def segment_bytes_for(limit_bytes: int, record_bytes: int = 0, entry_bytes: int = 0) -> int:
    """A segment's size: 1/16 of the tier within [4 MiB, 256 MiB], whole pages. Large
    enough that files are few (4 TB: ~16 k), small enough that reclaim has choices.

    Given the record that opens it (`record_bytes`, and `entry_bytes` its footer entry),
    a whole number of such records and their footer entries, with room for the header page,
    the footer's own head and the trailer page: records of one size (an engine's blocks)
    then leave no slack at a segment's tail. Without it a 64 MiB block in 256 MiB segments
    left 64 MiB of every segment empty, a quarter of the disk the store counts as free."""
    size = min(_MAX_SEGMENT_BYTES, max(_MIN_SEGMENT_BYTES, limit_bytes // 16))
    return segment_bytes_fitting(size & ~(_PAGE_BYTES - 1), record_bytes, entry_bytes)


def segment_bytes_fitting(base_bytes: int, record_bytes: int, entry_bytes: int = 0) -> int:
    """The size of a segment of about `base_bytes` that a record of `record_bytes` (and
    `entry_bytes` of footer entry) opens: as many such records as fit, at least one, and
    the pages around them, nothing more (`base_bytes` itself when no record is given)."""
    if record_bytes <= 0:
        return base_bytes
    per_record = record_bytes + entry_bytes
    count = max(1, (base_bytes - _OVERHEAD_BYTES) // per_record)
    return -(-(count * per_record + _OVERHEAD_BYTES) // _PAGE_BYTES) * _PAGE_BYTES


def reserve_bytes_for(limit_bytes: int, segment_bytes: int) -> int:
    """The room reclaim needs, withheld from the capacity the store is told: a segment being
    filled, one being relocated into, one being emptied, and a margin so that reclaim
    starts before writes must wait for it."""
    return max(limit_bytes // 8, 4 * segment_bytes)


def reclaim_victim(
    candidates: Iterable[tuple[int, int, int]],
    allocated_bytes: int,
    segment_bytes: int,
    limit_bytes: int,
    force: bool = False,
) -> int | None:
    """Of `candidates` (segment id, live bytes, stored bytes: sealed segments, not being
    written, with at least one dead byte), the one to empty now, or None. `force`: the
    emptiest whatever the pressure (an operator's compaction)."""
    best: tuple[float, int] | None = None
    for seg_id, live_bytes, stored_bytes in candidates:
        share = live_bytes / max(1, stored_bytes)
        if best is None or share < best[0]:
            best = (share, seg_id)
    if best is None:
        return None
    share, seg_id = best
    pressed = allocated_bytes + 2 * segment_bytes > limit_bytes
    if force or (pressed and share <= _PRESSED_LIVE_SHARE):
        return seg_id
    return None


@dataclass(slots=True)
class _Segment:
    seg_id: int
    size_bytes: int
    stored_bytes: int = 0
    live_bytes: int = 0
    records: dict[Hashable, int] = field(default_factory=dict)  # live record -> bytes
    count: int = 0  # records appended (live or dead): their footer entries
    sealed: bool = False
    version: int = 0  # bumped at each change: older entries of the heap are stale


class SegmentSpace:
    """The segment layout's space, in bytes, with the tier's sizing and reclaim rules:
    `append` a record (a demotion or write-through), `remove` it (evicted, replaced,
    deleted); `write_amplification` is (bytes appended + bytes re-appended by reclaim) /
    bytes appended. `limit_bytes` is the tier's configured capacity, of which the store is
    told `store_bytes` (the reserve withheld): fed by a store that keeps its live bytes
    within that, the segments stay within the limit. `entry_bytes`: a record's footer
    entry. `for_store(capacity)`: the tier that would give a store that capacity."""

    @classmethod
    def for_store(cls, store_bytes: int, entry_bytes: int = 0) -> SegmentSpace:
        """The smallest configured capacity whose store capacity holds `store_bytes`."""
        limit = store_bytes
        while True:
            store = limit - reserve_bytes_for(limit, segment_bytes_for(limit))
            if store >= store_bytes:
                return cls(limit, entry_bytes)
            limit += max(_PAGE_BYTES, (store_bytes - store) // 2 + _PAGE_BYTES)

    def __init__(self, limit_bytes: int, entry_bytes: int = 0) -> None:
        self.limit_bytes = limit_bytes
        self.segment_bytes = segment_bytes_for(limit_bytes)
        if limit_bytes < 4 * self.segment_bytes:
            raise ValueError("the limit must hold at least 4 segments")
        self.entry_bytes = entry_bytes
        self.written_bytes = 0
        self.relocated_bytes = 0
        self.reclaimed_segments = 0
        self.allocated_bytes = 0
        self._segments: dict[int, _Segment] = {}
        self._where: dict[Hashable, _Segment] = {}
        self._next_id = 0
        self._active: _Segment | None = None
        self._relocating: _Segment | None = None  # opened by the first reclaim, as the tier's
        # Sealed segments with a dead byte by live share (lazily invalidated): the emptiest
        # is found without looking at every segment on every write.
        self._by_share: list[tuple[float, int, int]] = []

    @property
    def store_bytes(self) -> int:
        return self.limit_bytes - reserve_bytes_for(self.limit_bytes, self.segment_bytes)

    @property
    def write_amplification(self) -> float:
        if not self.written_bytes:
            return 1.0
        return (self.written_bytes + self.relocated_bytes) / self.written_bytes

    def append(self, rid: Hashable, record_bytes: int) -> None:
        """A record written (a rewrite of `rid` kills its old copy first)."""
        self.remove(rid)
        self._active = self._put(self._active, rid, record_bytes)
        self.written_bytes += record_bytes
        self._reclaim()

    def remove(self, rid: Hashable) -> None:
        seg = self._where.pop(rid, None)
        if seg is None:
            return
        seg.live_bytes -= seg.records.pop(rid)
        if seg.sealed and not seg.records:
            self._retire(seg)
        elif seg.sealed:
            self._rank(seg)

    def _rank(self, seg: _Segment) -> None:
        seg.version += 1
        share = seg.live_bytes / max(1, seg.stored_bytes)
        heapq.heappush(self._by_share, (share, seg.seg_id, seg.version))

    def _fits(self, seg: _Segment, record_bytes: int) -> bool:
        entries = (seg.count + 1) * self.entry_bytes
        return seg.stored_bytes + record_bytes + entries + _OVERHEAD_BYTES <= seg.size_bytes

    def _put(self, seg: _Segment | None, rid: Hashable, record_bytes: int) -> _Segment:
        """Append to `seg`, sealing it and opening the next when full; the open one."""
        if seg is None or not self._fits(seg, record_bytes):
            if seg is not None:
                seg.sealed = True
                if not seg.records:
                    self._retire(seg)
                elif seg.live_bytes < seg.stored_bytes:
                    self._rank(seg)
            size = segment_bytes_for(self.limit_bytes, record_bytes, self.entry_bytes)
            seg = _Segment(self._next_id, size)
            self._next_id += 1
            self._segments[seg.seg_id] = seg
            self.allocated_bytes += size
        seg.records[rid] = record_bytes
        seg.stored_bytes += record_bytes
        seg.live_bytes += record_bytes
        seg.count += 1
        self._where[rid] = seg
        return seg

    def _retire(self, seg: _Segment) -> None:
        del self._segments[seg.seg_id]
        self.allocated_bytes -= seg.size_bytes
        self.reclaimed_segments += 1

    def _reclaim(self) -> None:
        heap = self._by_share
        while self.allocated_bytes + 2 * self.segment_bytes > self.limit_bytes and heap:
            _, seg_id, version = heap[0]
            seg = self._segments.get(seg_id)
            if seg is None or seg.version != version:
                heapq.heappop(heap)  # stale: the segment changed or is gone
                continue
            victim_id = reclaim_victim(
                [(seg_id, seg.live_bytes, seg.stored_bytes)],
                self.allocated_bytes,
                self.segment_bytes,
                self.limit_bytes,
            )
            if victim_id is None:
                return
            heapq.heappop(heap)
            for rid, record_bytes in list(seg.records.items()):
                self._relocating = self._put(self._relocating, rid, record_bytes)
                self.relocated_bytes += record_bytes
            seg.records.clear()
            seg.live_bytes = 0
            self._retire(seg)
