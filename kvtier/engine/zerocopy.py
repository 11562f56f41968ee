"""The zero-copy path's flows: reserve -> (client writes its write area) -> commit (the
daemon copies each slot into the arena and hashes its copy), and acquire -> (client reads
the read-only arena in place) -> release, each under a lease (kvtier/engine/leases.py).
A one-exchange put (`put_staged`) is reserve and commit in one call, from the bytes the
client already wrote to its staging range (`stage`): nothing outlives the call, so it
needs no lease.

A lease pins what it covers: reserved slots are never reused, acquired blocks never
evicted or moved, until it ends — on release, on its session's end (a killed client frees
everything at once), or at `limits.lease_ttl_s`. Acquire promotes NVMe-only blocks (and
fetches remote ones) into the arena first, together, so the I/O threads overlap them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from typing import TYPE_CHECKING

from kvtier.engine.core import StoreCore
from kvtier.engine.leases import Lease, LeaseTable
from kvtier.engine.results import CommitOutcome, LeasedSlot
from kvtier.engine.write_area import WriteArea
from kvtier.errors import DeadlineExceeded, InvalidArgument, KVTierError, NotFound
from kvtier.index.catalog import Entry
from kvtier.types import BlockId, TierName

if TYPE_CHECKING:
    from kvtier.engine.blocks import PutWriter

logger = logging.getLogger(__name__)

# A streamed put (`put_staged` with a ticket): the daemon copies each piece as soon as
# the client's progress word says it is written, polling busily for up to STREAM_SPIN_S
# per piece (the client is copying at memory speed on another core), then once a
# millisecond, yielding the loop, until STREAM_WAIT_S has passed without that piece.
STREAM_PIECE_BYTES = 256 << 10
# A batch of puts gives the loop back at least this often (issue 22: no stall over 20 ms).
BATCH_TURN_S = 0.002
STREAM_SPIN_S = 0.002
STREAM_WAIT_S = 2.0
STREAM_ABANDONED = (1 << 64) - 1
# Of a Hits report (up to 64 direct reads), how many teach the DRAM path estimate: as
# many as its fits need before they answer (`min_observations`), so one report warms them.
FIT_HITS_PER_REPORT = 8


class LoopTurn:
    """A batch's share of the event loop: `due()` says when BATCH_TURN_S has run since
    the batch last gave the loop back (the caller then awaits `asyncio.sleep(0)`); the
    next share starts then. One per batch, across its blocks and its pieces' waits."""

    __slots__ = ("_ends_s",)

    def __init__(self) -> None:
        self._ends_s = time.perf_counter() + BATCH_TURN_S

    def due(self) -> bool:
        now_s = time.perf_counter()
        if now_s < self._ends_s:
            return False
        self._ends_s = now_s + BATCH_TURN_S
        return True


class ZeroCopy:
    def __init__(self, store: StoreCore, leases: LeaseTable) -> None:
        self._store = store
        self._leases = leases
        self._areas: dict[int, WriteArea] = {}  # session -> the memory its client writes

    def write_area(self, session_id: int) -> WriteArea:
        """The session's write area (made on first use: at its handshake)."""
        area = self._areas.get(session_id)
        if area is None:
            area = self._areas[session_id] = WriteArea()
        return area

    async def reserve(
        self,
        session_id: int,
        items: list[tuple[BlockId, int]],
        overwrite: bool,
        staged: bool = False,
    ) -> tuple[int, list[LeasedSlot]]:
        """Reserve arena extents for blocks, one lease for all. `staged` (a client's put):
        the slots handed back are in the session's write area, copied into the extents at
        commit; else (the daemon's own GPU path) they are the extents themselves."""
        self._leases.check_room(session_id)
        writers: list[PutWriter] = []
        offsets: list[int] = []
        area = self.write_area(session_id) if staged else None
        try:
            for block_id, size_bytes in items:
                writers.append(await self._store.put_begin(block_id, size_bytes, overwrite))
                if area is not None:
                    offsets.append(area.reserve(size_bytes))
        except BaseException:
            for writer in writers:
                self._store.put_abort(writer)
            if area is not None:
                for offset in offsets:
                    area.free(offset)
            raise
        lease = self._leases.new(session_id)
        lease.writers = writers
        lease.staged = offsets
        places = offsets if staged else [w.extent.offset for w in writers]
        return lease.lease_id, [
            LeasedSlot(at, w.size_bytes) for at, w in zip(places, writers, strict=True)
        ]

    async def commit(
        self, session_id: int, lease_id: int, checksums: list[int], abort: bool
    ) -> list[CommitOutcome]:
        """Make reserved slots visible (each verified on its own), or give them back."""
        lease = self._leases.get(lease_id, session_id)
        if lease is None or not lease.writers:
            raise NotFound(f"no reservation with lease {lease_id}: it expired or was committed")
        if not abort and checksums and len(checksums) != len(lease.writers):
            raise InvalidArgument(
                f"commit carries {len(checksums)} checksums for {len(lease.writers)} slots"
            )
        self._leases.take(lease_id)
        area = self._areas.get(session_id) if lease.staged else None
        abort = abort or (bool(lease.staged) and area is None)  # its session is gone
        outcomes: list[CommitOutcome] = []
        for i, writer in enumerate(lease.writers):
            if abort:
                self._store.put_abort(writer)
                continue
            try:
                if area is not None:
                    with area.view(lease.staged[i], writer.size_bytes) as source:
                        writer.copy_in(source)
                else:
                    writer.written_in_place()
                checksum = checksums[i] if checksums else 0
                result = await self._store.put_commit(writer, checksum, defer=True)
                outcomes.append(CommitOutcome(stored=not result.already_present))
            except KVTierError as err:
                outcomes.append(CommitOutcome(stored=False, error=err))
            finally:
                self._store.put_abort(writer)
        self._free_staged(session_id, lease)
        return outcomes

    def stage(self, session_id: int, size_bytes: int, largest_bytes: int) -> tuple[int, int]:
        """The session's staging range, at least `size_bytes` (at most `largest_bytes`,
        the tenant's arena: no put could use more): (offset, size) in its write area."""
        if size_bytes <= 0 or size_bytes > largest_bytes:
            raise InvalidArgument(
                f"a staging range of {size_bytes} bytes: it must be between 1 byte and the "
                f"tenant's arena ({largest_bytes} bytes)"
            )
        return self.write_area(session_id).stage(size_bytes)

    async def put_staged(
        self,
        session_id: int,
        items: list[tuple[BlockId, int, int, int]],
        overwrite: bool,
        ticket: int = 0,
    ) -> list[CommitOutcome]:
        """Store blocks the client wrote to its staging range: (block, size, offset,
        checksum) each, one outcome each. Each is copied into a fresh extent and hashed
        from that copy (`PutWriter.copy_in`) as a commit does, so what becomes visible is
        what the checksum covers whatever the client writes meanwhile."""
        if ticket:
            return await self._put_streamed(session_id, items, overwrite, ticket)
        outcomes: list[CommitOutcome] = []
        turn = LoopTurn()
        for block_id, size_bytes, offset, checksum in items:
            if turn.due():
                # The awaits below rarely suspend: without this a put_many of 256 small
                # blocks is one loop turn of 30-45 ms (stalltrace.py found it). Safe
                # here: each block takes its staging source again after any wait.
                await asyncio.sleep(0)
            writer: PutWriter | None = None
            try:
                self._check_staged(session_id, offset, size_bytes)  # before reserving
                writer = await self._store.put_begin(block_id, size_bytes, overwrite)
                # Taken again after the wait: the session may have ended meanwhile.
                with self._staged_source(session_id, offset, size_bytes) as source:
                    writer.copy_in(source)
                # Catalogued after the reply where the transport allows it (until this
                # first waits: kvtier/engine/afterwards.py).
                result = await self._store.put_commit(writer, checksum, defer=True)
                outcomes.append(CommitOutcome(stored=not result.already_present))
            except KVTierError as err:
                outcomes.append(CommitOutcome(stored=False, error=err))
            finally:
                if writer is not None:
                    self._store.put_abort(writer)
        return outcomes

    async def _put_streamed(
        self,
        session_id: int,
        items: list[tuple[BlockId, int, int, int]],
        overwrite: bool,
        ticket: int,
    ) -> list[CommitOutcome]:
        """`put_staged` while the client is still writing (kvtier.proto, StagedPutRequest
        .ticket): each block's extent is reserved while the client copies, each piece
        copied and hashed as soon as it is written. Whatever the progress words say, only
        bytes inside the staging range are read, and what is stored is what was hashed."""
        area = self._areas.get(session_id)
        staging = area.staging if area is not None else None
        words = 2 + len(items)
        if area is None or staging is None or 8 * words > staging[1]:
            raise InvalidArgument("a streamed put needs a staging range with room for its header")
        header = staging[0]
        outcomes: list[CommitOutcome] = []
        before = 0  # the bytes of the items before this one
        # As in `put_staged`: a streamed put_many of 256 small blocks whose bytes are all
        # written ahead of the daemon never waits, and was one loop turn of 25-35 ms
        # (stalltrace.py, the 1 M fill). Safe: every piece takes its source again, and
        # the progress words are read through the area, which says if the session ended.
        turn = LoopTurn()
        for i, (block_id, size_bytes, offset, _) in enumerate(items):
            if turn.due():
                await asyncio.sleep(0)
            writer: PutWriter | None = None
            try:
                if offset < header + 8 * words:
                    raise InvalidArgument("a streamed put's blocks start after its header")
                self._check_staged(session_id, offset, size_bytes)
                writer = await self._store.put_begin(block_id, size_bytes, overwrite)
                done = 0
                while done < size_bytes:
                    want = before + min(done + STREAM_PIECE_BYTES, size_bytes)
                    written = await self._written(area, header, ticket, want, turn)
                    upto = min(written - before, size_bytes, done + STREAM_PIECE_BYTES)
                    with self._staged_source(session_id, offset + done, upto - done) as piece:
                        writer.copy_in_piece(piece)
                    done = upto
                (checksum,) = area.words(header + 16 + 8 * i, 1)
                result = await self._store.put_commit(writer, checksum, defer=True)
                outcomes.append(CommitOutcome(stored=not result.already_present))
            except KVTierError as err:
                outcomes.append(CommitOutcome(stored=False, error=err))
            finally:
                if writer is not None:
                    self._store.put_abort(writer)
            before += size_bytes
        return outcomes

    @staticmethod
    async def _written(area: WriteArea, header: int, ticket: int, want: int, turn: LoopTurn) -> int:
        """The client's byte count once it reaches `want` for this ticket. The time limit
        runs per piece, from when this waits for it (a wait for DRAM before it is not the
        client's delay); the busy spin gives the loop back when the batch's turn is up."""
        deadline_s = time.monotonic() + STREAM_WAIT_S
        spin_until_s = time.monotonic() + STREAM_SPIN_S
        while True:
            seen, written = area.words(header, 2)
            if seen == ticket:
                if written == STREAM_ABANDONED:
                    raise InvalidArgument("the client abandoned this streamed put")
                if written >= want:
                    return int(written)
            now_s = time.monotonic()
            if now_s > deadline_s:
                raise DeadlineExceeded(
                    f"a streamed put's bytes did not arrive within {STREAM_WAIT_S} s"
                )
            if now_s > spin_until_s:
                await asyncio.sleep(0.001)
            elif turn.due():
                await asyncio.sleep(0)
            else:
                os.sched_yield()  # the client may be waiting for this CPU

    def _staged_source(self, session_id: int, offset: int, size_bytes: int) -> memoryview:
        self._check_staged(session_id, offset, size_bytes)
        return self._areas[session_id].view(offset, size_bytes)

    def _check_staged(self, session_id: int, offset: int, size_bytes: int) -> None:
        area = self._areas.get(session_id)
        if area is None or not area.staged(offset, size_bytes):
            raise InvalidArgument(
                f"{size_bytes} bytes at offset {offset} are not inside this session's staging "
                "range: Stage a range first, and name only bytes inside it"
            )

    def _free_staged(self, session_id: int, lease: Lease) -> None:
        area = self._areas.get(session_id)
        if area is not None:
            for offset in lease.staged:
                area.free(offset)
        lease.staged = []

    async def acquire(
        self, session_id: int, block_ids: list[BlockId]
    ) -> tuple[int, list[LeasedSlot | None]]:
        """Pin blocks in DRAM (promoting NVMe-only ones) under one lease; None for a miss."""
        self._leases.check_room(session_id)
        store = self._store
        residency = store.residency
        found: list[tuple[Entry, TierName] | None] = []
        started_s = time.perf_counter()
        try:
            absent: list[int] = []  # not here: perhaps in the remote tier
            for block_id in block_ids:
                entry = residency.get(block_id)
                if entry is None:
                    absent.append(len(found))
                    found.append(None)
                    continue
                residency.used(entry)
                residency.pin(entry)
                tier = entry.fastest_tier
                assert tier is not None
                found.append((entry, tier))
            # NVMe-only blocks are read together: the I/O threads overlap their latencies
            # (one after another, a run of 23 blocks at 250 ms each took 5.8 s, not 1.5);
            # so are remote ones.
            promote = [e for e, _ in filter(None, found) if e.dram_extent is None]
            from_remote = [block_ids[i] for i in absent] if store.remote is not None else []
            # A promotion that failed leaves its block without a DRAM extent: read below.
            fetched: list[Entry | None] = []
            if promote or from_remote:  # else no await: a loop turn is ~10 % of a small get
                _, fetched = await asyncio.gather(
                    asyncio.gather(*(store.promote(e) for e in promote)),
                    asyncio.gather(*(store.fetch_remote(b) for b in from_remote)),
                )
            by_index = dict(zip(absent, fetched, strict=False))
            for i in absent:
                entry = by_index.get(i)
                if entry is None or not residency.is_live(entry):
                    residency.missed(block_ids[i])
                    continue
                residency.used(entry)
                residency.pin(entry)
                found[i] = (entry, TierName.REMOTE)
            promote_s = time.perf_counter() - started_s if promote or from_remote else 0.0
            if promote and not from_remote:  # what this run of NVMe reads cost the caller
                store.costs.promoted([e.size_bytes for e in promote], promote_s)
        except BaseException:
            for item in found:
                if item is not None:
                    self._store.unpin(item[0])
            raise
        pinned: list[Entry] = []
        slots: list[LeasedSlot | None] = []
        for block_id, item in zip(block_ids, found, strict=True):
            if item is None:
                slots.append(None)
                continue
            entry, tier = item
            if entry.dram_extent is None:
                self._store.unpin(entry)
                store.counters.misses += 1
                slots.append(None)
                continue
            pinned.append(entry)
            store.costs.served(block_id, tier, entry.size_bytes, None)
            slots.append(
                LeasedSlot(entry.dram_extent.offset, entry.size_bytes, entry.xxh3_64, tier)
            )
        if not pinned:
            return 0, slots
        lease = self._leases.new(session_id)
        lease.pinned = pinned
        lease.promote_s = promote_s
        return lease.lease_id, slots

    def release(
        self,
        session_id: int,
        lease_ids: list[int],
        fetch_s: float = 0.0,
        fetch_bytes: int = 0,
    ) -> int:
        """End leases; a client's measured fetch of a single lease refines the DRAM path."""
        if len(lease_ids) == 1 and fetch_bytes > 0 and math.isfinite(fetch_s) and fetch_s > 0:
            lease = self._leases.get(lease_ids[0], session_id)
            if lease is not None and lease.pinned:
                sizes = [e.size_bytes for e in lease.pinned]
                copy_s = self._store.costs.engine_fetch(
                    sizes, lease.promote_s, fetch_s, fetch_bytes
                )
                if copy_s is not None:
                    self._store.telemetry.transfer("dram", "engine", fetch_bytes, copy_s)
        released = 0
        for lease_id in lease_ids:
            if self._leases.get(lease_id, session_id) is not None:
                self.end_lease(lease_id)
                released += 1
        return released

    def direct_hits(
        self,
        hits: list[tuple[BlockId, int, float]],
        calls: list[tuple[int, int, float]] | None = None,
    ) -> int:
        """Gets a client served from its tenant's directory: (block, bytes copied, seconds
        the copy took) each. Counted as an Acquire's hits are (the policy's order, the hit
        counters); a block no longer stored, or stored at another size (overwritten
        since), is ignored. Returns how many were applied. The DRAM path estimate learns
        from the latest few only (FIT_HITS_PER_REPORT): one observation costs ~45 µs of
        the loop here (a solve), more than the get it describes. `calls`: the gets those
        hits came from as their callers waited for them (blocks, bytes, seconds; clients
        that send them): they price runs read from the directory (`CostModel.direct_call`),
        and then the hits teach only the per-block DRAM path, not the leased-run fit."""
        store = self._store
        residency = store.residency
        applied = 0
        for block_id, size_bytes, _ in hits:
            entry = residency.get(block_id)
            if entry is None or entry.size_bytes != size_bytes:
                continue
            residency.used(entry)
            store.costs.served(block_id, TierName.DRAM, size_bytes, None)
            applied += 1
        # A call names no more blocks or bytes than the report's hits (else it is not
        # what these hits were: ignored rather than skew everyone's plans).
        hit_bytes = sum(size for _, size, _ in hits)
        for blocks, size_bytes, seconds in (calls or [])[-FIT_HITS_PER_REPORT:]:
            if 0 < blocks <= len(hits) and 0 < size_bytes <= hit_bytes:
                store.costs.direct_call(blocks, size_bytes, seconds)
        for _, size_bytes, fetch_s in hits[-FIT_HITS_PER_REPORT:]:
            if not (math.isfinite(fetch_s) and fetch_s > 0):
                continue
            copy_s = store.costs.engine_fetch(
                [size_bytes], 0.0, fetch_s, size_bytes, runs=not calls
            )
            if copy_s is not None:
                store.telemetry.transfer("dram", "engine", size_bytes, copy_s)
        return applied

    def release_session(self, session_id: int) -> int:
        """The client went away: end every lease it held, and close its write area."""
        released = self.release(session_id, self._leases.of_session(session_id))
        area = self._areas.pop(session_id, None)
        if area is not None:
            area.close()
        return released

    def end_lease(self, lease_id: int) -> None:
        lease: Lease | None = self._leases.take(lease_id)
        if lease is None:
            return
        for writer in lease.writers:
            self._store.put_abort(writer)
        self._free_staged(lease.session_id, lease)
        for entry in lease.pinned:
            self._store.unpin(entry)

    async def expire_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self._leases.ttl_s / 4))
            expired = self._leases.expired(time.monotonic())
            for lease_id in expired:
                self.end_lease(lease_id)
            if expired:
                logger.warning("reclaimed %d expired leases", len(expired))
