"""Store: the daemon's flows — put, get, delete, flush, evict, promote — over its units.

    Residency   which blocks exist and where; what to keep where (the only code that
                changes an entry)                                         engine/residency.py
    CostModel   fetch and prefill estimates, plans and their settlement   engine/costs.py
    DramSpace   the tenants' arenas and reservation in them               engine/dram.py
    NvmeDriver  the NVMe tier on the I/O pool: health, retries, tombstones engine/nvme.py
    RemoteLink  the cluster's shared store                                engine/remote.py
    LeaseTable  zero-copy leases                                          engine/leases.py
    Demoter     DRAM -> NVMe in batches: demotion, write-through, flush   engine/demoter.py

Everything runs on the event loop, so residency needs no locks; bytes move on the I/O
pool. Puts land in DRAM. When DRAM needs room, the policy's victims are demoted to NVMe
(written there, then their DRAM extent freed; in batches, ahead of need, by the Demoter:
engine/demoter.py) while NVMe has room, making room on NVMe by
dropping the policy's NVMe victims; only a block NVMe cannot take is dropped. A block in
use (pinned by a read, or being demoted) is never evicted and its memory never reused
until the last user lets go.

Put lifecycle: `put_begin` (reserve an extent) -> `PutWriter.write` (chunks) ->
`put_commit` (verify length and checksum, make visible atomically) or `put_abort`.
Get lifecycle: `open_block` (pins, reads from NVMe if needed) -> `BlockReader.chunks` ->
`BlockReader.close` (unpins).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator

from kvtier import failpoints
from kvtier.config import Config
from kvtier.engine.afterwards import Afterwards
from kvtier.engine.blocks import BlockReader, PutWriter, intact, record_header, record_location
from kvtier.engine.calibrate import CALIBRATION_RECORDS, calibrate
from kvtier.engine.costs import CostModel
from kvtier.engine.demoter import Demoter
from kvtier.engine.directory import Directories
from kvtier.engine.dram import DramSpace
from kvtier.engine.events import EventLog
from kvtier.engine.leases import LeaseTable
from kvtier.engine.nvme import NvmeDriver, ReadStatus
from kvtier.engine.prefetch import Prefetcher
from kvtier.engine.recovery import NvmeRecovery
from kvtier.engine.remote import RemoteLink
from kvtier.engine.residency import Released, new_residency
from kvtier.engine.results import (
    CommitOutcome,
    Counters,
    LeasedSlot,
    PutResult,
    StoreStats,
    TierUsage,
)
from kvtier.engine.shared import SharedTier
from kvtier.engine.tasks import Tasks
from kvtier.engine.telemetry import Telemetry
from kvtier.engine.zerocopy import ZeroCopy
from kvtier.errors import (
    AlreadyExists,
    DataLoss,
    InvalidArgument,
    ResourceExhausted,
)
from kvtier.index.catalog import NO_SLOT, Entry
from kvtier.index.dense_native import implementation
from kvtier.index.estimators import PathEstimator, PrefillEstimator
from kvtier.index.packed_policies import PackedPolicies
from kvtier.index.planner import Family, Plan
from kvtier.index.policy import BlockInfo, ValueModel
from kvtier.keys import tenant_of
from kvtier.movers.io import IoPool
from kvtier.profiles import MODELS
from kvtier.sizes import human_size
from kvtier.tiers import record_batch
from kvtier.tiers.allocator import round_up
from kvtier.tiers.dram import DramTier
from kvtier.tiers.record import ALIGN_BYTES, RecordHeader
from kvtier.types import (
    BlockCosts,
    BlockId,
    Extent,
    LookupResult,
    Overlap,
    PrefillCost,
    TierCost,
    TierName,
)

__all__ = [
    "BlockReader",
    "CommitOutcome",
    "LeasedSlot",
    "PutResult",
    "PutWriter",
    "Store",
    "StoreStats",
    "TierUsage",
]

logger = logging.getLogger(__name__)


class Store:
    """Blocks across the DRAM and NVMe tiers. Create, `await start()`, use, `await close()`."""

    def __init__(self, config: Config) -> None:
        self.config = config.resolved()
        cfg = self.config
        self.events = EventLog(cfg.limits.event_history, cfg.limits.event_backlog)
        self.telemetry = Telemetry()
        self.counters = Counters()
        self.tasks = Tasks()
        self._started_s = time.monotonic()
        self._next_generation = 1  # with an NVMe tier: from its epoch, at start
        self.recovery: NvmeRecovery | None = None
        self.space = DramSpace(cfg)
        # Direct reads: each tenant's DRAM blocks, published for its clients to read.
        self.directories = Directories(
            self.space.hooked, cfg.dram.direct_reads, cfg.limits.max_key_bytes
        )
        self.io = IoPool(cfg.nvme.io_threads)
        self.nvme: NvmeDriver | None = (
            NvmeDriver(cfg.nvme, self.io, self.tasks.spawn, self.take_generation)
            if cfg.nvme.enabled
            else None
        )
        self.leases = LeaseTable(cfg.limits.max_leases_per_session, cfg.limits.lease_ttl_s)
        self.zero_copy = ZeroCopy(self, self.leases)
        # A put's cataloguing, deferred past its reply where the transport allows.
        self.afterwards = Afterwards()
        self._expiry_task: asyncio.Task[None] | None = None
        self._promotions: dict[Entry, asyncio.Future[bool]] = {}
        planner = cfg.planner
        seeds = {
            "dram": TierCost(planner.dram_bandwidth_bytes_per_s, planner.dram_latency_s),
            "nvme": TierCost(planner.nvme_bandwidth_bytes_per_s, planner.nvme_latency_s),
        }
        self.remote: RemoteLink | None = None
        if cfg.remote.backend != "none":
            seeds["remote"] = TierCost(
                planner.remote_bandwidth_bytes_per_s, planner.remote_latency_s
            )
            self.remote = RemoteLink(cfg.remote, seeds["remote"])
        self.shared = SharedTier(self)
        self.costs = CostModel(seeds, planner.default_model, self._streams, self.counters)
        profile = MODELS[planner.default_model]
        policy = cfg.policy
        self.residency = new_residency(
            policy.name,
            policy.admission,
            ValueModel(
                0,
                profile.kv_bytes_per_token,
                PrefillCost(profile.a_s_per_token, profile.c_s_per_token2),
                self.costs.value_costs,
            ),
            policy.ghost_blocks,
            {tenant: arena.capacity_bytes for tenant, arena in self.space.arenas.items()},
            # What the tier can hold: the segment layout keeps part of the configured
            # capacity back for reclaim's copies, and the store must start evicting before
            # the segments reach the disk limit, not after (else every write waits for a
            # reclaim that finds nothing dead, and fails).
            self.nvme.capacity_bytes if self.nvme is not None else cfg.nvme.capacity_bytes,
            self._nvme_quota,
            self.counters,
            self.events.record,
            policy.min_p_reuse,
            self.directories.dram_changed,
            self.events.record_many,
        )
        self._tier_reports: list[Callable[[], TierUsage]] = []  # tiers kept elsewhere (HBM)
        # Queue prefetch (the Prefetch RPC): its hints protect DRAM blocks and learn of uses.
        self.prefetch = Prefetcher(self)
        self.residency.protected = self.prefetch.protected
        self.residency.on_use = self.prefetch.used
        self.demoter = Demoter(self)

    # ---- views for the servicer, the GPU path and the metrics ---------------------------------
    @property
    def arenas(self) -> dict[str, DramTier]:
        return self.space.arenas

    @property
    def policies(self) -> PackedPolicies:
        return self.residency.policies

    def arena(self, tenant: str) -> DramTier:
        """The DRAM arena of `tenant` (PermissionDenied if it has none)."""
        return self.space.arena(tenant)

    def arena_of(self, block_id: BlockId) -> DramTier:
        return self.space.arena_of(block_id)

    def blocks(self) -> Iterator[Entry]:
        """Every stored block (read only: a snapshot of the list, safe across awaits)."""
        return self.residency.entries()

    def stat(self, block_id: BlockId) -> Entry | None:
        return self.residency.get(block_id)

    def block_info(self, entry: Entry) -> BlockInfo:
        """What the policy knows of a stored block (its size, its place in its chain)."""
        return self.residency.info(entry)

    def estimates(self) -> tuple[dict[str, TierCost], dict[str, PrefillCost]]:
        return self.costs.estimates()

    def path_cost(self, tier: str) -> TierCost:
        return self.costs.path_cost(tier)

    def prefill_estimator(self, ns_id: str) -> PrefillEstimator:
        return self.costs.prefill_estimator(ns_id)

    def add_path(self, tier: str, seed: TierCost) -> PathEstimator:
        """A fetch path the store does not move itself (the GPU path's HBM copies): priced
        for the planner and the policy like the store's own."""
        return self.costs.add_path(tier, seed)

    def add_tier_report(self, report: Callable[[], TierUsage]) -> None:
        """Usage of a tier the store does not hold itself, for stats and metrics."""
        self._tier_reports.append(report)

    def _streams(self, tier: str) -> int:
        # A fetched run's NVMe (remote) blocks are promoted io_threads (remote.io_threads)
        # at a time (see `acquire`); the engine then copies them one after another.
        return self.remote.io.threads if self.remote and tier == "remote" else self.io.threads

    def _nvme_quota(self, tenant: str) -> int:
        settings = self.config.tenants.get(tenant)
        return settings.nvme_capacity_bytes if settings is not None else 0

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self, recover_in_background: bool = False) -> None:
        """DRAM pinned, the remote tier and the NVMe tier opened, and the NVMe index
        recovered from disk — or, with `recover_in_background`, being recovered (see
        engine/recovery.py: until then its blocks are misses; `nvme_recovered()` waits for
        it). A tier an older kvtier wrote is always recovered first (no epoch yet)."""
        logger.info(
            "eviction policy %s; DRAM's order %s; a demotion batch's checks and headers %s",
            self.config.policy.name,
            implementation(self.residency.dram_order.values()),
            record_batch.implementation(),
        )
        self._expiry_task = asyncio.ensure_future(self.zero_copy.expire_forever())
        self.prefetch.start()
        await asyncio.to_thread(self.space.pin)
        if self.remote is not None:
            await self.remote.open()
        if self.nvme is None:
            return
        first_generation = await self.nvme.open()
        recovery = NvmeRecovery(self.nvme, self.residency, self.counters, first_generation)
        self.recovery = recovery
        if first_generation is not None and recover_in_background:
            self._next_generation = first_generation
            recovery.start()
            return
        await recovery.run_now()
        if first_generation is None:
            first_generation = await self.nvme.claim_epoch(recovery.max_generation)
        self._next_generation = first_generation

    @property
    def nvme_recovering(self) -> bool:
        """Whether the NVMe index is still incomplete (filling, or its recovery failed)."""
        return self.recovery is not None and not self.recovery.complete

    async def nvme_recovered(self) -> bool:
        """Wait until the NVMe index recovery has ended; True if it is complete."""
        if self.recovery is None:
            return True
        await self.recovery.wait()
        return self.recovery.complete

    async def calibrate(self) -> None:
        """Seed the path estimators from timed transfers on this machine (bounded)."""
        budget_s = self.config.planner.calibration_s
        if budget_s <= 0:
            return
        tier = self.nvme.tier if self.nvme is not None else None
        # This run's generations: a recovery still running leaves the records alone.
        generations = [self.take_generation() for _ in range(CALIBRATION_RECORDS)]
        observations = await self.io.run(calibrate, tier, budget_s, generations)
        seed_latency_s = self.config.planner.dram_latency_s
        for obs in observations:
            # An in-process copy has no request round trip; the engine's fetch does.
            extra_s = seed_latency_s if obs.path == "dram" else 0.0
            self.costs.observe(obs.path, obs.size_bytes, obs.seconds + extra_s)
        self.costs.refresh()
        logger.info(
            "calibrated fetch paths: %s",
            ", ".join(
                f"{name} {human_size(int(cost.bandwidth_bytes_per_s))}/s + "
                f"{cost.latency_s * 1e6:.0f} µs"
                for name, cost in self.costs.estimates()[0].items()
            ),
        )

    def reconfigure(self, config: Config) -> None:
        """Apply what a reload may change: limits, planner defaults, admission knobs."""
        self.config = self.config.model_copy(
            update={"limits": config.limits, "planner": config.planner, "policy": config.policy}
        )
        self.space.reconfigure(self.config)
        if config.limits.max_key_bytes != self.directories.max_key_bytes:
            catalog = self.residency.catalog
            dram_blocks = (catalog.block_id_of(slot) for slot in catalog.dram_slots())
            self.directories.limit_keys(config.limits.max_key_bytes, dram_blocks)
        self.leases.max_per_session = self.config.limits.max_leases_per_session
        self.leases.ttl_s = self.config.limits.lease_ttl_s
        self.costs.default_model = self.config.planner.default_model
        self.policies.admission.mode = config.policy.admission
        self.policies.admission.min_p_reuse = config.policy.min_p_reuse

    async def flush(self) -> int:
        """Write every DRAM-only block to NVMe (most recently stored first); returns how
        many."""
        return await self.demoter.flush()

    async def close(self) -> None:
        await self.prefetch.close()
        if self.recovery is not None:
            await self.recovery.stop()
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            await asyncio.gather(self._expiry_task, return_exceptions=True)
        if self.nvme is not None:
            await self.nvme.stop_watching()
        for lease_id in self.leases.ids():
            self.zero_copy.end_lease(lease_id)
        await self.tasks.drain()
        if self.remote is not None:
            await self.remote.close()
        if self.nvme is not None:
            await self.nvme.close()
        self.io.close()
        if self.nvme is not None:
            self.nvme.close_files()
        self.space.unpin()

    # ---- put ----------------------------------------------------------------------------
    async def put_begin(self, block_id: BlockId, size_bytes: int, overwrite: bool) -> PutWriter:
        tenant = tenant_of(block_id[0])
        largest = self.space.largest_block_bytes(tenant, self.config.limits.max_block_bytes)
        if size_bytes > largest:
            raise ResourceExhausted(
                f"block of {size_bytes} bytes is larger than the largest accepted, "
                f"{largest} bytes (limits.max_block_bytes, capped by the tenant's DRAM "
                "arena): split it or raise the limit"
            )
        arena = self.arena(tenant)
        # Room free now, the common case (the demoter keeps headroom ahead of the puts):
        # taken at once, without the reservation's awaits (a few µs a block, on the loop).
        extent = arena.allocate(size_bytes)
        if extent is None:
            extent = await self.reserve_dram(tenant, size_bytes, put=True)
        else:
            self.demoter.notice(tenant)
        return PutWriter(block_id, size_bytes, overwrite, extent, arena.view(extent))

    async def put_commit(
        self, writer: PutWriter, client_xxh3_64: int, defer: bool = False
    ) -> PutResult:
        """Verify and store the written block. `defer`: catalogue it after the reply is
        sent, where the transport has armed `afterwards` (kvtier/engine/afterwards.py);
        the outcome is decided before either way."""
        if writer.block_id in self.afterwards:
            self.afterwards.run()  # a put of this key deferred past its reply is older
        if writer.received_bytes != writer.size_bytes:
            raise InvalidArgument(
                f"put stream ended after {writer.received_bytes} of the {writer.size_bytes} "
                "bytes its header declared; nothing was stored"
            )
        digest = writer.digest()
        if client_xxh3_64 and client_xxh3_64 != digest:
            raise DataLoss(
                "the bytes that arrived do not match the checksum the client sent; nothing "
                "was stored: retry the put"
            )
        self.arena_of(writer.block_id).zero_tail(writer.extent, writer.size_bytes)
        if failpoints.ACTIVE:
            failpoints.fire("store.commit")
        if self.recovery is not None and self.recovery.pending(writer.block_id):
            await self.recovery.bury(writer.block_id)  # old records not indexed yet
        buried = 0  # the newest dropped-record generation this put has tombstoned
        while True:
            while (existing := self.residency.get(writer.block_id)) is not None:
                if existing.size_bytes == writer.size_bytes and existing.xxh3_64 == digest:
                    self.put_abort(writer)
                    self.residency.used(existing)
                    tier = existing.fastest_tier or TierName.DRAM
                    return PutResult(writer.size_bytes, digest, tier, already_present=True)
                if not writer.overwrite:
                    raise AlreadyExists(
                        "a different block is already stored under this key: pass overwrite to "
                        "replace it, or use a key that names these bytes"
                    )
                await self._tombstone(existing)
                if self.residency.is_live(existing):  # else look again: someone replaced it
                    self._discard(existing)
                    if self.remote is not None:
                        self.remote.delete(writer.block_id)  # ordered before the new put
            pending = self.nvme.removal_pending(writer.block_id) if self.nvme else 0
            if pending <= buried:
                break
            # Awaited: look at the key again after it (another put may have landed).
            assert self.nvme is not None
            await self.nvme.tombstone(writer.block_id, pending)
            buried = pending
        generation = self.take_generation()
        writer.done = True  # the extent is the block's now
        writer.release()
        block_id, size_bytes, extent = writer.block_id, writer.size_bytes, writer.extent
        if defer and self.afterwards.armed:
            # Readable by direct reads before the reply, as if catalogued: the client's
            # own get right after its put must not miss (the catalog's publish then
            # finds it published).
            self.directories.dram_changed(block_id, extent, size_bytes, digest, generation)
            self.afterwards.later(
                block_id,
                lambda: self._add_put(block_id, size_bytes, digest, generation, extent, True),
            )
        else:
            self._add_put(block_id, size_bytes, digest, generation, extent)
        return PutResult(size_bytes, digest, TierName.DRAM, already_present=False)

    def _add_put(
        self,
        block_id: BlockId,
        size_bytes: int,
        xxh3_64: int,
        generation: int,
        extent: Extent,
        published: bool = False,
    ) -> None:
        """Catalogue a committed put's block (its extent already written and checked);
        `published`: the directory has it already (nothing ran on the loop since)."""
        residency = self.residency
        slot = residency.add_new(block_id, size_bytes, xxh3_64, generation, extent, published)
        if slot == NO_SLOT:
            # Catalogued already: only if deferred work was left past a request that
            # catalogued the key by another way than a put or a delete (both run it
            # first), which a transport that arms `afterwards` rules out: the copy there
            # stays (freeing this extent withdraws its early publication from the
            # directory).
            self.space.free(block_id, extent)
            return
        if self.policies.admission.on_insert and self.nvme is not None:
            self.demoter.write_through(residency.catalog.handle(slot))
        if self.remote is not None and self.config.remote.admission == "write_through":
            self.tasks.spawn(self.shared.put(residency.catalog.handle(slot)))
        self.counters.puts += 1
        self.space.signal()  # a new block is a victim a waiting put may take

    def put_abort(self, writer: PutWriter) -> None:
        if writer.done:
            return
        writer.done = True
        writer.release()
        self.space.free(writer.block_id, writer.extent)

    # ---- get, lookup, delete ------------------------------------------------------------
    async def open_block(self, block_id: BlockId) -> BlockReader | None:
        entry = self.residency.get(block_id)
        tier = TierName.DRAM
        if entry is None and self.remote is not None:
            entry = await self.shared.fetch(block_id)
            tier = TierName.REMOTE
        if entry is None or not self.residency.is_live(entry):
            self.residency.missed(block_id)
            return None
        self.residency.used(entry)
        self.residency.pin(entry)
        if entry.dram_extent is not None:
            view = self.arena_of(block_id).view(entry.dram_extent)[: entry.size_bytes]
            if not intact(view, entry):  # damaged in DRAM: dropped, a miss, never sent
                self.unpin(entry)
                self._damaged(entry)
                return None
            self.costs.served(block_id, tier, entry.size_bytes, None)
            return BlockReader(entry, tier, view, self.unpin)
        assert self.nvme is not None and entry.nvme_record_bytes
        header = record_header(entry)
        started_s = time.perf_counter()
        try:
            read = await self.nvme.read(header, record_location(entry))
        except BaseException:  # cancelled: the reader is gone, so is its pin
            self.unpin(entry)
            raise
        if not read.ok:
            self._record_failed(entry, header, read.status)
            self.unpin(entry)
            self.counters.misses += 1
            return None
        assert read.buffer is not None
        self.costs.observe("nvme", header.record_bytes, read.service_s)
        self.telemetry.transfer("nvme", "client", header.record_bytes, read.service_s)
        read_s = time.perf_counter() - started_s  # what the client waited, queue included
        self.costs.served(block_id, TierName.NVME, header.record_bytes, read_s)
        view = memoryview(read.buffer)[read.offset : read.offset + entry.size_bytes]
        return BlockReader(entry, TierName.NVME, view, self.unpin, backing=read.buffer)

    async def lookup(self, ns_id: str, keys: list[bytes]) -> LookupResult:
        result = self.residency.lookup(ns_id, keys)
        if self.remote is None or result.prefix_blocks == len(keys):
            return result
        return LookupResult.of(await self.shared.probe(ns_id, keys, result.tiers))

    def record_hit(self, block_id: BlockId, tier: TierName) -> None:
        """A block served from a copy kept outside the catalog (the GPU path's HBM cache):
        a use for the policy and a hit, as if served from its own tiers."""
        entry = self.residency.get(block_id)
        if entry is None:
            return
        self.residency.used(entry)
        self.costs.served(block_id, tier, entry.size_bytes, 0.0)  # device to device: ~free

    async def delete(self, block_id: BlockId) -> bool:
        """Whether the block was stored; a block whose records are not indexed yet (the
        index is still filling) is a miss here too, but deleted all the same."""
        if block_id in self.afterwards:
            self.afterwards.run()  # a put of this key deferred past its reply is older
        if self.recovery is not None and self.recovery.pending(block_id):
            await self.recovery.bury(block_id)
        entry = self.residency.get(block_id)
        if self.remote is not None:
            # Awaited: once acknowledged, no node fetches the deleted value.
            await self.remote.delete(block_id)
        if entry is None:
            return False
        await self._tombstone(entry)
        if self.residency.is_live(entry):  # else a concurrent delete or overwrite took it
            self._discard(entry)
        return True

    async def _tombstone(self, entry: Entry) -> None:
        """Before a delete or overwrite is acknowledged: make sure the block's NVMe record
        (written, or being written) cannot come back after a crash."""
        if self.nvme is None or not (entry.nvme_record_bytes or entry.demoting):
            return
        await self.nvme.tombstone(entry.block_id, entry.generation)

    def stats(self) -> StoreStats:
        c = self.counters
        catalog = self.residency.catalog
        tiers = [
            TierUsage(
                "dram",
                self.space.used_bytes,
                self.space.capacity_bytes,
                catalog.count(TierName.DRAM),
                c.hits["dram"],
                c.evictions["dram"],
            ),
        ]
        if self.nvme is not None:
            tiers.append(
                TierUsage(
                    "nvme",
                    catalog.nvme_used_bytes,
                    self.nvme.capacity_bytes,
                    catalog.count(TierName.NVME),
                    c.hits["nvme"],
                    c.evictions["nvme"],
                    self.nvme.health.online,
                    self.nvme.health.errors_total,
                    self.nvme_recovering,
                    self.recovery.indexed if self.recovery is not None else 0,
                )
            )
        tiers += [report() for report in self._tier_reports]
        if self.remote is not None:
            # The store keeps its own capacity: what this node put there, and its hits.
            tiers.append(
                TierUsage(
                    "remote",
                    0,
                    0,
                    0,
                    c.hits["remote"],
                    0,
                    self.remote.health.online,
                    self.remote.failures,
                )
            )
        return StoreStats(
            tiers=tiers,
            hits=sum(c.hits.values()),
            misses=c.misses,
            puts=c.puts,
            demotions=c.demotions,
            checksum_failures=c.checksum_failures,
            dropped_blocks=c.dropped_blocks,
            uptime_s=time.monotonic() - self._started_s,
            nvme_direct_io=bool(self.nvme and self.nvme.tier.direct_io),
            leases=len(self.leases),
            promotions=c.promotions,
            recompute_avoided_s=c.recompute_avoided_s,
            fetch_regret_s=c.fetch_regret_s,
            planned_fetch_blocks=c.planned_fetch_blocks,
            planned_recompute_blocks=c.planned_recompute_blocks,
            lost_reuse=c.lost_reuse,
            admitted=c.admitted,
            not_admitted=c.not_admitted,
            eviction_reasons=dict(c.eviction_reasons),
            remote_puts=c.remote_puts,
            remote_fetches=c.remote_fetches,
        )

    # ---- deciding: fetch or recompute ------------------------------------------------------
    async def plan(
        self,
        ns_id: str,
        keys: list[bytes],
        tokens_per_block: int,
        prompt_tokens: int,
        engine_cached_blocks: int,
        overlap: Overlap,
        kv_bytes_per_token: int,
        family: Family = "any",
    ) -> tuple[Plan, BlockCosts]:
        """The plan for a chain, with its per-block tiers, fetch and recompute seconds."""
        slots, tiers = self.residency.lookup_chain(ns_id, keys)
        first_size_bytes = None
        if not kv_bytes_per_token:
            first = next((s for s in slots if s != NO_SLOT), NO_SLOT)
            first_size_bytes = None if first == NO_SLOT else self.residency.catalog.size_of(first)
        if self.remote is not None and None in tiers:
            tiers = await self.shared.probe(ns_id, keys, tiers)
        return self.costs.plan(
            ns_id,
            keys,
            tiers,
            tokens_per_block,
            prompt_tokens,
            engine_cached_blocks,
            overlap,
            kv_bytes_per_token,
            first_size_bytes,
            family,
        )

    async def fetch_remote(self, block_id: BlockId) -> Entry | None:
        """A block this node lacks, from the remote tier into DRAM; None for a miss."""
        return await self.shared.fetch(block_id)

    # ---- the zero-copy path: leases (kvtier/engine/zerocopy.py) --------------------------------
    async def reserve(
        self,
        session_id: int,
        items: list[tuple[BlockId, int]],
        overwrite: bool,
        staged: bool = False,
    ) -> tuple[int, list[LeasedSlot]]:
        return await self.zero_copy.reserve(session_id, items, overwrite, staged)

    async def commit(
        self, session_id: int, lease_id: int, checksums: list[int], abort: bool
    ) -> list[CommitOutcome]:
        return await self.zero_copy.commit(session_id, lease_id, checksums, abort)

    async def acquire(
        self, session_id: int, block_ids: list[BlockId]
    ) -> tuple[int, list[LeasedSlot | None]]:
        return await self.zero_copy.acquire(session_id, block_ids)

    def release(
        self, session_id: int, lease_ids: list[int], fetch_s: float = 0.0, fetch_bytes: int = 0
    ) -> int:
        return self.zero_copy.release(session_id, lease_ids, fetch_s, fetch_bytes)

    def release_session(self, session_id: int) -> int:
        return self.zero_copy.release_session(session_id)

    async def promote(self, entry: Entry) -> bool:
        """Copy a pinned NVMe-only block into DRAM (verified); False if it cannot be. One
        promotion per block at a time (`_once`)."""
        return await self.tasks.once(self._promotions, entry, lambda: self._promote_pinned(entry))

    async def _promote_pinned(self, entry: Entry) -> bool:
        # Its own pin: a cancelled caller unpins, and the block must not be freed under it.
        self.residency.pin(entry)
        try:
            return await self._promote_once(entry)
        finally:
            self.unpin(entry)

    async def _promote_once(self, entry: Entry) -> bool:
        assert self.nvme is not None
        if not entry.nvme_record_bytes or entry.dram_extent is not None:
            return entry.dram_extent is not None  # a shared promotion finished it already
        if not self.nvme.online:
            return False
        header = record_header(entry)
        extent = await self.reserve_dram(tenant_of(entry.block_id[0]), entry.size_bytes)
        view = self.arena_of(entry.block_id).view(extent)
        try:
            read = await self.nvme.read_into(
                header, view[: round_up(entry.size_bytes, ALIGN_BYTES)], record_location(entry)
            )
        finally:
            view.release()
        if not read.ok:
            self.space.free(entry.block_id, extent)
            self._record_failed(entry, header, read.status)
            return False
        self.costs.observe("nvme", header.record_bytes, read.service_s)
        self.telemetry.transfer("nvme", "dram", header.record_bytes, read.service_s)
        self.residency.promoted(entry, extent)
        return True

    # ---- making room --------------------------------------------------------------------
    async def reserve_dram(self, tenant: str, size_bytes: int, put: bool = False) -> Extent:
        """An extent of `tenant`'s arena; the demoter (engine/demoter.py) makes the room,
        ahead of need where it can."""
        extent = await self.space.reserve(
            tenant, size_bytes, self.demoter.make_room, self._dram_busy, put
        )
        self.demoter.notice(tenant)
        return extent

    def _dram_busy(self, tenant: str) -> bool:
        # Reservations in progress and pinned blocks free space when they finish.
        arena = self.arena(tenant)
        return self.space.reserving(tenant) > 1 or self.residency.dram_busy(
            tenant, arena.used_bytes
        )

    # ---- releasing ----------------------------------------------------------------------
    def _discard(self, entry: Entry) -> None:
        """Remove from lookups now; free its memory and record once nothing uses it."""
        self.release_copies(entry, self.residency.remove(entry))

    def unpin(self, entry: Entry) -> None:
        self.release_copies(entry, self.residency.unpin(entry))
        if not entry.pins:
            self.space.signal()

    def release_copies(self, entry: Entry, released: Released | None) -> None:
        """Free what a removed block held once nothing uses it."""
        if released is None:
            return
        if released.extent is not None:
            self.space.free(entry.block_id, released.extent)
        if released.had_record and self.nvme is not None:
            self.nvme.schedule_removal(record_header(entry), record_location(entry))

    def remove_records(self, dropped: list[Entry]) -> None:
        """Remove from disk the records the residency dropped (evicted for room)."""
        if dropped:  # only ever non-empty with an NVMe tier
            assert self.nvme is not None
            self.nvme.schedule_removals(
                [(record_header(entry), record_location(entry)) for entry in dropped]
            )

    def _damaged(self, entry: Entry) -> None:
        self.counters.checksum_failures += 1
        self.counters.misses += 1
        self._discard(entry)
        logger.warning("dropped a block whose DRAM copy failed its checksum")

    def _record_failed(self, entry: Entry, header: RecordHeader, status: ReadStatus) -> None:
        """A read of the block's record failed: a miss; the record is dropped (and removed
        from disk) unless the tier is offline or the error may be transient."""
        if status is ReadStatus.OFFLINE:
            return
        if status is ReadStatus.CORRUPT:
            self.counters.checksum_failures += 1
        if self.residency.record_failed(entry, transient=status is ReadStatus.IO_ERROR):
            assert self.nvme is not None
            self.nvme.schedule_removal(header, record_location(entry))

    def take_generation(self) -> int:
        gen = self._next_generation
        if self.nvme is not None and gen >= self.nvme.tier.epoch.ceiling:
            # Once per 2**40 generations: one small synced write, here on the loop.
            gen = self.nvme.tier.epoch.claim_above(0)
        self._next_generation = gen + 1
        return gen
