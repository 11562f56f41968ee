"""NvmeDriver: the NVMe tier (kvtier/tiers/nvme.py) run on the I/O pool, with its health,
its retries and the tombstone barrier.

It speaks record headers and memory views, never catalog entries, and answers with
outcomes (a `Read` whose `status` says ok / corrupt / missing / I/O error / offline) that
the store applies through `Residency`. What must not be forgotten when the disk fails is
kept here and retried by the health watcher: records to remove (else they leak disk) and
tombstones to write (else a restart could bring a deleted block back).

With the segment layout the catalog keeps where each record lies (a location column) and
the tier keeps nothing per record: `attach_owner` answers the tier's reclaimer (on its own
thread) from the catalog, on the event loop, a chunk of records per callback.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import mmap
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.config import NvmeConfig
from kvtier.engine.calibrate import CALIBRATION_NS_ID
from kvtier.engine.health import TierHealth
from kvtier.errors import CorruptRecord
from kvtier.movers.io import IoPool
from kvtier.sizes import human_size
from kvtier.tiers.nvme import NvmeTier, Placed
from kvtier.tiers.record import RecordHeader, header_size_for
from kvtier.tiers.record_batch import digests
from kvtier.tiers.segments import RecordOwner, SegmentTier
from kvtier.types import BlockId

logger = logging.getLogger(__name__)

# ENOSPC, EDQUOT, EFBIG: the record does not fit; the device itself is fine.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]
T = TypeVar("T")
_OWNER_POLL_S = 0.1  # the reclaimer waits on the loop in steps this long ...
_OWNER_WAIT_S = 30.0  # ... this long at most (the loop is stuck or stopping)


class _LoopOwner:
    """The tier's RecordOwner, answered on the event loop (where the catalog lives) from
    the reclaimer's thread: one callback a chunk (a few ms), so the loop never stalls."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        owner: RecordOwner,
        closing: Callable[[], bool],
    ) -> None:
        self._loop = loop
        self._owner = owner
        self._closing = closing

    def _on_loop(self, fn: Callable[[], T]) -> T:
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            return fn()  # asked from the loop's own thread (a test calling reclaim)
        done: Future[T] = Future()

        def run() -> None:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn())
                except BaseException as err:
                    done.set_exception(err)

        self._loop.call_soon_threadsafe(run)
        waited_s = 0.0
        while True:
            try:
                return done.result(_OWNER_POLL_S)
            except FutureTimeout:
                waited_s += _OWNER_POLL_S
                if self._closing() or waited_s >= _OWNER_WAIT_S:
                    done.cancel()
                    raise OSError(errno.ECANCELED, "the catalog did not answer reclaim") from None

    def live(self, headers: Sequence[RecordHeader], locations: Sequence[int]) -> list[bool]:
        return self._on_loop(lambda: self._owner.live(headers, locations))

    def moved(
        self, headers: Sequence[RecordHeader], old: Sequence[int], new: Sequence[int]
    ) -> list[bool]:
        return self._on_loop(lambda: self._owner.moved(headers, old, new))


class ReadStatus(enum.Enum):
    OK = "ok"
    CORRUPT = "corrupt"  # failed verification: drop it now
    MISSING = "missing"  # the file is gone: forget it
    IO_ERROR = "io_error"  # perhaps transient: kept until it fails again
    OFFLINE = "offline"  # the tier is offline: not tried


@dataclass(frozen=True, slots=True)
class Read:
    status: ReadStatus
    service_s: float = 0.0  # the drive's time on the I/O thread (not the queue's)
    buffer: mmap.mmap | None = None  # `read`: the record's bytes ...
    offset: int = 0  # ... and where its payload starts in them

    @property
    def ok(self) -> bool:
        return self.status is ReadStatus.OK


class NvmeDriver:
    """Create, `await open()`, use, `await close()`. Every method runs on the event loop;
    the I/O runs on `io`'s threads."""

    def __init__(
        self, config: NvmeConfig, io: IoPool, spawn: Spawn, take_generation: Callable[[], int]
    ) -> None:
        layout = SegmentTier if config.layout == "segments" else NvmeTier
        self.tier = layout.from_config(config)
        self.io = io
        self.health = TierHealth("nvme", config.offline_after_errors)
        self._offline_retry_s = config.offline_retry_s
        self._spawn = spawn
        self._take_generation = take_generation
        self._unremoved: list[tuple[RecordHeader, int]] = []
        self._unwritten_tombstones: list[tuple[BlockId, int]] = []
        # Records the catalog dropped (evicted, unreadable, ...) that may still be on disk:
        # the newest such generation per block. A new value of the block must not be
        # acknowledged until that record cannot come back at a restart (else a SIGKILL
        # revives the old bytes: found by the soak).
        self._removing: dict[BlockId, int] = {}
        self._watch_task: asyncio.Task[None] | None = None

    @property
    def online(self) -> bool:
        return self.health.online

    @property
    def capacity_bytes(self) -> int:
        return self.tier.capacity_bytes

    def segment_counters(self) -> SegmentCounters | None:
        """What the segment layout has written and reclaimed since start (None for the
        file layout): plain ints its I/O and reclaim threads keep, read as they stand."""
        tier = self.tier
        if not isinstance(tier, SegmentTier):
            return None
        return SegmentCounters(
            tier.written_bytes,
            tier.relocated_bytes,
            tier.reclaimed_segments,
            tier.allocated_bytes,
            tier.write_amplification,
        )

    @property
    def refused_files(self) -> int:
        """Files refused since start for not being regular files (links, FIFOs, ...)."""
        return self.tier.refused.count

    async def open(self) -> int | None:
        """Ready the tier for new records (its index is recovered after: engine/recovery.py)
        and start the health watcher. Returns this run's first generation, or None for a
        tier without an epoch, which must be recovered before it takes a record
        (`claim_epoch`)."""
        await self.io.run(self.tier.prepare)
        self._watch_task = asyncio.ensure_future(self._watch_forever())
        return self.tier.first_generation

    async def claim_epoch(self, above_generation: int) -> int:
        """This run's first generation, above every generation recovery found."""
        return await self.io.run(self.tier.epoch.claim_above, above_generation)

    async def stop_watching(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
            self._watch_task = None

    async def close(self) -> None:
        await self.stop_watching()
        # Records are complete files once renamed; this makes them survive a power loss
        # too, so a restart after a clean stop finds every one of them.
        try:
            await self.io.run(self.tier.sync)
        except OSError as err:
            logger.warning("could not sync the NVMe tier to disk: %s", err.strerror or err)

    def close_files(self) -> None:
        self.tier.close()

    def attach_owner(self, owner: RecordOwner) -> None:
        """Let the catalog keep where the segment layout's records lie (call on the event
        loop, before recovery starts); `owner_ready` once it holds every recovered one.
        Nothing for the file layout."""
        tier = self.tier
        if isinstance(tier, SegmentTier):
            loop = asyncio.get_running_loop()
            tier.attach_owner(_LoopOwner(loop, owner, lambda: tier.closing))

    def owner_ready(self) -> None:
        """The catalog holds every record recovery found: reclaim may ask it."""
        tier = self.tier
        if isinstance(tier, SegmentTier):
            tier.owner_ready()

    # ---- data ---------------------------------------------------------------------------
    async def read(self, header: RecordHeader, location: int = 0) -> Read:
        """The verified record into a fresh buffer (a gRPC Get streams it from there).
        `location`: where the catalog has it (the segment layout's; 0 for files)."""
        if not self.health.online:
            return Read(ReadStatus.OFFLINE)
        try:
            (buf, offset), service_s = await self.io.run_timed(self.tier.read, header, location)
        except (CorruptRecord, OSError) as err:
            return Read(self._read_failed(err))
        self.health.succeeded()
        return Read(ReadStatus.OK, service_s, buf, offset)

    async def read_into(self, header: RecordHeader, payload: memoryview, location: int = 0) -> Read:
        """The verified payload into `payload` (an arena extent: a promotion)."""
        if not self.health.online:
            return Read(ReadStatus.OFFLINE)
        try:
            _, service_s = await self.io.run_timed(self.tier.read_into, header, payload, location)
        except (CorruptRecord, OSError) as err:
            return Read(self._read_failed(err))
        self.health.succeeded()
        return Read(ReadStatus.OK, service_s)

    async def write(self, header: RecordHeader, payload: list[memoryview], then: str) -> Placed:
        """Write a record; its size on disk (0 if it could not be written: `then` says in
        the log what becomes of the block) and where it lies. The caller records the
        location in the catalog before its next await (reclaim asks the catalog only
        after `settle`, which is called here, on the loop, as this returns)."""
        job = asyncio.ensure_future(self.io.run(self.tier.write_placed, header, payload))
        try:
            placed = await asyncio.shield(job)
        except asyncio.CancelledError:
            # The write goes on; whoever waited is gone, so nobody records it: settle it
            # when it ends (the record is dead, its room counted until a reclaim asks).
            job.add_done_callback(self._settle_abandoned)
            raise
        except OSError as err:
            self.failed(err)
            logger.warning(
                "could not write a %s record to NVMe (%s); the block %s",
                human_size(header.record_bytes),
                err.strerror or err,
                then,
            )
            return Placed(0)
        self.health.succeeded()
        self.tier.settle(placed.location)
        return placed

    def _settle_abandoned(self, job: asyncio.Future[Placed]) -> None:
        if not job.cancelled() and job.exception() is None:
            self.tier.settle(job.result().location)

    def _read_failed(self, err: Exception) -> ReadStatus:
        if isinstance(err, CorruptRecord):
            logger.warning(
                "NVMe record failed verification (%s); served as a miss and dropped", err
            )
            return ReadStatus.CORRUPT
        if isinstance(err, FileNotFoundError):
            logger.warning("NVMe record missing from disk; served as a miss and forgotten")
            return ReadStatus.MISSING
        assert isinstance(err, OSError)
        self.failed(err)
        logger.warning("NVMe record unreadable (%s); served as a miss", err)
        return ReadStatus.IO_ERROR

    # ---- durability of deletes ------------------------------------------------------------
    async def tombstone(self, block_id: BlockId, generation: int) -> None:
        """Make sure no record of `block_id` up to `generation` comes back after a crash."""
        ns_id, key = block_id
        if self.health.online:
            try:
                await self.io.run(self.tier.tombstone, ns_id, key, generation)
                self.health.succeeded()
                return
            except OSError as err:
                self.failed(err, "write a tombstone")
        # Retried by the watcher; until then a crash may resurrect the deleted record.
        self._unwritten_tombstones.append((block_id, generation))

    def removal_pending(self, block_id: BlockId) -> int:
        """The newest generation of `block_id` whose record is still being removed (0:
        none): a new value must tombstone it before it is acknowledged."""
        return self._removing.get(block_id, 0)

    def schedule_removal(self, header: RecordHeader, location: int = 0) -> None:
        """Remove a record the catalog no longer has (it was at `location`), in the
        background."""
        self.schedule_removals([(header, location)])

    def schedule_removals(self, removals: list[tuple[RecordHeader, int]]) -> None:
        """`schedule_removal` of each (header, location), as one I/O-pool job: a cache at
        its capacity evicts a record for every one it writes, and a task and a thread hop
        each cost the loop more than the removal itself."""
        if not removals:
            return
        for header, _ in removals:
            block_id = (header.ns_id, header.key)
            self._removing[block_id] = max(self._removing.get(block_id, 0), header.generation)
        self._spawn(self._remove_many(removals))

    async def _remove_many(self, removals: list[tuple[RecordHeader, int]]) -> None:
        # Per record None (removed, or already gone) or the OSError that failed it.
        results = await self.io.run(self.tier.remove_many, removals)
        failed = False
        for (header, location), result in zip(removals, results, strict=True):
            if result is not None:
                if not failed:  # one warning (and one count of a failure) for the batch
                    self.failed(result, "remove a record")
                    failed = True
                # Retried by the watcher: disk must not leak.
                self._unremoved.append((header, location))
                continue
            block_id = (header.ns_id, header.key)
            if self._removing.get(block_id) == header.generation:
                del self._removing[block_id]
        if not failed:
            self.health.succeeded()

    # ---- health ---------------------------------------------------------------------------
    def failed(self, err: OSError, doing: str = "") -> None:
        if doing:
            logger.warning("could not %s on NVMe: %s", doing, err.strerror or err)
        if err.errno not in _FULL_ERRNOS:  # a full disk is not a failing one
            self.health.failed(err)

    async def _watch_forever(self) -> None:
        """Probe an offline tier until it works again, then finish what failed on it."""
        interval_s = self._offline_retry_s
        while True:
            await asyncio.sleep(interval_s if not self.health.online else interval_s / 4)
            try:
                if not self.health.online:
                    if not await self._probe():
                        continue
                    self.health.recovered()
                await self._retry_failed_work()
            except Exception:  # the watcher must outlive any one failure
                logger.exception("NVMe health check failed")

    async def _probe(self) -> bool:
        """Write, read back and remove one small record; True if all of it worked."""
        key = b"probe"
        payload = aligned_buffer(4096)
        header = RecordHeader(
            ns_id=CALIBRATION_NS_ID,
            key=key,
            generation=self._take_generation(),
            payload_bytes=4096,
            xxh3_64=xxhash.xxh3_64_intdigest(payload),
            header_bytes=header_size_for(CALIBRATION_NS_ID, key),
        )
        try:
            await self.io.run(self.tier.write, header, [memoryview(payload)])
            await self.io.run(self.tier.read, header)
            await self.io.run(self.tier.remove, header)
            return True
        except (OSError, CorruptRecord) as err:
            # `payload` is not closed here: the traceback may still hold views of it.
            logger.info("NVMe tier still failing its probe: %s", err)
            return False

    async def _retry_failed_work(self) -> None:
        tombstones, self._unwritten_tombstones = self._unwritten_tombstones, []
        for block_id, generation in tombstones:
            await self.tombstone(block_id, generation)
        removals, self._unremoved = self._unremoved, []
        if removals:
            await self._remove_many(removals)

    # ---- batches (the demoter: kvtier/engine/demoter.py) -----------------------------------
    async def write_batch(
        self, headers: list[RecordHeader], payloads: list[list[memoryview]], then: str
    ) -> BatchWritten:
        """Write several records as one I/O-pool job, so a batch costs the event loop one
        wake-up, not one per record. On the I/O thread each payload is first checked
        against its header's xxh3 (a block whose DRAM bytes were damaged is never written:
        `damaged`), then the rest go to the tier's `write_many` (segments: one reservation,
        one pwritev). `then` says in the log what becomes of blocks not written."""
        count = len(headers)
        if not self.health.online or not count:
            return BatchWritten((0,) * count, (False,) * count, 0.0, (0,) * count)

        def job() -> tuple[list[Placed | OSError], list[bool]]:
            # One call checks the batch (in C, the GIL let go for all of it: record_batch).
            sums = digests(payloads, [h.payload_bytes for h in headers])
            damaged = [s != h.xxh3_64 for s, h in zip(sums, headers, strict=True)]
            keep = [i for i in range(count) if not damaged[i]]
            written = self.tier.write_many_placed(
                [headers[i] for i in keep], [payloads[i] for i in keep]
            )
            results: list[Placed | OSError] = [Placed(0)] * count
            for i, result in zip(keep, written, strict=True):
                results[i] = result
            return results, damaged

        batch = asyncio.ensure_future(self.io.run_timed(job))
        try:
            (results, damaged), service_s = await asyncio.shield(batch)
        except asyncio.CancelledError:
            batch.add_done_callback(self._settle_abandoned_batch)  # as in `write`
            raise
        # One pass over the batch (on the loop): each record's size and location, 0 for
        # one not written, and the errors.
        sizes, locations, settled = [0] * count, [0] * count, []
        errors: dict[int, OSError] = {}
        for i, r in enumerate(results):
            if isinstance(r, OSError):
                errors[id(r)] = r
            elif r.record_bytes:
                sizes[i], locations[i] = r.record_bytes, r.location
                settled.append(r.location)
        # The caller records these locations before its next await.
        self.tier.settle_many(settled)
        for err in errors.values():  # one failed pwritev is one error, not one per record
            self.failed(err)
        if errors:
            failed = sum(isinstance(r, OSError) for r in results)
            logger.warning(
                "could not write %d of %d records to NVMe (%s); the blocks %s",
                failed,
                count,
                ", ".join(sorted({e.strerror or str(e) for e in errors.values()})),
                then,
            )
        if settled:
            self.health.succeeded()
        return BatchWritten(tuple(sizes), tuple(damaged), service_s, tuple(locations))

    def _settle_abandoned_batch(
        self, job: asyncio.Future[tuple[tuple[list[Placed | OSError], list[bool]], float]]
    ) -> None:
        if job.cancelled() or job.exception() is not None:
            return
        self.tier.settle_many(
            [r.location for r in job.result()[0][0] if isinstance(r, Placed) and r.record_bytes]
        )


@dataclass(frozen=True, slots=True)
class SegmentCounters:
    """The segment layout's writes and reclaim since start (`segment_counters`)."""

    written_bytes: int  # records callers wrote
    relocated_bytes: int  # live records reclaim copied out of segments it freed
    reclaimed_segments: int
    allocated_bytes: int  # segment files on disk now
    write_amplification: float  # (written + relocated) / written; 1.0 before any write


@dataclass(frozen=True, slots=True)
class BatchWritten:
    """What `write_batch` did, per record in order: its size on disk (0: not written) and
    whether its payload failed its checksum (so it was not written); the batch's seconds
    on its I/O thread."""

    record_bytes: tuple[int, ...]
    damaged: tuple[bool, ...]
    service_s: float
    locations: tuple[int, ...]  # where each record lies (the segment layout's; else 0)
