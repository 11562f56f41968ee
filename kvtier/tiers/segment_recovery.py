"""The segment tier's start-up: the segments of earlier runs listed, their footers read
(or their records scanned) on threads and decoded into columns, the newest record of
each block kept and handed to the catalog fan by fan (the layout: kvtier/tiers/segments.py)."""

from __future__ import annotations

import errno
import gc
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier import failpoints
from kvtier.errors import CorruptRecord
from kvtier.index.catalog import RecordColumns, seeded_digest
from kvtier.tiers.allocator import round_up
from kvtier.tiers.posix_io import supports_o_direct
from kvtier.tiers.record import (
    ALIGN_BYTES,
    RecordHeader,
)
from kvtier.tiers.safe_open import open_regular, private_dir, remove_entry
from kvtier.tiers.segment_core import (
    _LOAD_THREADS,
    SegmentCore,
)
from kvtier.tiers.segment_file import (
    _PAGE_BITS,
    Segment,
    pack_location,
)
from kvtier.tiers.segment_format import (
    EMPTY_FOOTER_BYTES,
    FooterColumns,
    check_segment_header,
    columns_of_entries,
    entry_bytes,
    read_footer,
    read_footer_columns,
    row_slices,
    scan_records,
    segment_id_of,
    values_of,
)
from kvtier.tiers.startup import (
    FanScan,
    RecoveredRecord,
    RecoveryReport,
    refuse_other_layout,
    set_aside_tombstone_logs,
    tombstone_entry,
)
from kvtier.workers import lower_priority

logger = logging.getLogger(__name__)
# One footer decoded at a time: decoding is Python and numpy holding the GIL, and eight
# loader threads queued for it kept the event loop waiting ~100-280 ms at a time at 1 M
# records (with one decoder, the loop waits a switch interval at most). Reading the
# segment headers and scanning unsealed segments stay on every loader thread.
_DECODING = threading.Lock()
_FAN_SHIFT = 56  # a block's fan: its catalog digest's top byte (`fan`)


@dataclass(slots=True)
class _Loaded:
    """What recovery read from one segment of an earlier run."""

    segment: Segment
    entries: list[tuple[int, RecordHeader]]
    sealed: bool
    why: str = ""  # why the segment could not be read at all ("" if it could)


@dataclass(slots=True)
class FanColumns:
    """One fan's recovered records as columns (`recover_columns`), oldest generation
    first (load order among equal ones): what the catalog takes in bulk, plus what a
    record's header needs besides (to remove one the catalog does not take)."""

    fan: str
    columns: RecordColumns
    header_bytes: np.ndarray  # uint64
    codec: np.ndarray  # uint16

    def __len__(self) -> int:
        return len(self.columns)

    def header(self, i: int) -> RecordHeader:
        cols = self.columns
        return RecordHeader(
            cols.ns_names[int(cols.ns[i])],
            cols.key(i),
            int(cols.generation[i]),
            int(cols.size_bytes[i]),
            int(cols.xxh3_64[i]),
            int(self.header_bytes[i]),
            int(self.codec[i]),
        )


def fan_columns(scan: FanScan) -> FanColumns:
    """A FanScan's records as columns, oldest generation first (a stable sort)."""
    records = sorted(scan.records, key=lambda r: r.header.generation)
    names: dict[str, int] = {}
    ns = [names.setdefault(r.header.ns_id, len(names)) for r in records]
    lens = np.array([len(r.header.key) for r in records], dtype=np.int64)
    key_off = np.zeros(len(records), np.int64)
    if len(records):
        key_off[1:] = np.cumsum(lens)[:-1]

    def col(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.uint64)

    headers = [r.header for r in records]
    return FanColumns(
        scan.fan,
        RecordColumns(
            list(names),
            np.array(ns, dtype=np.uint32),
            b"".join(h.key for h in headers),
            key_off,
            lens,
            col([h.payload_bytes for h in headers]),
            col([h.xxh3_64 for h in headers]),
            col([h.generation for h in headers]),
            col([h.record_bytes for h in headers]),
            col([r.location for r in records]),
        ),
        col([h.header_bytes for h in headers]),
        np.array([h.codec for h in headers], dtype=np.uint16),
    )


class SegmentRecovery(SegmentCore):
    """SegmentCore with the start-up: `prepare` then `recover`, `compact_tombstones`."""

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

    def fan(self, ns_id: str, key: bytes) -> str:
        """Here a fan is a partition of the blocks for the hand-out, not a directory: the
        top byte of the key's catalog digest, which recovery has for every record."""
        return f"{seeded_digest(ns_id, key) >> _FAN_SHIFT:02x}"

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

    def recover_columns(self, on_fan: Callable[[FanColumns], None]) -> RecoveryReport:
        """`recover` for a tier with an owner, each fan handed out as columns (no object
        per record: the catalog takes them in bulk, kvtier/engine/recovery.py)."""
        if self._owner is None:
            raise RuntimeError("recover_columns needs the tier's owner attached first")
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._recover_columns(lambda scan: on_fan(fan_columns(scan)), on_fan)
        finally:
            if collecting:
                gc.enable()

    def _recover_all(self, on_fan: Callable[[FanScan], None] | None) -> RecoveryReport:
        if self._owner is not None:
            return self._recover_columns(on_fan)
        tombstones = self._read_tombstones()
        report = RecoveryReport([], 0, 0, 0, 0, max(tombstones.values(), default=0))
        with ThreadPoolExecutor(
            _LOAD_THREADS, thread_name_prefix="kvtier-segload", initializer=lower_priority
        ) as pool:
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
            _keep_newest(
                ((seg, offset, header) for offset, header in item.entries),
                tombstones,
                report,
                newest,
                covered,
            )
        fans: dict[str, FanScan] = {}
        owned = self._owner is not None
        with self._mu:
            for (ns_id, key), (seg, offset, header) in newest.items():
                location = pack_location(seg.seg_id, offset)
                seg.count_live(header.record_bytes)
                if not owned:
                    self._placed[(ns_id, key, header.generation)] = (location, header)
                report.max_generation = max(report.max_generation, header.generation)
                fan = self.fan(ns_id, key)
                scan = fans.get(fan)
                if scan is None:
                    scan = fans[fan] = FanScan(fan)
                scan.records.append(RecoveredRecord(header, seg.path, location))
                scan.files += 1
        return self._hand_out(fans, covered, report, on_fan)

    def _hand_out(
        self,
        fans: dict[str, FanScan],
        covered: dict[tuple[str, bytes], int],
        report: RecoveryReport,
        on_fan: Callable[[FanScan], None] | None,
    ) -> RecoveryReport:
        """The recovered records by fan, to `on_fan` (else into the report), once the
        tier is ready for reclaim; the tombstones that still kill a record on disk are
        kept to outlive the logs they are in (`compact_tombstones`)."""
        self._carry = [(ns, key, gen) for (ns, key), gen in covered.items()]
        self._recovered.set()
        self._reclaim_wake.set()
        for fan in sorted(fans):
            if on_fan is None:
                report.records += fans[fan].records
            else:
                on_fan(fans[fan])
        return report

    def _recover_columns(
        self,
        on_fan: Callable[[FanScan], None] | None,
        on_columns: Callable[[FanColumns], None] | None = None,
    ) -> RecoveryReport:
        """`_recover_all` for a tier with an owner, in columns: each segment's footer
        decoded into numpy arrays (segment_format.read_footer_columns), the newest record
        of each block chosen by one sort (digest, generation descending, load order), the
        tombstones applied; a `RecordHeader` is made only for the records handed out, fan
        by fan (so no million objects are alive at once: their heap, fragmented by what
        the catalog allocates meanwhile, stayed resident after the restart). The same
        records, counts and locations as the per-record path (property test)."""
        tombstones = self._read_tombstones()
        report = RecoveryReport([], 0, 0, 0, 0, max(tombstones.values(), default=0))
        with ThreadPoolExecutor(
            _LOAD_THREADS, thread_name_prefix="kvtier-segload", initializer=lower_priority
        ) as pool:
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
        rows_of, self._carry, digests_of = chosen
        fan_parts: list[np.ndarray] = []
        with self._mu:
            for (seg, cols), rows, digests in zip(parts, rows_of, digests_of, strict=True):
                seg.live_bytes += int(cols.record_bytes[rows].sum())
                seg.live_count += len(rows)
                if len(rows):
                    top = int(cols.generation[rows].max())
                    report.max_generation = max(report.max_generation, top)
                # A fan number per record (`fan`), from the digests at hand: no Python
                # per record (a blake2b each was ~3 µs of the GIL at 1 M, beside the loop).
                fan_parts.append((digests >> np.uint64(_FAN_SHIFT)).astype(np.uint8))
        self._recovered.set()
        self._reclaim_wake.set()
        fan_ids = np.concatenate(fan_parts) if fan_parts else np.zeros(0, np.uint8)
        by_fan = np.argsort(fan_ids, kind="stable")  # each fan's records in load order
        bounds = np.searchsorted(fan_ids[by_fan], np.arange(257))
        del fan_ids
        if on_columns is not None:
            table = _winners(parts, rows_of, digests_of)
            # The footers' columns are not needed any more: freed before the hand-out
            # (~100 B a record at 1 M, in small arrays from the heap).
            del rows_of, digests_of, parts, loaded
            for fan in range(256):
                picked = by_fan[bounds[fan] : bounds[fan + 1]]
                if not len(picked):
                    continue
                # Oldest first, load order among equal generations (the per-record sort).
                picked = picked[np.argsort(table.columns.generation[picked], kind="stable")]
                on_columns(
                    FanColumns(
                        f"{fan:02x}",
                        table.columns.take(picked),
                        table.header_bytes[picked],
                        table.codec[picked],
                    )
                )
                del picked
            return report
        part_ids = _part_numbers([len(r) for r in rows_of])
        all_rows = _parts_filled(rows_of)
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
            _keep_newest(
                ((seg, int(cols.offset[row]), cols.header(row)) for row in range(len(cols))),
                tombstones,
                report,
                newest,
                covered,
            )
        fans: dict[str, FanScan] = {}
        with self._mu:
            for (ns_id, key), (seg, offset, header) in newest.items():
                seg.count_live(header.record_bytes)
                report.max_generation = max(report.max_generation, header.generation)
                fan = self.fan(ns_id, key)
                scan = fans.setdefault(fan, FanScan(fan))
                location = pack_location(seg.seg_id, offset)
                scan.records.append(RecoveredRecord(header, seg.path, location))
                scan.files += 1
        return self._hand_out(fans, covered, report, on_fan)

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
            with _DECODING:
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


def _newest(
    parts: list[tuple[Segment, FooterColumns]],
    tombstones: dict[tuple[str, bytes], int],
    report: RecoveryReport,
) -> tuple[list[np.ndarray], list[tuple[str, bytes, int]], list[np.ndarray]] | None:
    """The rows to keep of each part (every block's newest record, the first loaded of
    equal generations as the per-record path keeps, not covered by a tombstone; the
    dropped ones counted in `report`) and the tombstones that still cover a record (to
    carry), and the kept rows' key digests (the catalog's: seeded xxh3). None if two
    distinct blocks share a key digest (the caller then chooses per record)."""
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
                    for o, n, s in values_of(cols.key_off, cols.key_len, cols.ns)
                ),
                dtype=np.uint64,
                count=len(cols),
            )
        )
    sizes = [len(cols) for _, cols in parts]
    total = sum(sizes)
    ramp = np.arange(max(sizes, default=0), dtype=np.int64)
    part_of = _part_numbers(sizes)
    row_of = _parts_filled([ramp[:n] for n in sizes])
    digest = _parts_filled(digests, np.uint64)
    gen = _parts_filled([c.generation for _, c in parts], np.uint64)

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
    # Each one's winner by a search among the winners' positions: a cumsum of the 1 M-row
    # mask (bool to int) held the GIL ~15 ms at a 1 M restart, the event loop behind it.
    later = np.nonzero(~first)[0]
    group_of = np.searchsorted(np.flatnonzero(first), later, side="right") - 1
    for j, g in zip(later.tolist(), group_of.tolist(), strict=True):
        if ident(int(order[j])) != ident(int(winners[g])):
            return None
    winners.sort()
    parts_of_winners = part_of[winners]
    picks = [winners[parts_of_winners == p] for p in range(len(parts))]
    rows = [row_of[w] for w in picks]
    return rows, [(ns, key, g) for (ns, key), g in covered.items()], [digest[w] for w in picks]


def _winners(
    parts: list[tuple[Segment, FooterColumns]],
    rows_of: list[np.ndarray],
    digests_of: list[np.ndarray],
) -> FanColumns:
    """The chosen rows of every part as one table (in part order, then row order), keys
    gathered into one blob, namespaces into one list of names, locations packed."""
    names: dict[str, int] = {}
    ns_parts, key_parts, len_parts, loc_parts = [], [], [], []
    for (seg, cols), rows in zip(parts, rows_of, strict=True):
        mapped = np.array([names.setdefault(n, len(names)) for n in cols.ns_names], np.uint32)
        ns_parts.append(mapped[cols.ns[rows].astype(np.intp)] if len(mapped) else cols.ns[rows])
        lens = cols.key_len[rows].astype(np.int64)
        starts = cols.key_off[rows].astype(np.int64)
        blob = np.frombuffer(cols.blob, dtype=np.uint8)
        # The keys' bytes gathered a slice of rows at a time: one gather of a segment's
        # ~4 M key bytes held the GIL ~20 ms, the event loop idle behind it (stalltrace).
        for part in row_slices(len(rows)):
            part_lens, part_starts = lens[part], starts[part]
            ends = np.cumsum(part_lens)
            total = int(ends[-1]) if len(ends) else 0
            gather = np.repeat(part_starts - (ends - part_lens), part_lens)
            key_parts.append(blob[gather + np.arange(total, dtype=np.int64)])
        len_parts.append(lens)
        page = np.uint64(ALIGN_BYTES)
        loc_parts.append(
            (np.uint64(seg.seg_id) << np.uint64(_PAGE_BITS)) | (cols.offset[rows] // page)
        )
    lens = np.concatenate(len_parts) if len_parts else np.zeros(0, np.int64)
    key_off = np.zeros(len(lens), np.int64)
    if len(lens):
        key_off[1:] = np.cumsum(lens)[:-1]

    def cat(pick: Callable[[FooterColumns], np.ndarray], dtype: type[np.generic]) -> np.ndarray:
        if not parts:
            return np.zeros(0, dtype)
        return np.concatenate(
            [pick(cols)[rows] for (_, cols), rows in zip(parts, rows_of, strict=True)]
        ).astype(dtype, copy=False)

    def joined(chunks: list[np.ndarray], dtype: type[np.generic]) -> np.ndarray:
        if not chunks:
            return np.zeros(0, dtype)
        return np.concatenate(chunks).astype(dtype, copy=False)

    return FanColumns(
        "",
        RecordColumns(
            list(names),
            joined(ns_parts, np.uint32),
            _blob_of(key_parts),
            key_off,
            lens,
            cat(lambda c: c.payload_bytes, np.uint64),
            cat(lambda c: c.xxh3_64, np.uint64),
            cat(lambda c: c.generation, np.uint64),
            cat(lambda c: c.record_bytes, np.uint64),
            joined(loc_parts, np.uint64),
            joined(digests_of, np.uint64),
        ),
        cat(lambda c: c.header_bytes, np.uint64),
        cat(lambda c: c.codec, np.uint16),
    )


def _parts_filled(parts: Sequence[np.ndarray], dtype: type[np.generic] = np.int64) -> np.ndarray:
    """`np.concatenate(parts)`, copied a part (a segment's rows) at a time. One call that
    made a million-row array (`np.repeat` of the part numbers, which copies element by
    element) held the GIL 35-80 ms at a 1 M restart, the event loop waiting behind the
    recovery's thread; between two parts it can run (the rule of `row_slices`)."""
    out = np.empty(sum(len(part) for part in parts), dtype)
    at = 0
    for part in parts:
        out[at : at + len(part)] = part
        at += len(part)
    return out


def _part_numbers(sizes: Sequence[int]) -> np.ndarray:
    """For rows numbered across parts of `sizes` rows each: each row's part."""
    return _parts_filled([np.full(n, p, np.int64) for p, n in enumerate(sizes)])


def _blob_of(chunks: list[np.ndarray]) -> bytes | mmap.mmap:
    """The chunks' bytes back to back, copied a chunk at a time into an anonymous mapping
    (its pages taken as they are written, none zeroed first). One join of the ~32 MB of
    keys at 1 M records, with its page faults, held the GIL ~17 ms of the restart, the
    event loop waiting behind it; between two chunks it can run. A slice of the mapping
    is `bytes`, as a slice of `bytes` is."""
    total = sum(len(chunk) for chunk in chunks)
    if not total:
        return b""
    out = mmap.mmap(-1, total)
    at = 0
    for chunk in chunks:
        out[at : at + len(chunk)] = chunk.data
        at += len(chunk)
    return out


def _keep_newest(
    records: Iterable[tuple[Segment, int, RecordHeader]],
    tombstones: dict[tuple[str, bytes], int],
    report: RecoveryReport,
    newest: dict[tuple[str, bytes], tuple[Segment, int, RecordHeader]],
    covered: dict[tuple[str, bytes], int],
) -> None:
    """Into `newest`, each block's newest record of `records` that no tombstone covers
    (the tombstones that did cover one into `covered`); the dropped ones counted."""
    for seg, offset, header in records:
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
