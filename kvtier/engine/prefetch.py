"""Queue prefetch: promote what an engine's waiting requests will load, before they load it.

An engine announces the chains of requests in its queue (the Prefetch RPC; vLLM asks its
connector about waiting requests before it schedules them). What to do is decided by the
tenant's `HintTable` (kvtier/index/hints.py); this module moves:

    announce     -> the chains join the tenant's table (bounded by limits.prefetch_*); the
                    call returns at once, counting what is in DRAM, on NVMe, nowhere
    the worker   -> promotes hinted NVMe-only blocks into DRAM (through `Store.promote`,
                    the leased get's path: verified, one promotion per block at a time) and
                    fetches hinted blocks the node lacks from the remote tier, nearest
                    deadline first, at most the I/O threads at once, and only while the
                    tenant's protected DRAM stays under limits.prefetch_dram_fraction
    protection   -> a hinted block in DRAM is a DRAM victim only when no unprotected block
                    can go (residency.dram_victims); a put never fails for it
    use          -> a load of a block (Get, Acquire, CudaGet: `Residency.used`) ends one
                    hint's claim on it; a hint past its TTL ends all of its claims

Counters: blocks prefetched (promoted or fetched for a hint), used (loaded while still
hinted after being prefetched), expired (prefetched, never loaded before the hints on it
ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from kvtier.engine.core import StoreCore
from kvtier.engine.nvme import NvmeDriver
from kvtier.index.hints import HintTable
from kvtier.keys import tenant_of
from kvtier.movers.io import IoPool
from kvtier.tiers.dram import DramTier
from kvtier.types import BlockId


class PrefetchStore(StoreCore, Protocol):
    """What the prefetcher needs of the store (a Protocol, so this module does not import
    the store that imports it)."""

    io: IoPool
    nvme: NvmeDriver | None

    @property
    def arenas(self) -> dict[str, DramTier]: ...


logger = logging.getLogger(__name__)
IDLE_WAKE_S = 1.0  # the worker looks for expired hints at least this often


@dataclass(frozen=True, slots=True)
class Announced:
    """What one Prefetch call did: blocks accepted, and where those were."""

    accepted_blocks: int
    in_dram: int
    to_promote: int
    not_stored: int


@dataclass(slots=True)
class PrefetchCounters:
    prefetched: int = 0
    used: int = 0
    expired: int = 0
    announced_blocks: int = 0


class Prefetcher:
    """Create with its store, `start()` on the store's loop, `await close()`."""

    def __init__(self, store: PrefetchStore) -> None:
        self._store = store
        self.counters = PrefetchCounters()
        self._tables: dict[str, HintTable[BlockId]] = {}
        self._prefetched: set[BlockId] = set()  # promoted for a hint, not loaded yet
        self._tried: set[BlockId] = set()  # promotion started (or failed) for its hints
        self._moving = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # ---- the residency's hooks (on the loop, on every eviction and use: cheap) -------------
    def protected(self, block_id: BlockId) -> bool:
        table = self._tables.get(tenant_of(block_id[0])) if self._tables else None
        return table is not None and table.protected(block_id, time.monotonic())

    def used(self, block_id: BlockId) -> None:
        table = self._tables.get(tenant_of(block_id[0])) if self._tables else None
        if table is None:
            return
        if block_id in self._prefetched:
            self._prefetched.discard(block_id)
            self.counters.used += 1
        if table.use(block_id):
            self._tried.discard(block_id)

    # ---- announcing ------------------------------------------------------------------------
    def announce(self, ns_id: str, chains: list[list[bytes]], ttl_s: float) -> Announced:
        """Add the chains of waiting requests (nearest deadline first) to the tenant's
        hints; never waits for a move."""
        tenant = tenant_of(ns_id)
        limits = self._store.config.limits
        table = self._tables.get(tenant)
        if table is None:
            table = HintTable(limits.prefetch_hints_per_tenant, limits.prefetch_blocks_per_tenant)
            self._tables[tenant] = table
        # Read per call: a reload may change them (the next add enforces the new bounds).
        table.max_hints = limits.prefetch_hints_per_tenant
        table.max_keys = limits.prefetch_blocks_per_tenant
        now_s = time.monotonic()
        accepted = in_dram = to_promote = not_stored = 0
        residency = self._store.residency
        for keys in chains:
            added = table.add([(ns_id, k) for k in keys], now_s, ttl_s)
            self._released(added.released)
            for key in list(dict.fromkeys(keys))[: added.accepted]:
                entry = residency.get((ns_id, key))
                if entry is None or not residency.is_live(entry):
                    not_stored += 1
                elif entry.dram_extent is not None:
                    in_dram += 1
                else:
                    to_promote += 1
            accepted += added.accepted
        self.counters.announced_blocks += accepted
        self._wake.set()
        return Announced(accepted, in_dram, to_promote, not_stored)

    def _released(self, block_ids: list[BlockId]) -> None:
        """No hint holds these any more: prefetched ones never loaded expired."""
        for block_id in block_ids:
            self._tried.discard(block_id)
            if block_id in self._prefetched:
                self._prefetched.discard(block_id)
                self.counters.expired += 1

    # ---- moving ----------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_WAKE_S)
            self._wake.clear()
            try:
                self._schedule()
            except Exception:  # one bad round must not end prefetch for the daemon's life
                logger.exception("queue prefetch round failed")

    def _schedule(self) -> None:
        now_s = time.monotonic()
        for tenant, table in list(self._tables.items()):
            self._released(table.expire(now_s))
            if not len(table):
                del self._tables[tenant]
        room = self._store.io.threads - self._moving
        for tenant, table in self._tables.items():
            if room <= 0:
                return
            budget_bytes = self._protected_room_bytes(tenant, table)
            for block_id in table.to_promote(now_s, self._wanted, room):
                entry = self._store.residency.get(block_id)
                size_bytes = entry.size_bytes if entry is not None else 0
                if size_bytes > budget_bytes:
                    break  # the rest of the arena is for puts and other reads
                budget_bytes -= size_bytes
                self._tried.add(block_id)
                self._moving += 1
                room -= 1
                self._store.tasks.spawn(self._move(block_id))

    def _protected_room_bytes(self, tenant: str, table: HintTable[BlockId]) -> int:
        """DRAM the tenant's hints may still fill (limits.prefetch_dram_fraction)."""
        arena = self._store.arenas.get(tenant)
        if arena is None:
            return 0
        residency = self._store.residency
        held = 0
        for block_id in table.hinted():
            entry = residency.get(block_id)
            if entry is not None and entry.dram_extent is not None:
                held += entry.dram_extent.size_bytes
        limit = int(arena.capacity_bytes * self._store.config.limits.prefetch_dram_fraction)
        return max(limit - held, 0)

    def _wanted(self, block_id: BlockId) -> bool:
        """Worth a move now: on NVMe only (and NVMe usable), or absent with a remote tier."""
        if block_id in self._tried:
            return False
        store = self._store
        entry = store.residency.get(block_id)
        if entry is None:
            return store.remote is not None
        if entry.dram_extent is not None or not entry.nvme_record_bytes:
            return False
        return store.nvme is not None and store.nvme.online

    async def _move(self, block_id: BlockId) -> None:
        store = self._store
        try:
            entry = store.residency.get(block_id)
            if entry is None:
                done = await store.fetch_remote(block_id) is not None
            else:
                done = await store.promote(entry)
            if done and self.protected(block_id):
                self._prefetched.add(block_id)
                self.counters.prefetched += 1
        except Exception:  # a failed read is a miss later, never an error for the engine
            logger.warning("queue prefetch of a block failed", exc_info=True)
        finally:
            self._moving -= 1
            self._wake.set()
