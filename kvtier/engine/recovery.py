"""NvmeRecovery: the NVMe index filled from the record headers on disk, in the background
while the daemon serves (or before it does: `run_now`).

`NvmeTier.recover` reads the headers on a thread of its own (not the I/O pool: a scan of
minutes must not look like a stuck disk to the watchdog). Each fan directory it finishes
is added to the catalog here, on the event loop, in slices of at most SLICE_S with a yield
between, so the loop never stalls on it. Until its fan is added a block is a miss.

What keeps every answer right meanwhile (docs/design.md, "Serving while the index fills"):
* this run's generations are above every earlier one (the tier's claimed epoch), so the
  scan tells this run's records by their names and leaves them alone;
* a put or delete of a block whose fan is not added yet first buries the block's old
  records (`bury`: a tombstone of every generation before this run, awaited before the
  call is acknowledged) and marks it touched: a record of it the scan finds later is
  removed, never added, so a delete stays a delete and an overwrite never reverts, also
  across a SIGKILL; so is one of a block this run already holds (a remote fetch);
* NVMe room counts an estimate of the bytes not yet added (`nvme_unindexed_bytes`); once
  every fan is in, the policy evicts whatever is over capacity;
* the tombstone logs of earlier runs are removed only after a complete recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvtier._malloc import trim_heap, trimming_as_freed
from kvtier.engine.blocks import record_header, record_location
from kvtier.engine.calibrate import CALIBRATION_NS_ID
from kvtier.engine.nvme import NvmeDriver
from kvtier.engine.residency import Residency
from kvtier.engine.results import Counters
from kvtier.index.catalog import Entry
from kvtier.sizes import human_size
from kvtier.tiers.record import RecordHeader
from kvtier.tiers.segment_recovery import FanColumns
from kvtier.tiers.segments import SegmentTier
from kvtier.tiers.startup import FanScan, RecoveredRecord, RecoveryReport
from kvtier.types import BlockId
from kvtier.workers import lower_priority

logger = logging.getLogger(__name__)

SLICE_S = 0.002  # longest run of catalog additions between two yields to the event loop
# The segment layout's fans go in as columns, in chunks sized (from the time the last one
# took) to about this much loop time each: a chunk is one bulk call, so this bounds the
# loop's stall while keeping the per-call overhead small. A probe wake-up can wait for two
# chunks (the one running and the next, queued before its timer), and chunks run over
# their estimate: 4 ms made gaps of 17-19 ms at 1 M records.
BULK_SLICE_S = 0.002
_FIRST_CHUNK = 256
_MAX_CHUNK = 1 << 16
FANS = frozenset(f"{fan:02x}" for fan in range(256))
# Fans differ in what they hold by chance (~5 % apart at 100 k small records): the bytes
# not yet added are estimated as the mean of the fans added so far times those left, plus
# this much, and only once enough is known (before: no room for new records), so that
# writes meanwhile rarely overfill the tier; what the estimate missed is evicted once every
# fan is in.
_ESTIMATE_MARGIN = 1.05
_ESTIMATE_AFTER_RECORDS = 64  # found in the fans added so far, or ...
_ESTIMATE_AFTER_FANS = 16
# The segment layout's scan makes each fan's record objects just before handing it out;
# it waits while this many fans are handed and not yet added, so that only a few fans'
# objects are alive at once (a million alive together left their heap, fragmented by the
# catalog's allocations in between, resident after the restart: ~400 B a block).
_FANS_AHEAD = 4
_FAN_WAIT_POLL_S = 0.1


class NvmeRecovery:
    """Create after `NvmeDriver.open`, then `start()` (background) or `await run_now()`;
    `pending` / `bury` from the store's put and delete while it runs; `await stop()`
    before the tier closes. `complete` once every fan is in the catalog."""

    def __init__(
        self,
        driver: NvmeDriver,
        residency: Residency,
        counters: Counters,
        first_generation: int | None,
    ) -> None:
        self._driver = driver
        self._residency = residency
        self._counters = counters
        self._first_generation = first_generation
        self._pending_fans = set(FANS)  # not yet (entirely) in the catalog
        self._touched: dict[BlockId, asyncio.Task[None]] = {}
        self._touched_by_fan: dict[str, set[BlockId]] = {}  # the same blocks, by fan
        self._chunk = _FIRST_CHUNK  # rows per bulk add (adapted to BULK_SLICE_S)
        self._fans_added = 0
        self._records_added = 0  # found in the added fans (before any was dropped)
        self._bytes_added = 0  # record bytes found in the fans added (before any was dropped)
        self.indexed = 0  # records added to the catalog
        self.dropped = 0  # records found but not added (touched, held already, calibration)
        self.max_generation = 0  # of the records found
        self.complete = False
        self.running = False
        self.elapsed_s = 0.0
        self._done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._scan: Future[RecoveryReport] | None = None
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="kvtier-recover", initializer=lower_priority
        )
        self._window = (
            threading.Semaphore(_FANS_AHEAD) if isinstance(driver.tier, SegmentTier) else None
        )
        self._stopping = threading.Event()
        residency.nvme_unindexed_bytes = driver.capacity_bytes  # no room until a fan is in

    # ---- for the store's flows ---------------------------------------------------------
    def pending(self, block_id: BlockId) -> bool:
        """Whether records of `block_id` may still be on disk, not yet in the catalog."""
        return bool(self._pending_fans) and self._driver.tier.fan(*block_id) in self._pending_fans

    async def bury(self, block_id: BlockId) -> None:
        """Before a put or delete of a `pending` block is acknowledged: every record of it
        from an earlier run is tombstoned (durably, once per block), and the scan will
        remove, not add, the one it finds."""
        task = self._touched.get(block_id)
        if task is None:
            assert self._first_generation is not None, "no puts before the epoch is claimed"
            task = asyncio.ensure_future(
                self._driver.tombstone(block_id, self._first_generation - 1)
            )
            self._touched[block_id] = task
            self._touched_by_fan.setdefault(self._driver.tier.fan(*block_id), set()).add(block_id)
        await asyncio.shield(task)

    async def wait(self) -> None:
        """Until the recovery has ended (complete, failed or stopped)."""
        await self._done.wait()

    # ---- lifecycle -------------------------------------------------------------------------
    def _own_records(self) -> None:
        """The catalog keeps the segment layout's record locations (see NvmeDriver)."""
        residency = self._residency
        self._driver.attach_owner(_CatalogOwner(residency))

    def start(self) -> None:
        self._own_records()
        self.running = True
        self._task = asyncio.ensure_future(self._run_in_background())

    async def run_now(self) -> None:
        """Recover before serving: every record, added in generation order (oldest first in
        the policy's order); an error raises."""
        self._own_records()
        self.running = True
        started_s = time.perf_counter()
        try:
            self._scan = self._executor.submit(self._driver.tier.recover)
            report = await asyncio.wrap_future(self._scan)
            for record in sorted(report.records, key=lambda r: r.header.generation):
                self._add(record)
            _out_of_the_collectors_way()
            self._pending_fans.clear()
            self.max_generation = max(report.max_generation, report.max_tombstone_generation)
            await self._finish(report, started_s)
        finally:
            self.running = False
            self._done.set()
            self._executor.shutdown(wait=False)

    async def stop(self) -> None:
        """End the scan (within a few files) and stop adding; idempotent."""
        self._stopping.set()
        self._driver.tier.stop_recovery()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._scan is not None:  # its thread must be done before the tier closes
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(self._scan)
        self._executor.shutdown(wait=False)

    async def _run_in_background(self) -> None:
        loop = asyncio.get_running_loop()

        fans: asyncio.Queue[FanScan | FanColumns | None] = asyncio.Queue()

        def wait_window() -> bool:
            if self._window is not None:
                while not self._window.acquire(timeout=_FAN_WAIT_POLL_S):
                    if self._stopping.is_set():
                        return False  # nobody adds it any more
            return True

        def on_fan(fan_scan: FanScan) -> None:  # on the scan's thread, not the loop
            if wait_window():
                fan_scan.records.sort(key=lambda r: r.header.generation)
                loop.call_soon_threadsafe(fans.put_nowait, fan_scan)

        def on_columns(fan_cols: FanColumns) -> None:  # on the scan's thread, oldest first
            if wait_window():
                loop.call_soon_threadsafe(fans.put_nowait, fan_cols)

        tier = self._driver.tier
        recover: Callable[[], RecoveryReport]
        if isinstance(tier, SegmentTier):

            def recover() -> RecoveryReport:
                return tier.recover_columns(on_columns)
        else:

            def recover() -> RecoveryReport:
                return tier.recover(on_fan)

        def scan() -> RecoveryReport:
            try:
                return recover()
            finally:
                loop.call_soon_threadsafe(fans.put_nowait, None)

        # The scan's arrays are made on its threads' arenas and freed as it goes: handed
        # back as they are freed (trimming_as_freed says why).
        with trimming_as_freed():
            started_s = time.perf_counter()
            self._scan = self._executor.submit(scan)
            try:
                while (fan_scan := await fans.get()) is not None:
                    await self._add_fan(fan_scan)
                    del fan_scan  # its records may go before the next fan is made
                    if self._window is not None:
                        self._window.release()
                report = await asyncio.wrap_future(self._scan)
                if report.complete:
                    self._pending_fans.clear()  # a fan with no directory holds nothing
                    await self._finish(report, started_s)
            except OSError as err:
                logger.error(
                    "NVMe index recovery failed (%s) after %d records: the blocks not yet "
                    "indexed stay misses until a restart",
                    err.strerror or err,
                    self.indexed,
                )
            finally:
                self._stopping.set()  # a scan waiting to hand a fan over gives up
                self.running = False
                self._done.set()
                self._executor.shutdown(wait=False)

    # ---- adding ------------------------------------------------------------------------------
    async def _add_fan(self, fan_scan: FanScan | FanColumns) -> None:
        """A fan's records (oldest first), in slices between yields to the loop."""
        if isinstance(fan_scan, FanColumns):
            await self._add_fan_columns(fan_scan)
            count = len(fan_scan)
        else:
            records = fan_scan.records
            count = len(records)
            done = 0
            while done < len(records):
                deadline_s = time.perf_counter() + SLICE_S
                while done < len(records):
                    self._add(records[done])
                    done += 1
                    if not done % 32 and time.perf_counter() >= deadline_s:
                        break
                await asyncio.sleep(0)
            _out_of_the_collectors_way()
        self._pending_fans.discard(fan_scan.fan)
        self._fans_added += 1
        self._records_added += count
        if (
            self._records_added >= _ESTIMATE_AFTER_RECORDS
            or self._fans_added >= _ESTIMATE_AFTER_FANS
        ):
            left = len(self._pending_fans)
            self._residency.nvme_unindexed_bytes = int(
                self._bytes_added / self._fans_added * left * _ESTIMATE_MARGIN
            )

    def _add(self, record: RecoveredRecord) -> None:
        h = record.header
        block_id = (h.ns_id, h.key)
        self.max_generation = max(self.max_generation, h.generation)
        self._bytes_added += h.record_bytes
        if (
            h.ns_id == CALIBRATION_NS_ID  # a crash during the last calibration
            or block_id in self._touched
            or self._residency.contains(block_id)
        ):
            self._driver.schedule_removal(h, record.location)
            self.dropped += 1
            return
        # Into the catalog's arrays: no Entry (nor anything else) per record outlives this.
        self._residency.add_recovered(
            block_id, h.payload_bytes, h.xxh3_64, h.generation, h.record_bytes, record.location
        )
        self.indexed += 1

    async def _add_fan_columns(self, fan: FanColumns) -> None:
        """A fan in columns, in chunks of about BULK_SLICE_S between yields."""
        done = 0
        while done < len(fan):
            upto = min(done + self._chunk, len(fan))
            started_s = time.perf_counter()
            self._add_rows(fan, done, upto)
            took_s = time.perf_counter() - started_s
            # The next chunk sized from this one's rate (halved at most, doubled at most).
            rate = (upto - done) / max(took_s, 1e-6)
            self._chunk = int(min(max(rate * BULK_SLICE_S, self._chunk / 2, 16), _MAX_CHUNK))
            self._chunk = min(self._chunk, 2 * (upto - done))
            done = upto
            await asyncio.sleep(0)

    def _add_rows(self, fan: FanColumns, lo: int, hi: int) -> None:
        """`_add` of rows [lo, hi) of a fan, in one bulk call for those the catalog takes."""
        cols = fan.columns.take(slice(lo, hi))
        self.max_generation = max(self.max_generation, int(cols.generation.max()))
        self._bytes_added += int(cols.record_bytes.sum())
        drop = np.zeros(len(cols), dtype=bool)
        if CALIBRATION_NS_ID in cols.ns_names:  # a crash during the last calibration
            drop |= cols.ns == cols.ns_names.index(CALIBRATION_NS_ID)
        touched = self._touched_by_fan.get(fan.fan)
        if touched:
            if cols.digest is None:
                maybe = np.arange(len(cols))
            else:
                digest = self._residency.catalog.digest
                near = np.array([digest(b) for b in touched], dtype=np.uint64)
                maybe = np.nonzero(np.isin(cols.digest, near))[0]
            for i in maybe.tolist():
                if cols.block_id(i) in touched:
                    drop[i] = True
        keep = np.nonzero(~drop)[0]
        slots = self._residency.add_recovered_many(cols.take(keep))
        refused = np.concatenate([np.nonzero(drop)[0], keep[slots < 0]])  # held already
        for i in refused.tolist():
            self._driver.schedule_removal(fan.header(lo + i), int(cols.location[i]))
        self.dropped += len(refused)
        self.indexed += len(keep) - int(np.count_nonzero(slots < 0))

    async def _finish(self, report: RecoveryReport, started_s: float) -> None:
        """Every fan is in: room made, the old tombstone logs removed, the totals logged."""
        self._touched.clear()
        self._touched_by_fan.clear()
        self._residency.nvme_unindexed_bytes = 0
        self._counters.checksum_failures += report.dropped_corrupt
        dropped: list[Entry] = self._residency.make_nvme_room(0)[1]
        for entry in dropped:
            self._driver.schedule_removal(record_header(entry), record_location(entry))
        await self._driver.io.run(self._driver.tier.compact_tombstones)
        self.complete = True
        self.elapsed_s = time.perf_counter() - started_s
        # The scan's headers, keys and lists are freed by now, but glibc keeps the heap they
        # grew (the daemon's trim threshold is 1 GiB): hand it back, on the scan's thread (a
        # trim walks the heap: milliseconds at a million records).
        await asyncio.get_running_loop().run_in_executor(self._executor, trim_heap)
        tier = self._driver.tier
        logger.info(
            "NVMe tier at %s: recovered %d blocks (%s) in %.1f s, dropped %d unreadable, "
            "%d stale and %d deleted records, removed %d temporary files; direct I/O %s",
            tier.root,
            self.indexed,
            human_size(self._residency.catalog.nvme_used_bytes),
            self.elapsed_s,
            report.dropped_corrupt,
            report.dropped_stale,
            report.dropped_deleted,
            report.removed_temporary,
            "on" if tier.direct_io else "off",
        )
        # Last: reclaim may now ask the catalog (it holds every record found), and the line
        # above is out before any reclaim of this run (the fault tests wait for it).
        self._driver.owner_ready()


class _CatalogOwner:
    """The segment tier's RecordOwner: the residency's catalog (on the event loop)."""

    def __init__(self, residency: Residency) -> None:
        self._residency = residency

    def live(self, headers: Sequence[RecordHeader], locations: Sequence[int]) -> list[bool]:
        return self._residency.records_held(headers, locations)

    def moved(
        self, headers: Sequence[RecordHeader], old: Sequence[int], new: Sequence[int]
    ) -> list[bool]:
        return self._residency.records_moved(headers, old, new)


def _out_of_the_collectors_way() -> None:
    """The records just added live as long as the daemon: move them (with everything else
    alive now, young garbage collected first) out of the cyclic collector's generations.
    Else every full collection walks all of them, holding the GIL: 111 ms at 100 k records
    here, seconds at millions, many times over while the index grows. gc.freeze is O(1)."""
    gc.collect(1)
    gc.freeze()
