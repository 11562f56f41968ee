"""NVMe tier: one record file per block (format: kvtier/tiers/record.py), never half-visible.

With `nvme.encryption_key_file` set, every record is sealed (the record format's
FLAG_SEALED). A tier with a key serves only records sealed with that key; a tier without
one serves only plaintext records: anything else is CorruptRecord, dropped at start.

A record is written to a new file in `tmp/` (or over a recycled one where it lies in
`free/`) and renamed into `v1/<xx>/<digest>.<generation>.kvr` only after every byte is
written, so a crash, ENOSPC or a short write leaves at worst a stray temporary file
(removed at the next start) or a spare (reused: every byte of it is written before it
becomes a record), never a visible partial record. Every read verifies the header (magic,
version, checksum, namespace, key, generation, length), the payload checksum and the zero
padding; any mismatch raises CorruptRecord, which the store turns into a miss. Restart
rebuilds the index from the headers on disk.

Deletes and overwrites append a tombstone (namespace, key, generation) to `tombstones.log`
before they are acknowledged, so a record whose removal had not happened yet when the
daemon was killed is not served again after the restart.

A daemon serves while its index fills: `prepare()` reads no record, `recover()` may run
on a thread of its own meanwhile (the epoch and the tombstone logs that make this safe:
kvtier/tiers/startup.py), `compact_tombstones()` after it; `open()` is all three.

Everything the tier creates is private to the service user whatever the umask
(directories 0700, files 0600; a tier an older version left open is closed up at start),
and every file is opened through kvtier/tiers/safe_open.py: never through a symbolic
link, never blocking on a FIFO, only regular files used. Anything else found as a record,
spare, temporary file or log is refused, counted (`refused`) and removed.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import mmap
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier import failpoints
from kvtier.buffers import aligned_buffer
from kvtier.errors import ConfigError, CorruptRecord, NotRegularFile
from kvtier.tiers.crypto import RecordCipher
from kvtier.tiers.posix_io import (
    advance,
    lock_tier,
    pwritev_all,
    supports_o_direct,
    sync_filesystem,
)
from kvtier.tiers.record import (
    RecordHeader,
    decode_header,
    encode_header,
    open_sealed_payload,
    read_header_region,
    seal_record,
    verify_record,
)
from kvtier.tiers.safe_open import (
    DIR_MODE,
    OpenedFile,
    RefusedFiles,
    file_kind,
    open_regular,
    private_dir,
    remove_entry,
    same_file,
    tighten,
)
from kvtier.tiers.startup import (
    TOMBSTONE_LOG,
    FanScan,
    GenerationEpoch,
    RecoveredRecord,
    RecoveryReport,
    is_tombstone_log,
    read_tombstone_logs,
    refuse_other_layout,
    set_aside_tombstone_logs,
    tombstone_entries,
    tombstone_entry,
)
from kvtier.workers import lower_priority

if TYPE_CHECKING:
    from kvtier.config import NvmeConfig

logger = logging.getLogger(__name__)

__all__ = [
    "RECORD_SUFFIX",
    "TOMBSTONE_LOG",
    "NvmeTier",
    "RecoveredRecord",
    "RecoveryReport",
    "fan_of",
    "lock_tier",
    "supports_o_direct",
    "tombstone_entries",
]
# The record format, re-exported as this module exported it before it moved to record.py.

RECORD_SUFFIX = ".kvr"
_LOGGED_DROPS = 10  # unreadable records named one by one in the log at start
_SCRATCH_KEEP_BYTES = 16 << 20  # larger sealed records use a buffer of their own
_RECOVERY_THREADS = 8  # fan directories scanned at once at start (see _recover)
_CACHED_HEADER_S = 30e-6  # per record file: ~11 µs from the page cache here, ~70 from disk
_STOP_CHECK_FILES = 256  # a stopped recovery notices within this many files of a fan
_PLACE_ATTEMPTS = 3  # files a write may find swapped before it gives up (see `write`)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Placed:
    """A written record: its size on disk, and where it lies for the layouts that say (the
    segment layout's location, which its owner hands back to read and remove; 0 for the
    file layout, whose records are found by name)."""

    record_bytes: int
    location: int = 0


class NvmeTier:
    """Record files under `root`. Blocking methods: call them from the I/O pool.

    Lifecycle: `open()` once (creates directories, probes O_DIRECT, removes temporary files,
    returns what survived on disk) -> `write` / `read` / `remove` from any I/O thread.
    `open()` is `prepare()` (after which the tier takes records and tombstones) ->
    `recover()` (may run on its own thread meanwhile; `stop_recovery()` ends it early) ->
    `compact_tombstones()` (only after a complete recovery).
    With a `cipher` every record written is sealed and only records sealed with its key
    are served (see the module docstring).
    """

    name = "nvme"
    layout = "files"  # `nvme.layout`; kvtier/tiers/segments.py is the other

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        direct_io: bool,
        sync_writes: bool,
        cipher: RecordCipher | None = None,
    ) -> None:
        self.root = root
        self.cipher = cipher
        # Sealed records need a second buffer (ciphertext and plaintext cannot share one);
        # each I/O thread keeps its own: faulting in a fresh mmap takes ~1 ms per MiB here,
        # more than decrypting it (~0.5 ms).
        self._scratch_local = threading.local()
        self.capacity_bytes = capacity_bytes
        self.sync_writes = sync_writes
        self._want_direct = direct_io
        self.direct_io = False
        self._records_dir = root / "v1"
        self._lock_fd: int | None = None
        self._tombstone_fd: int | None = None
        self._tombstone_lock = threading.Lock()
        self._tmp_dir = root / "tmp"
        # Files of removed records, kept to be overwritten by new records of the same size:
        # on ext4 over this machine's disk a new 1 MiB O_DIRECT file costs ~2.9 ms against
        # ~1.6 ms for overwriting blocks already allocated and written.
        self._free_dir = root / "free"
        # The data path builds its paths as strings: pathlib costs ~10 µs a path here.
        self._records_str, self._tmp_str = str(self._records_dir), str(self._tmp_dir)
        self._free_str = str(self._free_dir)
        self._free: dict[int, list[str]] = {}  # record size -> recyclable files
        self._free_bytes = 0
        self._free_lock = threading.Lock()
        self.free_limit_bytes = min(capacity_bytes // 64, 1 << 30)
        self.refused = RefusedFiles()
        self.epoch = GenerationEpoch(root)
        self._removed_tmp = 0
        self._refused_before = 0
        self._old_tombstone_logs: list[str] = []  # set aside by `prepare`, read by `recover`
        self._stop_recovery = threading.Event()

    @classmethod
    def from_config(cls, config: NvmeConfig) -> NvmeTier:
        """The tier `config` (resolved: its path filled in) describes; reads the key file
        now, so a bad one is a ConfigError at start."""
        key_file = config.encryption_key_file
        return cls(
            Path(config.path),
            config.capacity_bytes,
            config.direct_io,
            config.sync_writes,
            RecordCipher.from_key_file(Path(key_file)) if key_file else None,
        )

    # ---- start-up ---------------------------------------------------------------------
    def open(self) -> RecoveryReport:
        self.prepare()
        report = self.recover()
        if self.first_generation is None:
            self.epoch.claim_above(max(report.max_generation, report.max_tombstone_generation))
        self.compact_tombstones()
        return report

    def prepare(self) -> None:
        """Ready the tier for new records without reading any; this run's generations
        claimed (`first_generation`), except on a tier with no (readable) epoch file: the
        caller recovers it before it takes a record, then `epoch.claim_above` it."""
        self._refused_before = self.refused.count
        had_records = self._records_dir.is_dir()
        self.root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        private_dir(self.root, self.refused, "directory", follow=True)
        self._lock()
        refuse_other_layout(self.root, self.layout)
        private_dir(self._records_dir, self.refused, "v1/")
        for fan in range(256):  # once here, not a mkdir per record write
            private_dir(self._records_dir / f"{fan:02x}", self.refused, "v1/")
        private_dir(self._tmp_dir, self.refused, "tmp/")
        # Spares of a free/ an older version left open may be too; records are closed up
        # by recovery on the fd it opens anyway (tombstones.log is made anew below).
        self._scan_free(tighten_files=private_dir(self._free_dir, self.refused, "free/"))
        self._removed_tmp = 0
        with os.scandir(self._tmp_str) as strays:
            for stray in strays:
                if not stray.is_file(follow_symlinks=False):
                    self.refused.refuse("tmp/", _entry_kind(stray))
                remove_entry(stray.path)
                self._removed_tmp += 1
        self.direct_io = self._want_direct and self._probe_direct_io()
        if self._want_direct and not self.direct_io:
            logger.warning(
                "O_DIRECT is not supported on %s; the NVMe tier uses buffered I/O", self.root
            )
        # This run's tombstones go to a fresh log (see kvtier/tiers/tier_state.py).
        self._old_tombstone_logs, self._tombstone_fd = set_aside_tombstone_logs(
            self.root, self.refused
        )
        if not self.epoch.claim_next(self.refused) and not had_records:
            self.epoch.claim(1)  # a new tier

    @property
    def first_generation(self) -> int | None:
        """This run's generations start here (None: not claimed yet, see `prepare`)."""
        return self.epoch.first_generation

    def fan(self, ns_id: str, key: bytes) -> str:
        """The fan ("00".."ff") whose scan hands out the records of block (ns_id, key): its
        directory here (`fan_of`); the recovery engine asks this for a block's."""
        return fan_of(ns_id, key)

    def recover(self, on_fan: Callable[[FanScan], None] | None = None) -> RecoveryReport:
        """Check every record file's header (after `prepare`), leaving this run's records
        alone. With `on_fan`, each fan is handed to it once scanned (the report lists no
        records); `stop_recovery()` ends it early, `complete` False."""
        report = self._recover(self._removed_tmp, self._read_tombstones(), on_fan)
        report.refused_files = self.refused.count - self._refused_before
        if report.refused_files:
            logger.warning(
                "refused %d files in the NVMe tier that were not regular files (links, "
                "FIFOs, sockets, devices) and removed them",
                report.refused_files,
            )
        return report

    def stop_recovery(self) -> None:
        """End a `recover()` running on another thread (it returns within a few files)."""
        self._stop_recovery.set()

    def compact_tombstones(self) -> None:
        """After a complete recovery every record the set-aside logs name is gone: remove
        them (a crash midway leaves some, which name only records that no longer exist)."""
        if failpoints.ACTIVE:
            failpoints.fire("nvme.compact")
        for name in self._old_tombstone_logs:
            remove_entry(self.root / name)
        self._old_tombstone_logs = []

    def _lock(self) -> None:
        """One daemon per directory: a second one would delete the first's temporary files."""
        try:
            self._lock_fd = lock_tier(self.root)
        except BlockingIOError:
            raise ConfigError(
                f"nvme.path: {self.root} is in use by another kvtier daemon"
            ) from None

    def close(self) -> None:
        if self._tombstone_fd is not None:
            os.close(self._tombstone_fd)
            self._tombstone_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _probe_direct_io(self) -> bool:
        return supports_o_direct(self._tmp_dir)

    def _read_tombstones(self) -> dict[tuple[str, bytes], int]:
        """(namespace, key) -> newest deleted generation, from the logs of earlier runs
        (`prepare` set them aside; before it, every log there)."""
        names = self._old_tombstone_logs
        if self._tombstone_fd is None:
            names = sorted(n for n in os.listdir(self.root) if is_tombstone_log(n))
        return read_tombstone_logs(self.root, names, self.refused)

    def tombstone(self, ns_id: str, key: bytes, generation: int) -> None:
        """Record that (ns_id, key) up to `generation` is deleted, before the delete is
        acknowledged (one append; survives the process being killed, and a power loss too
        with nvme.sync_writes)."""
        if failpoints.ACTIVE:
            failpoints.fire("nvme.tombstone")
        assert self._tombstone_fd is not None, "open() the tier first"
        entry = tombstone_entry(ns_id, key, generation)
        with self._tombstone_lock:
            if os.write(self._tombstone_fd, entry) != len(entry):
                raise OSError(errno.EIO, "short write to the tombstone log")
            if self.sync_writes:
                os.fdatasync(self._tombstone_fd)

    def _recover(
        self,
        removed_tmp: int,
        tombstones: dict[tuple[str, bytes], int],
        on_fan: Callable[[FanScan], None] | None = None,
    ) -> RecoveryReport:
        """Check every record file's header. A record's file name and fan follow from its
        (namespace, key), so every copy of a block is in one fan: each fan is resolved on
        its own and the fans are merged in name order, giving the same records, in the
        same order, and the same counts as one sorted scan.

        Headers in the page cache are read fastest by this thread alone (threads would
        only contend for the GIL: 2x slower here on 2 cores); headers on the drive are
        not, so when the first fan shows the drive's latency the rest are scanned on
        _RECOVERY_THREADS threads (opens and reads release the GIL)."""
        report = RecoveryReport([], 0, 0, removed_tmp, 0, max(tombstones.values(), default=0))
        unreadable: list[tuple[str, str]] = []
        for fan_scan in self._fan_scans(tombstones):
            if fan_scan is None:  # stopped
                report.complete = False
                break
            unreadable += fan_scan.unreadable
            report.dropped_stale += fan_scan.stale
            report.dropped_deleted += fan_scan.deleted
            newest = max((r.header.generation for r in fan_scan.records), default=0)
            report.max_generation = max(report.max_generation, newest)
            if on_fan is None:
                report.records += fan_scan.records
            else:
                on_fan(fan_scan)
        report.dropped_corrupt = len(unreadable)
        # A changed key makes every record unreadable: a few lines, then a total.
        for name, why in unreadable[:_LOGGED_DROPS]:
            logger.warning("dropping unreadable record %s: %s", name, why)
        if len(unreadable) > _LOGGED_DROPS:
            logger.warning("dropped %d unreadable records in all", len(unreadable))
        return report

    def _fan_scans(self, tombstones: dict[tuple[str, bytes], int]) -> Iterator[FanScan | None]:
        """Each fan's scan in fan order (None once stopped), on threads if the drive is
        slow (see `_recover`)."""
        with os.scandir(self._records_str) as entries:
            fans = sorted(entry.name for entry in entries if entry.is_dir())
        scan = functools.partial(self._scan_fan, tombstones=tombstones)
        started = time.perf_counter()
        first = [scan(fan) for fan in fans[:1]]
        per_file_s = (time.perf_counter() - started) / max(1, sum(f.files for f in first if f))
        yield from first
        rest = fans[1:]
        if per_file_s < _CACHED_HEADER_S or _RECOVERY_THREADS <= 1 or len(rest) <= 1:
            yield from map(scan, rest)
        else:
            with ThreadPoolExecutor(
                min(_RECOVERY_THREADS, len(rest)),
                thread_name_prefix="kvtier-recover",
                initializer=lower_priority,
            ) as pool:
                yield from pool.map(scan, rest)  # in `rest` order, however they finish

    def _scan_fan(self, fan: str, tombstones: dict[tuple[str, bytes], int]) -> FanScan | None:
        """One fan directory's records in name order: unreadable, misplaced and deleted
        ones removed, of several generations of a block only the newest kept; records of
        this run left alone. None if `stop_recovery()` was called."""
        if failpoints.ACTIVE:
            failpoints.fire("nvme.recover_fan")
        if self._stop_recovery.is_set():
            return None
        directory = f"{self._records_str}/{fan}"
        out = FanScan(fan)
        newest: dict[tuple[str, bytes], RecoveredRecord] = {}
        names = sorted(n for n in os.listdir(directory) if n.endswith(RECORD_SUFFIX))
        out.files = len(names)
        ours_from = self.first_generation
        for i, name in enumerate(names, start=1):
            if not i % _STOP_CHECK_FILES and self._stop_recovery.is_set():
                return None
            if ours_from is not None and _name_generation(name) >= ours_from:
                continue  # written by this run, after prepare(): not the scan's to judge
            file = f"{directory}/{name}"
            try:
                header = self._check_header(fan, name, file)
            except NotRegularFile as err:
                self.refused.refuse("v1/", err.kind)
                remove_entry(file)
                continue
            except (CorruptRecord, OSError) as err:
                out.unreadable.append((name, str(err)))
                _unlink(file)
                continue
            ident = (header.ns_id, header.key)
            if header.generation <= tombstones.get(ident, 0):
                _unlink(file)  # deleted before the last stop: stays deleted
                out.deleted += 1
                continue
            old = newest.get(ident)
            if old is not None:
                if old.header.generation >= header.generation:
                    _unlink(file)
                    out.stale += 1
                    continue
                _unlink(old.file)
                out.stale += 1
            newest[ident] = RecoveredRecord(header, file)
        out.records.extend(newest.values())
        return out

    def _read_header(self, path: Path) -> RecordHeader:
        """The verified header of the record file at `path` (see `_check_header`)."""
        header = self._check_header(path.parent.name, path.name, str(path))
        if path != self.record_path(header.ns_id, header.key, header.generation):
            raise CorruptRecord("record is not where its header says it belongs")
        return header

    def _check_header(self, fan: str, name: str, file: str) -> RecordHeader:
        """The verified header of the record file `file` (`name` in fan directory `fan`),
        which must be as long as the header says and where the header says it belongs."""
        opened = open_regular(file, os.O_RDONLY)
        try:
            tighten(opened.fd, opened.info)  # an older version's 0640: free, fstat is done
            header = decode_header(read_header_region(opened.fd), self.cipher)
        finally:
            os.close(opened.fd)
        size = opened.info.st_size
        if size != header.record_bytes:
            raise CorruptRecord(
                f"record is {size} bytes on disk, header says {header.record_bytes}"
            )
        digest = _digest(header.ns_id, header.key)
        if fan != digest[:2] or name != f"{digest}.{header.generation}{RECORD_SUFFIX}":
            raise CorruptRecord("record is not where its header says it belongs")
        return header

    # ---- paths --------------------------------------------------------------------------
    def record_path(self, ns_id: str, key: bytes, generation: int) -> Path:
        return Path(self._record_file(ns_id, key, generation))

    def _record_file(self, ns_id: str, key: bytes, generation: int) -> str:
        digest = _digest(ns_id, key)
        return f"{self._records_str}/{digest[:2]}/{digest}.{generation}{RECORD_SUFFIX}"

    def _flags(self, base: int) -> int:
        return base | (os.O_DIRECT if self.direct_io else 0)

    # ---- data path (blocking; run on the I/O pool) --------------------------------------
    def write(self, header: RecordHeader, payload: Sequence[memoryview | mmap.mmap]) -> int:
        """Write one record atomically; returns its size on disk.

        `payload` buffers must be page-aligned, their lengths must add up to the payload
        rounded up to 4096, and the padding after `payload_bytes` must be zero. With a
        cipher they are only read (the ciphertext goes to a buffer of this thread's).
        """
        if failpoints.ACTIVE:
            failpoints.fire("nvme.write")
        final = self._record_file(header.ns_id, header.key, header.generation)
        total = header.header_bytes + sum(len(b) for b in payload)
        if total != header.record_bytes:
            raise ValueError(f"payload buffers add up to {total}, expected {header.record_bytes}")
        iov: list[memoryview | mmap.mmap] = (
            [encode_header(header, self._scratch(header.header_bytes, "head")), *payload]
            if self.cipher is None
            else self._seal(self.cipher, header, payload)
        )
        for _ in range(_PLACE_ATTEMPTS):
            opened, tmp = self._open_target(total, final)
            fd = opened.fd
            try:
                pwritev_all(fd, iov, total, 0)
                if self.sync_writes:
                    os.fdatasync(fd)
                # Rename the name only while it is still the file written (not a link or
                # FIFO swapped in since the open): rename moves names, not open files.
                placed = same_file(fd, opened.info, tmp)
            except BaseException:
                os.close(fd)
                _unlink(tmp)
                raise
            os.close(fd)
            if placed:
                break
            self.refused.refuse(os.path.basename(os.path.dirname(tmp)) + "/", "swapped name")
            remove_entry(tmp)
        else:
            raise OSError(errno.EIO, "record files kept being replaced while written")
        try:
            if failpoints.ACTIVE:
                failpoints.fire("nvme.rename")
            os.rename(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise
        if self.sync_writes:
            dir_fd = os.open(os.path.dirname(final), _DIR_FLAGS)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return total

    def write_many(
        self, headers: Sequence[RecordHeader], payloads: Sequence[Sequence[memoryview | mmap.mmap]]
    ) -> list[int | OSError]:
        """Write several records (a demotion batch), each as `write` would; per record its
        size on disk or the OSError that failed it (one failure does not fail the others:
        each record is its own file here)."""
        results: list[int | OSError] = []
        for header, payload in zip(headers, payloads, strict=True):
            try:
                results.append(self.write(header, payload))
            except OSError as err:
                results.append(err)
        return results

    def write_many_placed(
        self, headers: Sequence[RecordHeader], payloads: Sequence[Sequence[memoryview | mmap.mmap]]
    ) -> list[Placed | OSError]:
        """`write_many`, saying where each record lies (nothing here: found by name)."""
        return [
            r if isinstance(r, OSError) else Placed(r) for r in self.write_many(headers, payloads)
        ]

    def _open_target(self, size: int, final: str) -> tuple[OpenedFile, str]:
        """A file to write a record of `size` bytes into, open for writing, and its path: a
        recycled file of exactly that size, overwritten where it lies in free/ (out of the
        pool, so no other writer takes it; a crash leaves it a spare again at the next
        start, never a record), else a new file in tmp/. Overwriting allocated blocks in
        place skips block allocation; writing it in free/ skips a rename to tmp/. A spare
        that is not a regular file of ours with one link is refused and removed, never
        written through."""
        while (spare := self._take_free(size)) is not None:
            try:
                opened = open_regular(spare, self._flags(os.O_WRONLY), sole=True, own=True)
            except FileNotFoundError:
                continue
            except NotRegularFile as err:
                self.refused.refuse("free/", err.kind)
                remove_entry(spare)
                continue
            if opened.info.st_size == size:
                tighten(opened.fd, opened.info)
                return opened, spare
            os.close(opened.fd)
            _unlink(spare)  # not what its name said: do not trust it
        tmp = f"{self._tmp_str}/{os.path.basename(final)}.{uuid.uuid4().hex}.tmp"
        flags = self._flags(os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        return open_regular(tmp, flags), tmp

    def _seal(
        self, cipher: RecordCipher, header: RecordHeader, payload: Sequence[memoryview | mmap.mmap]
    ) -> list[memoryview | mmap.mmap]:
        """A sealed record's header region and ciphertext (zero-padded), ready to write, in
        this thread's buffers."""
        head = self._scratch(header.header_bytes, "head")
        body_bytes = header.record_bytes - header.header_bytes
        body = self._scratch(body_bytes)
        seal_record(cipher, header, payload, head, body)
        return [head, body] if body_bytes else [head]

    def _scratch(self, size_bytes: int, use: str = "body") -> memoryview:
        """A page-aligned buffer of `size_bytes` owned by the calling thread, one per `use`
        (a record's "head" and "body"), reused by its next call for that use, so callers
        must be done with it before they return. A fresh mapping per I/O cost ~65 µs a
        record read (mmap, fault, munmap) on a fast device."""
        buf: mmap.mmap | None = getattr(self._scratch_local, use, None)
        if buf is None or len(buf) < size_bytes:
            buf = aligned_buffer(size_bytes)
            if size_bytes <= _SCRATCH_KEEP_BYTES:
                setattr(self._scratch_local, use, buf)
        return memoryview(buf)[:size_bytes]

    def write_placed(
        self, header: RecordHeader, payload: Sequence[memoryview | mmap.mmap]
    ) -> Placed:
        """`write`, saying where the record lies (nothing here: records are found by
        name)."""
        return Placed(self.write(header, payload))

    def settle(self, location: int) -> None:
        """The owner recorded a location `write_placed` gave (nothing to do here)."""

    def settle_many(self, locations: Sequence[int]) -> None:
        """`settle` of each location (a batch's, from `write_many_placed`)."""
        for location in locations:
            self.settle(location)

    def read(self, header: RecordHeader, location: int = 0) -> tuple[mmap.mmap, int]:
        """Read and verify the record `header` describes; returns (buffer, payload offset).

        Raises CorruptRecord when anything on disk differs from what was written, and
        FileNotFoundError when the record is gone.
        """
        if self.cipher is not None:
            out = aligned_buffer(header.record_bytes - header.header_bytes)
            self._read_sealed(self.cipher, header, memoryview(out))
            return out, 0
        buf = aligned_buffer(header.record_bytes)
        self._read_record(header, [memoryview(buf)], location)
        view = memoryview(buf)
        verify_record(view[: header.header_bytes], view[header.header_bytes :], header, self.cipher)
        return buf, header.header_bytes

    def read_into(self, header: RecordHeader, dest: memoryview, location: int = 0) -> None:
        """Read and verify a record's payload straight into `dest` (an aligned extent of
        round_up(payload, 4096) bytes, e.g. in the DRAM arena; its padding after the
        payload ends up zero). Raises like `read`; a sealed record that fails leaves `dest`
        zeroed, never holding unauthenticated bytes."""
        if len(dest) != header.record_bytes - header.header_bytes:
            raise ValueError("destination does not match the record's payload size")
        if self.cipher is not None:
            self._read_sealed(self.cipher, header, dest)
            return
        head = self._scratch(header.header_bytes, "head")
        self._read_record(header, [head, dest], location)
        verify_record(head, dest, header, self.cipher)

    def _read_sealed(self, cipher: RecordCipher, header: RecordHeader, dest: memoryview) -> None:
        """Read a sealed record into this thread's buffer, check it, decrypt into `dest`."""
        raw = self._scratch(header.record_bytes)
        self._read_record(header, [raw])
        head, body = raw[: header.header_bytes], raw[header.header_bytes :]
        seal = verify_record(head, body, header, cipher)
        assert seal is not None  # open_header refuses plaintext records to a tier with a key
        open_sealed_payload(cipher, seal, header, head, body, dest)

    def _read_record(self, header: RecordHeader, iov: list[memoryview], location: int = 0) -> None:
        """Fill `iov` (adding up to the record's size) from the record file (found by its
        name: `location` is the segment layout's)."""
        path = self._record_file(header.ns_id, header.key, header.generation)
        try:
            opened = open_regular(path, self._flags(os.O_RDONLY))
        except NotRegularFile as err:
            self.refused.refuse("v1/", err.kind)
            raise  # a CorruptRecord: a miss, and the store drops the record (remove)
        fd = opened.fd
        try:
            if failpoints.ACTIVE:
                failpoints.fire("nvme.read")
            size = opened.info.st_size
            if size != header.record_bytes:
                raise CorruptRecord(f"record is {size} bytes, expected {header.record_bytes}")
            done = 0
            while done < size:
                got = os.preadv(fd, iov, done)
                if got <= 0:
                    raise CorruptRecord("record ended early")
                done += got
                advance(iov, got)
        finally:
            os.close(fd)

    def sync(self) -> None:
        """Make every record written so far durable: syncfs(2) on the tier's file system
        (only that one), or sync(2) where libc has no syncfs."""
        sync_filesystem(self.root)

    def remove(self, header: RecordHeader, location: int = 0) -> None:
        """Take a record out of the tier: its file becomes a recyclable one (the pool is
        bounded by free_limit_bytes, beyond which files are deleted)."""
        if failpoints.ACTIVE:
            failpoints.fire("nvme.remove")
        path = self._record_file(header.ns_id, header.key, header.generation)
        size = header.record_bytes
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISREG(mode):  # never into the pool of files to write over
            remove_entry(path)
            return
        with self._free_lock:
            keep = self._free_bytes + size <= self.free_limit_bytes
            if keep:
                self._free_bytes += size
        if not keep:
            _unlink(path)
            return
        spare = f"{self._free_str}/{size}.{uuid.uuid4().hex}"
        try:
            os.rename(path, spare)
        except FileNotFoundError:
            with self._free_lock:
                self._free_bytes -= size
            return
        with self._free_lock:
            self._free.setdefault(size, []).append(spare)

    def remove_many(self, removals: Sequence[tuple[RecordHeader, int]]) -> list[OSError | None]:
        """`remove` of each (header, location), in one I/O-pool job: per record None (a
        record already gone too) or the OSError that failed it."""
        out: list[OSError | None] = []
        for header, location in removals:
            try:
                self.remove(header, location)
            except OSError as err:
                out.append(None if isinstance(err, FileNotFoundError) else err)
                continue
            out.append(None)
        return out

    def _take_free(self, size: int) -> str | None:
        """A recyclable file of `size` bytes (by its name), out of the pool; None if none."""
        with self._free_lock:
            spares = self._free.get(size)
            if not spares:
                return None
            self._free_bytes -= size
            return spares.pop()

    def _scan_free(self, tighten_files: bool = False) -> None:
        """Recyclable files left by the previous run (their names carry their sizes);
        anything else there is refused (see `_open_target`). With `tighten_files` (free/
        was open to group or others) each spare is closed up too."""
        with os.scandir(self._free_str) as entries:
            for spare in entries:
                if not spare.is_file(follow_symlinks=False):  # d_type: no syscall
                    self.refused.refuse("free/", _entry_kind(spare))
                    remove_entry(spare.path)
                    continue
                size_text = spare.name.split(".", 1)[0]
                if (
                    not size_text.isdigit()
                    or self._free_bytes + int(size_text) > self.free_limit_bytes
                ):
                    _unlink(spare.path)
                    continue
                if tighten_files and not self._tighten_spare(spare.path):
                    continue
                self._free.setdefault(int(size_text), []).append(spare.path)
                self._free_bytes += int(size_text)

    def _tighten_spare(self, spare: str) -> bool:
        """chmod 600 a spare an older version left open; False if it is not one to keep."""
        try:
            opened = open_regular(spare, os.O_RDONLY, sole=True, own=True)
        except FileNotFoundError:
            return False
        except NotRegularFile as err:
            self.refused.refuse("free/", err.kind)
            remove_entry(spare)
            return False
        try:
            tighten(opened.fd, opened.info)
        finally:
            os.close(opened.fd)
        return True


def _digest(ns_id: str, key: bytes) -> str:
    """A block's file name stem; its first two characters name its fan directory."""
    return hashlib.blake2b(ns_id.encode() + b"\0" + key, digest_size=16).hexdigest()


def fan_of(ns_id: str, key: bytes) -> str:
    """The fan directory every record of block (ns_id, key) lives in."""
    return _digest(ns_id, key)[:2]


def _name_generation(name: str) -> int:
    """The generation a record file's name (<digest>.<generation>.kvr) gives; 0 if none."""
    text = name[: -len(RECORD_SUFFIX)].rpartition(".")[2]
    return int(text) if text.isdigit() else 0


def _entry_kind(entry: os.DirEntry[str]) -> str:
    """What a directory entry that is not a regular file is (lstat: only for those)."""
    try:
        return file_kind(entry.stat(follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return "file"


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
