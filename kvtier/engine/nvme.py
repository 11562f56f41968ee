"""NvmeDriver: the NVMe tier (kvtier/tiers/nvme.py) run on the I/O pool, with its health,
its retries and the tombstone barrier.

It speaks record headers and memory views, never catalog entries, and answers with
outcomes (a `Read` whose `status` says ok / corrupt / missing / I/O error / offline) that
the store applies through `Residency`. What must not be forgotten when the disk fails is
kept here and retried by the health watcher: records to remove (else they leak disk) and
tombstones to write (else a restart could bring a deleted block back).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import mmap
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.config import NvmeConfig
from kvtier.engine.calibrate import CALIBRATION_NS_ID
from kvtier.engine.health import TierHealth
from kvtier.errors import CorruptRecord
from kvtier.movers.io import IoPool
from kvtier.sizes import human_size
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for
from kvtier.tiers.segments import SegmentTier
from kvtier.types import BlockId

logger = logging.getLogger(__name__)

# ENOSPC, EDQUOT, EFBIG: the record does not fit; the device itself is fine.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


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
        self._unremoved: list[RecordHeader] = []
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

    @property
    def write_amplification(self) -> float:
        """Bytes written to disk per byte of records written (the segment layout's reclaim
        re-appends live records; 1.0 for the file layout). For `kvtier replay` and the
        metrics to report."""
        tier = self.tier
        return tier.write_amplification if isinstance(tier, SegmentTier) else 1.0

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

    # ---- data ---------------------------------------------------------------------------
    async def read(self, header: RecordHeader) -> Read:
        """The verified record into a fresh buffer (a gRPC Get streams it from there)."""
        if not self.health.online:
            return Read(ReadStatus.OFFLINE)
        try:
            (buf, offset), service_s = await self.io.run_timed(self.tier.read, header)
        except (CorruptRecord, OSError) as err:
            return Read(self._read_failed(err))
        self.health.succeeded()
        return Read(ReadStatus.OK, service_s, buf, offset)

    async def read_into(self, header: RecordHeader, payload: memoryview) -> Read:
        """The verified payload into `payload` (an arena extent: a promotion)."""
        if not self.health.online:
            return Read(ReadStatus.OFFLINE)
        try:
            _, service_s = await self.io.run_timed(self.tier.read_into, header, payload)
        except (CorruptRecord, OSError) as err:
            return Read(self._read_failed(err))
        self.health.succeeded()
        return Read(ReadStatus.OK, service_s)

    async def write(self, header: RecordHeader, payload: list[memoryview], then: str) -> int:
        """Write a record; its size on disk, or 0 if it could not be written (`then` says
        in the log what becomes of the block)."""
        try:
            record_bytes = await self.io.run(self.tier.write, header, payload)
        except OSError as err:
            self.failed(err)
            logger.warning(
                "could not write a %s record to NVMe (%s); the block %s",
                human_size(header.record_bytes),
                err.strerror or err,
                then,
            )
            return 0
        self.health.succeeded()
        return record_bytes

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

    def schedule_removal(self, header: RecordHeader) -> None:
        """Remove a record the catalog no longer has, in the background."""
        block_id = (header.ns_id, header.key)
        self._removing[block_id] = max(self._removing.get(block_id, 0), header.generation)
        self._spawn(self._remove(header))

    async def _remove(self, header: RecordHeader) -> None:
        try:
            await self.io.run(self.tier.remove, header)
        except FileNotFoundError:
            pass
        except OSError as err:
            self.failed(err, "remove a record")
            self._unremoved.append(header)  # retried by the watcher: disk must not leak
            return
        else:
            self.health.succeeded()
        block_id = (header.ns_id, header.key)
        if self._removing.get(block_id) == header.generation:
            del self._removing[block_id]

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
        headers, self._unremoved = self._unremoved, []
        for header in headers:
            await self._remove(header)

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
            return BatchWritten((0,) * count, (False,) * count, 0.0)

        def job() -> tuple[list[int | OSError], list[bool]]:
            damaged = [not _payload_intact(h, p) for h, p in zip(headers, payloads, strict=True)]
            keep = [i for i in range(count) if not damaged[i]]
            written = self.tier.write_many([headers[i] for i in keep], [payloads[i] for i in keep])
            results: list[int | OSError] = [0] * count
            for i, result in zip(keep, written, strict=True):
                results[i] = result
            return results, damaged

        (results, damaged), service_s = await self.io.run_timed(job)
        errors = {id(r): r for r in results if isinstance(r, OSError)}
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
        if any(isinstance(r, int) and r for r in results):
            self.health.succeeded()
        return BatchWritten(
            tuple(r if isinstance(r, int) else 0 for r in results), tuple(damaged), service_s
        )


@dataclass(frozen=True, slots=True)
class BatchWritten:
    """What `write_batch` did, per record in order: its size on disk (0: not written) and
    whether its payload failed its checksum (so it was not written); the batch's seconds
    on its I/O thread."""

    record_bytes: tuple[int, ...]
    damaged: tuple[bool, ...]
    service_s: float


def _payload_intact(header: RecordHeader, payload: list[memoryview]) -> bool:
    """Whether a payload (views of DRAM) still holds the bytes its header's xxh3 names."""
    hasher = xxhash.xxh3_64()
    left = header.payload_bytes
    for view in payload:
        if left <= 0:
            break
        hasher.update(view[:left])
        left -= len(view)
    return bool(hasher.intdigest() == header.xxh3_64)
