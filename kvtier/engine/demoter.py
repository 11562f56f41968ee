"""Demoter: the write path from DRAM to NVMe, off the caller and in batches.

Demotion used to run inside the Reserve that found no room: a few victims a round, each
victim's DRAM bytes hashed on the event loop, one I/O-pool job and one event-loop wake-up
per record. Here it runs ahead of the puts:

* when a tenant's arena has less than `dram.demote_free_fraction` of it free (counting
  what batches in flight will free), the policy's victims (`Residency.dram_victims`) are
  claimed, up to twice that fraction, in batches of at most `BATCH_BYTES` /
  `BATCH_RECORDS`, at most one batch per I/O thread in flight;
* each batch is one I/O-pool job (`NvmeDriver.write_batch`): the victims' DRAM bytes are
  checked against their checksums on the I/O thread (a damaged block is never written,
  and is dropped), then written by the tier's `write_many` (the segment layout: one
  reservation and one pwritev for the batch); one completion per batch on the loop;
* a Reserve that still finds no room (`make_room`) only claims a batch (a decision, no
  I/O) if none is in flight, and waits for space to be freed; it waits bounded, in
  DramSpace, only when DRAM is full of blocks pinned, being written, or reserved.

Write-through (`policy.admission = "write_through"`) and flush use the same batches but
keep the DRAM copy. What a demotion did before is kept: admission (`admit_on_evict`),
the remote tier's `on_evict` put, NVMe room made by dropping the policy's NVMe victims, a
reader that pinned a victim keeping its DRAM copy, the `store.evict` failpoint, counters.
Without an NVMe tier (or while it is offline) nothing is demoted ahead: a victim is then
dropped, so only a Reserve that needs the room evicts.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from kvtier import failpoints
from kvtier.engine.blocks import payload_of, record_header
from kvtier.engine.core import StoreCore
from kvtier.engine.nvme import NvmeDriver
from kvtier.engine.residency import Released
from kvtier.engine.shared import SharedTier
from kvtier.index.catalog import Entry
from kvtier.movers.io import IoPool
from kvtier.tiers.dram import DramTier
from kvtier.types import Extent


class DemoterStore(StoreCore, Protocol):
    """What the demoter needs of the store (a Protocol, so this module does not import
    the store that imports it)."""

    io: IoPool
    nvme: NvmeDriver | None
    shared: SharedTier

    def release_copies(self, entry: Entry, released: Released | None) -> None: ...

    def remove_records(self, dropped: list[Entry]) -> None: ...


logger = logging.getLogger(__name__)

__all__ = ["BATCH_BYTES", "BATCH_RECORDS", "Demoter", "Watermarks", "coalesced", "watermarks"]

# A batch: large enough that a 64 KiB block's share of a job's fixed costs (a thread hop,
# a loop wake-up, a syscall) is small, small enough that a few are in flight at once.
# Its completion's turns (written_many, then finish_dram_evictions: tens of µs a record
# on a loaded machine) grow with the records a batch holds: 256 4 KiB records made the
# fill's longest stalls (15-25 ms in one turn at 300 k, when completion was one turn).
# 128 lets a batch of 64 KiB blocks reach BATCH_BYTES: half the batches of 64 records,
# 0.92x the wall of a 64 KiB stream (each batch costs the loop a task, an executor hop
# and three turns, and its I/O thread a wait for the GIL after its pwritev), and the
# 1 M fill's longest stall no longer than with 64 (BENCHMARKS.md, 2026-12-07).
BATCH_BYTES = 8 << 20
BATCH_RECORDS = 128


@dataclass(frozen=True, slots=True)
class Watermarks:
    """Free bytes of an arena: below `low_bytes` the demoter starts, and it claims
    victims until `high_bytes` are free or being freed."""

    low_bytes: int
    high_bytes: int

    @property
    def step_bytes(self) -> int:
        """What one batch claims at most: half the gap, so that the next batch is claimed
        (and its write starts) while the one before it is still being written."""
        return (self.high_bytes - self.low_bytes) // 2

    @property
    def start_bytes(self) -> int:
        """Free (or being freed) bytes below which a batch is claimed: a step short of
        the high mark (never above it; at the low mark when there is no gap)."""
        return self.high_bytes - self.step_bytes


def watermarks(capacity_bytes: int, free_fraction: float) -> Watermarks:
    """The demoter's watermarks for an arena of `capacity_bytes` (pure: property-tested).
    The gap between them is what one round claims: twice the low mark, so that a stream
    of puts is demoted in batches of many blocks, not one block per put."""
    low = int(capacity_bytes * free_fraction)
    return Watermarks(low, min(capacity_bytes, 2 * low))


def claim_bytes(marks: Watermarks, free_bytes: int, claimed_bytes: int, wanted_bytes: int) -> int:
    """Bytes of victims to claim now (0: none): up to the high mark once free space plus
    what is being freed falls below `start_bytes`, or what a waiting reservation lacks.

    Claiming only below the low mark made a put stream demote one batch at a time: the
    batch in flight counts as coming, so the next was claimed only once the puts had used
    the free space up and waited, and the disk sat idle through every completion and
    claim (64 KiB blocks: one 2 MiB batch in flight, ~40 % of the stream's time). From a
    step short of the high mark, a batch is claimed while the one before is written."""
    coming = free_bytes + claimed_bytes
    target = marks.high_bytes if coming < marks.start_bytes else 0
    return max(0, max(target, wanted_bytes) - coming)


def coalesced(extents: list[Extent]) -> list[Extent]:
    """`extents` (disjoint) as the fewest extents covering the same bytes: neighbours
    merged (pure: property-tested)."""
    runs: list[Extent] = []
    for extent in sorted(extents, key=lambda e: e.offset):
        if runs and runs[-1].offset + runs[-1].size_bytes == extent.offset:
            last = runs[-1]
            runs[-1] = Extent(last.offset, last.size_bytes + extent.size_bytes)
        else:
            runs.append(extent)
    return runs


class Demoter:
    """Owned by the store: `notice(tenant)` after each DRAM reservation, `make_room` as
    DramSpace's way to make room, `write_through(entry)` for each new block under
    write-through, `flush()` at stop. Every method runs on the event loop."""

    def __init__(self, store: DemoterStore) -> None:
        self._store = store
        self._claimed_bytes: dict[str, int] = dict.fromkeys(store.space.arenas, 0)
        self._batches: dict[str, int] = dict.fromkeys(store.space.arenas, 0)
        self._through: list[Entry] = []  # new blocks waiting for a write-through batch
        self._through_batches = 0
        self.batches_written = 0  # batches that reached the I/O pool (for tests, metrics)
        # Arenas and `dram` settings are fixed for the daemon's life (a reload keeps them).
        fraction = store.config.dram.demote_free_fraction
        self._marks = {
            tenant: watermarks(arena.capacity_bytes, fraction)
            for tenant, arena in store.space.arenas.items()
        }
        self._none = Watermarks(0, 0)

    def _ahead(self) -> bool:
        # Demoting ahead of need only pays when the victims go somewhere: else it drops.
        nvme = self._store.nvme
        return nvme is not None and nvme.online

    # ---- demotion ------------------------------------------------------------------------
    def notice(self, tenant: str, wanted_bytes: int = 0) -> bool:
        """Claim victims for batches if `tenant`'s arena is below its low watermark (or a
        reservation lacks `wanted_bytes`); whether a batch is in flight after."""
        store = self._store
        arena = store.arena(tenant)
        marks = self._marks[tenant]
        free = arena.capacity_bytes - arena.used_bytes
        if not wanted_bytes and free + self._claimed_bytes[tenant] >= marks.start_bytes:
            return self._batches[tenant] > 0  # the common case, after every put: nothing
        if not self._ahead():
            marks = self._none
        most = store.io.threads
        while self._batches[tenant] < most:
            free = arena.capacity_bytes - arena.used_bytes
            need = claim_bytes(marks, free, self._claimed_bytes[tenant], wanted_bytes)
            if need <= 0 and not (wanted_bytes and not self._batches[tenant]):
                break
            # At least one victim: free bytes may be too fragmented for the block. A step
            # a batch, so that a claim of the whole gap is two batches written at once.
            step = min(BATCH_BYTES, marks.step_bytes or BATCH_BYTES)
            victims = store.residency.dram_victims(tenant, min(max(need, 1), step), BATCH_RECORDS)
            if not victims:
                break
            claimed = sum(v.dram_extent.size_bytes for v in victims if v.dram_extent is not None)
            self._claimed_bytes[tenant] += claimed
            self._batches[tenant] += 1
            store.tasks.spawn(self._demote(tenant, victims, claimed))
            wanted_bytes = 0  # what the waiting reservation lacked is being freed
        return self._batches[tenant] > 0

    async def make_room(self, tenant: str, size_bytes: int) -> bool:
        """DramSpace's `make_room`: a reservation of `size_bytes` found no extent. Claims a
        batch if none is in flight and waits until some space is freed; False if nothing
        can be demoted (every block left is pinned, being written, or there are none)."""
        store = self._store
        arena = store.arena(tenant)
        shortfall = size_bytes - (arena.capacity_bytes - arena.used_bytes)
        freed = store.space.freed  # before claiming: a batch may end before we wait
        if not self.notice(tenant, max(shortfall, 1)):
            return False
        await freed.wait()
        return True

    async def _demote(self, tenant: str, victims: list[Entry], claimed_bytes: int) -> None:
        store = self._store
        try:
            await self._demote_batch(victims)
            # The next batch of a stream is claimed in a loop turn of its own (see
            # `_demote_batch`), while this one still counts as in flight: with no batch
            # counted between them, a flush (the daemon's stop) could see none, return,
            # and leave the next one's victims unwritten.
            await asyncio.sleep(0)
        finally:
            self._claimed_bytes[tenant] -= claimed_bytes
            self._batches[tenant] -= 1
            store.space.signal()
        self.notice(tenant)  # the next batch of a stream, if it is still below the mark

    async def _demote_batch(self, victims: list[Entry]) -> None:
        store = self._store
        counters = store.counters
        finished = False
        try:
            if store.remote is not None and store.config.remote.admission == "on_evict":
                await asyncio.gather(*(store.shared.put(v) for v in victims))
            wanted: list[Entry] = []
            for entry in victims:
                if store.nvme is None or entry.nvme_record_bytes:
                    continue
                if not store.residency.admit_on_evict(entry):
                    counters.not_admitted += 1
                    continue
                wanted.append(entry)
            for _ in await self._write(wanted, "is dropped"):
                counters.demotions += 1
                counters.admitted += 1
                if failpoints.ACTIVE:
                    failpoints.fire("store.evict")
            finished = True
        finally:
            if not finished:  # not evicted: they stay where they were
                for entry in victims:
                    store.residency.end_move(entry)
        # A completion is three loop turns (the records written, the DRAM copies dropped,
        # the next batch claimed), not one: up to an I/O thread's worth of batches end
        # together, and their completions in one turn each held the loop 15-25 ms at 1 M
        # (stalltrace). The victims are still claimed (demoting) meanwhile, as during
        # their write: a reader that pins one keeps its DRAM copy, a delete is released
        # below, an NVMe eviction of a new record leaves the block DRAM-only until here.
        await asyncio.sleep(0)
        # A reader that pinned one while it was written out keeps its DRAM copy (now also
        # on NVMe, so a later eviction is free), freed no earlier than unpin. One pass for
        # the batch, and its extents freed as runs: a stream's victims were mostly put
        # one after another, so they lie side by side in the arena (the allocator merges
        # neighbours, so its free list ends the same as freeing them one by one).
        extents, released = store.residency.finish_dram_evictions(victims)
        if extents:
            arena = store.arena_of(victims[0].block_id)  # a batch is one arena's victims
            for run in coalesced(extents):
                arena.free(run)
        for entry, gone in released:
            store.release_copies(entry, gone)

    async def _write(self, entries: list[Entry], then: str) -> list[Entry]:
        """Write claimed DRAM blocks to NVMe as one batch, making room there first; the
        ones whose record was written (the residency knows of it)."""
        store = self._store
        nvme = store.nvme
        if nvme is None or not entries or not nvme.online:
            return []
        residency = store.residency
        placed = [(e, x) for e in entries if (x := e.dram_extent) is not None]
        if not placed:
            return []
        entries = [e for e, _ in placed]
        wanted = [record_header(entry) for entry in entries]
        needs = [h.record_bytes for h in wanted]
        # Room on NVMe for the whole batch at once (the victims of one arena are one
        # tenant's); record by record only if it does not all fit.
        total = sum(needs)
        room, dropped = residency.reserve_nvme(entries[0], total)
        store.remove_records(dropped)
        # A demotion batch is one arena's victims, a flush's spans tenants: each block's
        # bytes come from its own arena.
        arenas: dict[str, DramTier] = {}
        headers, batch, views = [], [], []
        for (entry, extent), header, need in zip(placed, wanted, needs, strict=True):
            if not room:
                fits, dropped = residency.reserve_nvme(entry, need)
                store.remove_records(dropped)
                if not fits:
                    continue
            headers.append(header)
            batch.append((entry, need))
            ns_id = entry.block_id[0]
            arena = arenas.get(ns_id)
            if arena is None:
                arena = arenas[ns_id] = store.arena_of(entry.block_id)
            views.append(arena.view(extent))
        if not batch:
            return []
        try:
            result = await nvme.write_batch(
                headers,
                [[payload_of(view, entry)] for view, (entry, _) in zip(views, batch, strict=True)],
                then,
            )
        finally:
            for view in views:
                view.release()
            if room:
                residency.unreserve_nvme(entries[0], total)
            else:
                for entry, need in batch:
                    residency.unreserve_nvme(entry, need)
        self.batches_written += 1
        done = [entry for entry, _ in batch]
        sizes = list(result.record_bytes)
        if any(result.damaged):
            for i, damaged in enumerate(result.damaged):
                if damaged:  # never a record of damaged bytes; an eviction drops the block
                    store.counters.checksum_failures += 1
                    sizes[i] = 0
                    logger.warning("a block's DRAM copy failed its checksum; not written to NVMe")
        residency.written_many(done, sizes, result.locations)
        written = [entry for entry, size in zip(done, sizes, strict=True) if size]
        total = sum(sizes)
        if total:
            store.telemetry.transfer("dram", "nvme", total, result.service_s)
        return written

    # ---- write-through and flush: written, kept in DRAM --------------------------------------
    def write_through(self, entry: Entry) -> None:
        """policy.admission = write_through: a new block goes to NVMe right away, in the
        next write-through batch."""
        self._through.append(entry)
        self._start_through()

    async def _write_through_batch(self, entries: list[Entry]) -> None:
        try:
            written = await self.write_unmoved(entries)
            self._store.counters.admitted += written
        finally:
            self._through_batches -= 1
        self._start_through()

    def _start_through(self) -> None:
        """Batches for the write-through blocks waiting, one per free I/O thread."""
        store = self._store
        while self._through and self._through_batches < store.io.threads:
            batch, self._through = self._through[:BATCH_RECORDS], self._through[BATCH_RECORDS:]
            self._through_batches += 1
            store.tasks.spawn(self._write_through_batch(batch))

    async def write_unmoved(self, entries: list[Entry]) -> int:
        """Write DRAM-only blocks to NVMe as one batch and keep them in DRAM (flush,
        write-through); how many were written."""
        store = self._store
        claimed = [e for e in entries if store.residency.start_move(e)]
        written: list[Entry] = []
        try:
            written = await self._write(claimed, "stays in DRAM only")
        finally:
            for entry in claimed:
                store.residency.end_move(entry)
                store.release_copies(entry, store.residency.release(entry))
        return len(written)

    async def flush(self) -> int:
        """Write every DRAM-only block to NVMe (most recently stored first), in batches,
        one per I/O thread at a time, and wait for the demotions in flight; returns how
        many were written."""
        written = await self._flush_dram_only()
        # A demotion batch in flight holds its victims out of `dram_only_entries`: until it
        # ends they are on neither list, and one that fails puts them back in DRAM only.
        while any(self._batches.values()):
            await self._store.space.freed.wait()  # every batch signals as it ends
            written += await self._flush_dram_only()
        return written

    async def _flush_dram_only(self) -> int:
        store = self._store
        if store.nvme is None:
            return 0
        dram_only = list(reversed(store.residency.dram_only_entries()))
        batches = [
            dram_only[i : i + BATCH_RECORDS] for i in range(0, len(dram_only), BATCH_RECORDS)
        ]
        sem = asyncio.Semaphore(store.io.threads)
        written = 0

        async def one(batch: list[Entry]) -> None:
            nonlocal written
            async with sem:
                try:
                    count = await self.write_unmoved(batch)
                    written += count  # after the await: `+=` would read `written` before it
                except Exception:  # one batch must not cost the others their flush
                    logger.exception("could not flush blocks to NVMe")

        await store.tasks.run_to_end(*(one(b) for b in batches))
        return written
