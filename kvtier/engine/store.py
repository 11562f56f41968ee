"""Store: the catalog (deciding) driving the DRAM and NVMe tiers (moving) on one event loop.

All catalog state is touched only from the event loop, so it needs no locks; disk I/O runs
on the I/O pool. Puts land in DRAM. When DRAM needs room, least recently used blocks are
demoted to NVMe (written there, then their DRAM extent freed) while NVMe has room, making
room on NVMe by removing its least recently used records; only a block NVMe cannot take is
dropped. A block in use (pinned by a read, or being demoted) is never evicted and its
memory is never reused until the last user lets go.

Put lifecycle: `put_begin` (reserve an extent) -> `PutWriter.write` (chunks) ->
`put_commit` (verify length and checksum, make visible atomically) or `put_abort`.
Get lifecycle: `open_block` (pins, reads from NVMe if needed) -> `BlockReader.chunks` ->
`BlockReader.close` (unpins).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import mmap
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import xxhash

from kvtier import failpoints
from kvtier.buffers import aligned_buffer
from kvtier.config import Config
from kvtier.engine.calibrate import CALIBRATION_NS_ID, calibrate
from kvtier.engine.events import EventLog
from kvtier.engine.health import TierHealth
from kvtier.engine.remote import RemoteLink
from kvtier.engine.telemetry import Telemetry
from kvtier.errors import (
    AlreadyExists,
    ConfigError,
    CorruptRecord,
    DataLoss,
    InvalidArgument,
    KVTierError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvtier.index.catalog import BlockId, Catalog, Entry, LookupResult, TierName
from kvtier.index.estimators import PathEstimator, PrefillEstimator
from kvtier.index.planner import BlockCosts, Overlap, Plan, PlanRequest, PrefillCost, TierCost
from kvtier.index.planner import plan as make_plan
from kvtier.index.policy import BlockInfo, Policies, TierPolicy, ValueModel
from kvtier.keys import tenant_of
from kvtier.movers.io import IoPool
from kvtier.profiles import MODELS
from kvtier.sizes import human_size
from kvtier.tiers.allocator import Extent, round_up
from kvtier.tiers.dram import DramTier
from kvtier.tiers.nvme import ALIGN_BYTES, NvmeTier, RecordHeader, header_size_for

logger = logging.getLogger(__name__)
T = TypeVar("T")
K = TypeVar("K")
PLANNED_BLOCKS_KEPT = 1 << 16


@dataclass(frozen=True, slots=True)
class PutResult:
    size_bytes: int
    xxh3_64: int
    tier: TierName
    already_present: bool


@dataclass(frozen=True, slots=True)
class TierUsage:
    name: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    hits: int
    evictions: int
    online: bool = True
    io_errors: int = 0


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: list[TierUsage]
    hits: int
    misses: int
    puts: int
    demotions: int
    checksum_failures: int
    dropped_blocks: int
    uptime_s: float
    nvme_direct_io: bool
    leases: int
    promotions: int
    recompute_avoided_s: float
    fetch_regret_s: float
    planned_fetch_blocks: int
    planned_recompute_blocks: int
    lost_reuse: int = 0
    admitted: int = 0
    not_admitted: int = 0
    eviction_reasons: dict[tuple[str, str], int] = field(default_factory=dict)
    remote_puts: int = 0
    remote_fetches: int = 0


@dataclass(slots=True)
class _Counters:
    hits: dict[str, int] = field(
        default_factory=lambda: {"hbm": 0, "dram": 0, "nvme": 0, "remote": 0}
    )
    evictions: dict[str, int] = field(default_factory=lambda: {"dram": 0, "nvme": 0})
    # (tier, reason): demoted (the copy lives on in NVMe), dropped (gone from every tier),
    # capacity (an NVMe record removed for room), corrupt (failed verification)
    eviction_reasons: Counter[tuple[str, str]] = field(default_factory=Counter)
    misses: int = 0
    puts: int = 0
    demotions: int = 0
    promotions: int = 0
    checksum_failures: int = 0
    dropped_blocks: int = 0
    recompute_avoided_s: float = 0.0
    fetch_regret_s: float = 0.0
    planned_fetch_blocks: int = 0
    planned_recompute_blocks: int = 0
    lost_reuse: int = 0
    admitted: int = 0
    not_admitted: int = 0
    remote_puts: int = 0
    remote_fetches: int = 0


def _payload(extent_view: memoryview, entry: Entry) -> list[memoryview]:
    """The part of a block's DRAM extent its NVMe record holds: the payload rounded up
    to 4 KiB (an empty block still has a 4 KiB extent, but no payload on disk)."""
    return [extent_view[: round_up(entry.size_bytes, ALIGN_BYTES)]]


# ENOSPC, EDQUOT, EFBIG: the record does not fit; the device itself is fine.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
READ_ERRORS_BEFORE_DROP = 3


@dataclass(frozen=True, slots=True)
class LeasedSlot:
    """Where a block (or a reserved slot) lives in the arena mapping."""

    offset: int
    size_bytes: int
    xxh3_64: int = 0
    tier: TierName | None = None


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    stored: bool
    error: KVTierError | None = None


@dataclass(slots=True, eq=False)
class _Lease:
    lease_id: int
    session_id: int
    expires_s: float
    pinned: list[Entry] = field(default_factory=list)
    writers: list[PutWriter] = field(default_factory=list)
    promote_s: float = 0.0  # spent reading NVMe-only blocks into the arena for this lease


class PutWriter:
    """Bytes of one block arriving into its reserved DRAM extent."""

    def __init__(
        self, block_id: BlockId, size_bytes: int, overwrite: bool, extent: Extent, view: memoryview
    ) -> None:
        self.block_id = block_id
        self.size_bytes = size_bytes
        self.overwrite = overwrite
        self.extent = extent
        self._view = view
        self._hasher = xxhash.xxh3_64()
        self.received_bytes = 0
        self.done = False

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        end = self.received_bytes + len(chunk)
        if end > self.size_bytes:
            raise InvalidArgument(
                f"put stream carries more than the {self.size_bytes} bytes its header declared"
            )
        self._view[self.received_bytes : end] = chunk
        self._hasher.update(chunk)
        self.received_bytes = end

    def digest(self) -> int:
        return int(self._hasher.intdigest())

    def written_in_place(self) -> None:
        """The client wrote the whole slot through its own mapping (zero-copy put)."""
        self._hasher = xxhash.xxh3_64(self._view[: self.size_bytes])
        self.received_bytes = self.size_bytes

    def release(self) -> None:
        self._view.release()


class BlockReader:
    """A pinned block's bytes, valid until `close()`."""

    def __init__(
        self,
        store: Store,
        entry: Entry,
        tier: TierName,
        data: memoryview,
        backing: mmap.mmap | None = None,
    ) -> None:
        self._store = store
        self._entry = entry
        self.tier = tier
        self.size_bytes = entry.size_bytes
        self.xxh3_64 = entry.xxh3_64
        self._data = data
        self._backing = backing
        self._closed = False

    def chunks(self, chunk_bytes: int) -> Iterator[memoryview]:
        """Views of the block's bytes; valid until `close()` (the block stays pinned)."""
        for start in range(0, self.size_bytes, chunk_bytes):
            yield self._data[start : start + chunk_bytes]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Chunk views may outlive this call inside gRPC's buffers, so the NVMe read buffer
        # is left to the garbage collector rather than closed here.
        del self._data, self._backing
        self._store._unpin(self._entry)


class Store:
    """Blocks across the DRAM and NVMe tiers. Create, `await start()`, use, `await close()`."""

    def __init__(self, config: Config) -> None:
        self.config = config.resolved()
        self.events = EventLog(self.config.limits.event_history, self.config.limits.event_backlog)
        self.catalog = Catalog(self.events.record)
        # One arena per tenant: a client maps its tenant's arena and nothing else. An arena
        # pinned for the GPU is faulted in by several threads before it is registered.
        gpu = self.config.gpu
        pinning = gpu.device >= 0 and gpu.pin_arena and not gpu.emulate
        self.arenas: dict[str, DramTier] = {
            tenant: DramTier(size, self.config.dram.prefault and not pinning)
            for tenant, size in self.config.tenant_arenas().items()
        }
        nvme_cfg = self.config.nvme
        self.nvme: NvmeTier | None = NvmeTier.from_config(nvme_cfg) if nvme_cfg.enabled else None
        self.io = IoPool(nvme_cfg.io_threads)
        self.nvme_health = TierHealth("nvme", nvme_cfg.offline_after_errors)
        # NVMe work that failed and must not be forgotten: records to remove (else they
        # leak disk) and tombstones to write (else a restart could bring a deleted block
        # back); retried by the health watcher.
        self._unremoved: list[RecordHeader] = []
        self._unwritten_tombstones: list[tuple[BlockId, int]] = []
        # Blocks whose NVMe record was dropped from the catalog (evicted, unreadable, ...)
        # but may still be on disk: the newest such generation per block. A new value of
        # the block must not be acknowledged until that record cannot come back at a
        # restart (else a SIGKILL revives the old bytes: found by the soak).
        self._removing: dict[BlockId, int] = {}
        self._health_task: asyncio.Task[None] | None = None
        self._reserving: dict[str, int] = dict.fromkeys(self.arenas, 0)
        self._counters = _Counters()
        self.telemetry = Telemetry()
        self._next_generation = 1
        self._nvme_reserved_bytes = 0
        self._nvme_reserved_by_tenant: Counter[str] = Counter()
        self._space_freed = asyncio.Event()
        self._background: set[asyncio.Task[Any]] = set()
        self._started_s = time.monotonic()
        self._leases: dict[int, _Lease] = {}
        self._leases_by_session: Counter[int] = Counter()
        self._next_lease_id = 1
        self._promotions: dict[Entry, asyncio.Future[bool]] = {}
        planner_cfg = self.config.planner
        # Measured costs the planner reads: "dram" is arena -> engine (fitted from the
        # fetch times zero-copy clients report on release), "nvme" is the verified read of
        # a record into the arena (timed here); an NVMe block reaches the engine by both.
        self.paths: dict[str, PathEstimator] = {
            "dram": PathEstimator(
                TierCost(planner_cfg.dram_bandwidth_bytes_per_s, planner_cfg.dram_latency_s)
            ),
            "nvme": PathEstimator(
                TierCost(planner_cfg.nvme_bandwidth_bytes_per_s, planner_cfg.nvme_latency_s)
            ),
        }
        # The remote tier (kvtier/tiers/remote.py): "remote" is the verified fetch of a
        # value from the shared store into the arena, timed on its I/O thread.
        self.remote: RemoteLink | None = None
        self._remote_fetches: dict[BlockId, asyncio.Future[Entry | None]] = {}
        if self.config.remote.backend != "none":
            self.paths["remote"] = PathEstimator(
                TierCost(planner_cfg.remote_bandwidth_bytes_per_s, planner_cfg.remote_latency_s)
            )
            self.remote = RemoteLink(self.config.remote, self.paths["remote"].seed)
        self._prefill: dict[str, PrefillEstimator] = {}
        # What to keep where (kvtier/index/policy.py): one eviction order per tenant arena
        # and one for the shared NVMe tier, valued with the planner's current costs.
        profile = MODELS[planner_cfg.default_model]
        self._value_costs: dict[str, TierCost] = {}
        self._refresh_value_costs()
        policy_cfg = self.config.policy
        self.policies = Policies(
            policy_cfg.name,
            policy_cfg.admission,
            ValueModel(
                0,
                profile.kv_bytes_per_token,
                PrefillCost(profile.a_s_per_token, profile.c_s_per_token2),
                self._value_costs,
            ),
            policy_cfg.ghost_blocks,
            policy_cfg.min_p_reuse,
        )
        self._dram_order: dict[str, TierPolicy] = {
            tenant: self.policies.new_tier("dram", "nvme", arena.capacity_bytes)
            for tenant, arena in self.arenas.items()
        }
        self._nvme_order = self.policies.new_tier("nvme", None, nvme_cfg.capacity_bytes)
        # Where each block sits in its chain, learned from the chains engines look up.
        self._infos: dict[BlockId, BlockInfo] = {}
        # Blocks a plan told an engine to fetch -> the prefill seconds that fetch replaces;
        # settled when the block is served (bounded: plans nobody follows age out).
        self._planned: OrderedDict[BlockId, float] = OrderedDict()
        self._expiry_task: asyncio.Task[None] | None = None
        self._pinned: list[int] = []  # arena addresses registered with CUDA
        self._tier_reports: list[Callable[[], TierUsage]] = []  # tiers kept elsewhere (HBM)

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._expiry_task = asyncio.ensure_future(self._expire_leases_forever())
        gpu = self.config.gpu
        if gpu.device >= 0 and gpu.pin_arena and not gpu.emulate:
            await asyncio.to_thread(self._pin_arenas)
        if self.remote is not None:
            await self.remote.open()
        if self.nvme is None:
            return
        report = await self.io.run(self.nvme.open)
        # A generation a tombstone named must never be handed out again: a new block with
        # it would be dropped at the next start as if deleted.
        self._next_generation = max(self._next_generation, report.max_tombstone_generation + 1)
        self._health_task = asyncio.ensure_future(self._watch_nvme_forever())
        records = sorted(report.records, key=lambda r: r.header.generation)
        leftovers = [r for r in records if r.header.ns_id == CALIBRATION_NS_ID]
        for rec in leftovers:  # a crash during the last start's calibration
            await self.io.run(self.nvme.remove, rec.header)
        records = [r for r in records if r.header.ns_id != CALIBRATION_NS_ID]
        for rec in records:
            h = rec.header
            entry = Entry(
                (h.ns_id, h.key),
                h.payload_bytes,
                h.xxh3_64,
                h.generation,
                nvme_record_bytes=h.record_bytes,
            )
            self.catalog.add(entry)
            self._nvme_order.insert(entry.block_id, self._info(entry))
            self._next_generation = max(self._next_generation, h.generation + 1)
        self._counters.checksum_failures += report.dropped_corrupt
        self._make_nvme_room(0)
        logger.info(
            "NVMe tier at %s: recovered %d blocks (%s), dropped %d unreadable, %d stale and "
            "%d deleted records, removed %d temporary files; direct I/O %s",
            self.nvme.root,
            len(records),
            human_size(self.catalog.nvme_used_bytes),
            report.dropped_corrupt,
            report.dropped_stale,
            report.dropped_deleted,
            report.removed_temporary,
            "on" if self.nvme.direct_io else "off",
        )

    def _pin_arenas(self) -> None:
        """Page-lock every DRAM arena for the GPU (kvtier/movers/pinned.py); refuses to start
        when it cannot, rather than serve the GPU at bounce-buffer speed unnoticed."""
        from kvtier.movers import pinned

        for tenant, arena in self.arenas.items():
            try:
                report = pinned.pin(
                    arena.address, arena.capacity_bytes, self.config.gpu.touch_threads
                )
            except RuntimeError as err:
                raise ConfigError(f"gpu.device = {self.config.gpu.device}: {err}") from None
            self._pinned.append(arena.address)
            logger.info(
                "pinned the %s DRAM arena of tenant %s for GPU %d in %.2f s (first touch "
                "%.2f s on %d threads, cudaHostRegister %.2f s)",
                human_size(arena.capacity_bytes),
                tenant,
                self.config.gpu.device,
                report.touch_s + report.register_s,
                report.touch_s,
                self.config.gpu.touch_threads,
                report.register_s,
            )

    async def calibrate(self) -> None:
        """Seed the path estimators from timed transfers on this machine (bounded)."""
        budget_s = self.config.planner.calibration_s
        if budget_s <= 0:
            return
        observations = await self.io.run(calibrate, self.nvme, budget_s)
        seed_latency_s = self.config.planner.dram_latency_s
        for obs in observations:
            # An in-process copy has no request round trip; the engine's fetch does.
            extra_s = seed_latency_s if obs.path == "dram" else 0.0
            self.paths[obs.path].observe(obs.size_bytes, obs.seconds + extra_s)
        self._refresh_value_costs()
        logger.info(
            "calibrated fetch paths: %s",
            ", ".join(
                f"{name} {human_size(int(cost.bandwidth_bytes_per_s))}/s + "
                f"{cost.latency_s * 1e6:.0f} µs"
                for name, cost in ((n, e.estimate()) for n, e in self.paths.items())
            ),
        )

    def reconfigure(self, config: Config) -> None:
        """Apply what a reload may change: limits, planner defaults, admission knobs."""
        self.config = self.config.model_copy(
            update={"limits": config.limits, "planner": config.planner, "policy": config.policy}
        )
        self.policies.admission.mode = config.policy.admission
        self.policies.admission.min_p_reuse = config.policy.min_p_reuse

    def estimates(self) -> tuple[dict[str, TierCost], dict[str, PrefillCost]]:
        """What the planner believes now: per path, and per "tenant|model" prefill."""
        return (
            {name: est.estimate() for name, est in self.paths.items()},
            {key: est.estimate() for key, est in self._prefill.items()},
        )

    def path_cost(self, tier: str) -> TierCost:
        """Estimated cost of bringing a block from `tier` into an engine's buffer."""
        to_engine = self.paths["dram"].estimate()
        if tier == TierName.DRAM.value:
            return to_engine
        if tier == TierName.HBM.value:
            return self.paths[tier].estimate()  # device to device, straight to the engine
        # A fetched run's NVMe (remote) blocks are promoted io_threads (remote.io_threads)
        # at a time (see `acquire`); the engine then copies them one after another.
        threads = self.remote.io.threads if self.remote and tier == "remote" else self.io.threads
        return self.paths[tier].estimate().in_parallel(threads).then(to_engine)

    async def flush(self) -> int:
        """Write every DRAM-only block to NVMe (most recent first); returns how many."""
        if self.nvme is None:
            return 0
        written = 0
        sem = asyncio.Semaphore(self.io.threads)

        async def one(entry: Entry) -> None:
            nonlocal written
            async with sem:
                if not self.catalog.is_live(entry) or entry.demoting or entry.nvme_record_bytes:
                    return
                entry.demoting = True
                try:
                    if await self._write_nvme(entry, evicting=False):
                        written += 1
                except Exception:  # one block must not cost the others their flush
                    logger.exception("could not flush a block to NVMe")
                finally:
                    entry.demoting = False
                    self._after_use(entry)

        await self._run_to_end(*(one(e) for e in self.catalog.dram_only()))
        return written

    async def close(self) -> None:
        for task in (self._expiry_task, self._health_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for lease_id in list(self._leases):
            self._end_lease(lease_id)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.remote is not None:
            await self.remote.close()
        if self.nvme is not None:
            # Records are complete files once renamed; this makes them survive a power
            # loss too, so a restart after a clean stop finds every one of them.
            try:
                await self.io.run(self.nvme.sync)
            except OSError as err:
                logger.warning("could not sync the NVMe tier to disk: %s", err.strerror or err)
        self.io.close()
        if self.nvme is not None:
            self.nvme.close()
        if self._pinned:
            from kvtier.movers import pinned

            for address in self._pinned:
                pinned.unregister(address)
            self._pinned.clear()

    def arena(self, tenant: str) -> DramTier:
        """The DRAM arena of `tenant` (every tenant that can authenticate has one)."""
        try:
            return self.arenas[tenant]
        except KeyError:
            raise PermissionDenied(f"tenant {tenant!r} has no DRAM arena") from None

    def arena_of(self, block_id: BlockId) -> DramTier:
        return self.arena(tenant_of(block_id[0]))

    # ---- put ----------------------------------------------------------------------------
    async def put_begin(self, block_id: BlockId, size_bytes: int, overwrite: bool) -> PutWriter:
        arena = self.arena_of(block_id)
        largest = min(self.config.limits.max_block_bytes, arena.capacity_bytes)
        if size_bytes > largest:
            raise ResourceExhausted(
                f"block of {size_bytes} bytes is larger than the largest accepted, "
                f"{largest} bytes (limits.max_block_bytes, capped by the tenant's DRAM "
                "arena): split it or raise the limit"
            )
        tenant = tenant_of(block_id[0])
        self._reserving[tenant] += 1
        try:
            extent = await self._reserve_dram(tenant, size_bytes)
        finally:
            self._reserving[tenant] -= 1
        return PutWriter(block_id, size_bytes, overwrite, extent, arena.view(extent))

    async def put_commit(self, writer: PutWriter, client_xxh3_64: int) -> PutResult:
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
        buried = 0  # the newest dropped-record generation this put has tombstoned
        while True:
            while (existing := self.catalog.get(writer.block_id)) is not None:
                if existing.size_bytes == writer.size_bytes and existing.xxh3_64 == digest:
                    self.put_abort(writer)
                    self.catalog.touch(existing)
                    self._used(existing)
                    tier = existing.fastest_tier or TierName.DRAM
                    return PutResult(writer.size_bytes, digest, tier, already_present=True)
                if not writer.overwrite:
                    raise AlreadyExists(
                        "a different block is already stored under this key: pass overwrite to "
                        "replace it, or use a key that names these bytes"
                    )
                await self._tombstone(existing)
                if self.catalog.is_live(existing):  # else look again: someone replaced it
                    self._discard(existing)
                    if self.remote is not None:
                        self.remote.delete(writer.block_id)  # ordered before the new put
            pending = self._removing.get(writer.block_id, 0)
            if pending <= buried:
                break
            # Awaited: look at the key again after it (another put may have landed).
            await self._tombstone_generation(writer.block_id, pending)
            buried = pending
        entry = Entry(
            writer.block_id,
            writer.size_bytes,
            digest,
            self._take_generation(),
            dram_extent=writer.extent,
        )
        writer.done = True
        writer.release()
        self.catalog.add(entry)
        self.policies.accessed(entry.block_id, self._info(entry))
        self._dram_order[tenant_of(entry.block_id[0])].insert(entry.block_id, self._info(entry))
        if self.policies.admission.on_insert and self.nvme is not None:
            self._spawn(self._write_through(entry))
        if self.remote is not None and self.config.remote.admission == "write_through":
            self._spawn(self._put_remote(entry))
        self._counters.puts += 1
        self._signal_space()  # a new block is a victim a waiting put may take
        return PutResult(writer.size_bytes, digest, TierName.DRAM, already_present=False)

    def put_abort(self, writer: PutWriter) -> None:
        if writer.done:
            return
        writer.done = True
        writer.release()
        self.arena_of(writer.block_id).free(writer.extent)
        self._signal_space()

    # ---- get, lookup, delete ------------------------------------------------------------
    async def open_block(self, block_id: BlockId) -> BlockReader | None:
        entry = self.catalog.get(block_id)
        tier = TierName.DRAM
        if entry is None and self.remote is not None:
            entry = await self._from_remote(block_id)
            tier = TierName.REMOTE
        if entry is None or not self.catalog.is_live(entry):
            self._missed(block_id)
            return None
        self.catalog.touch(entry)
        self._used(entry)
        self.catalog.pin(entry)
        if entry.dram_extent is not None:
            self._served(block_id, tier, entry.size_bytes, None)
            view = self.arena_of(block_id).view(entry.dram_extent)[: entry.size_bytes]
            return BlockReader(self, entry, tier, view)
        assert self.nvme is not None and entry.nvme_record_bytes
        if not self.nvme_health.online:
            self._unpin(entry)
            self._counters.misses += 1
            return None
        header = self._record_header(entry)
        started_s = time.perf_counter()
        try:
            (buf, offset), service_s = await self.io.run_timed(self.nvme.read, header)
        except (CorruptRecord, OSError) as err:
            self._on_bad_record(entry, header, err)
            self._unpin(entry)
            self._counters.misses += 1
            return None
        except BaseException:  # cancelled: the reader is gone, so is its pin
            self._unpin(entry)
            raise
        self.nvme_health.succeeded()
        self.paths["nvme"].observe(header.record_bytes, service_s)
        self.telemetry.transfer("nvme", "client", header.record_bytes, service_s)
        read_s = time.perf_counter() - started_s  # what the client waited, queue included
        self._served(block_id, TierName.NVME, header.record_bytes, read_s)
        view = memoryview(buf)[offset : offset + entry.size_bytes]
        return BlockReader(self, entry, TierName.NVME, view, backing=buf)

    async def lookup(self, ns_id: str, keys: list[bytes]) -> LookupResult:
        result = self.catalog.lookup(ns_id, keys)
        self._learn_chain(ns_id, keys, result.tiers)
        if self.remote is None or result.prefix_blocks == len(keys):
            return result
        return LookupResult.of(await self._remote_tiers(ns_id, keys, result.tiers))

    async def _remote_tiers(
        self, ns_id: str, keys: list[bytes], tiers: list[str | None]
    ) -> list[str | None]:
        """`tiers` with "remote" for the blocks missing here that the remote store holds:
        those after the local prefix, at most remote.max_probe_blocks, in one round trip."""
        assert self.remote is not None
        missing = [i for i, t in enumerate(tiers) if t is None]
        missing = missing[: self.config.remote.max_probe_blocks]
        found = await self.remote.probe([(ns_id, keys[i]) for i in missing])
        out = list(tiers)
        for i, held in zip(missing, found, strict=True):
            if held:
                out[i] = TierName.REMOTE.value
        return out

    def stat(self, block_id: BlockId) -> Entry | None:
        return self.catalog.get(block_id)

    def record_hit(self, block_id: BlockId, tier: TierName) -> None:
        """A block served from a copy kept outside the catalog (the GPU path's HBM cache):
        a use for the policy and a hit, as if served from its own tiers."""
        entry = self.catalog.get(block_id)
        if entry is None:
            return
        self.catalog.touch(entry)
        self._used(entry)
        self._served(block_id, tier, entry.size_bytes, 0.0)  # device to device: ~free

    def add_path(self, tier: str, seed: TierCost) -> PathEstimator:
        """A fetch path the store does not move itself (the GPU path's HBM copies): priced
        for the planner and the policy like the store's own."""
        estimator = self.paths[tier] = PathEstimator(seed)
        self._refresh_value_costs()
        return estimator

    def block_info(self, entry: Entry) -> BlockInfo:
        """What the policy knows of a stored block (its size, its place in its chain)."""
        return self._info(entry)

    def add_tier_report(self, report: Callable[[], TierUsage]) -> None:
        """Usage of a tier the store does not hold itself, for stats and metrics."""
        self._tier_reports.append(report)

    async def delete(self, block_id: BlockId) -> bool:
        entry = self.catalog.get(block_id)
        if self.remote is not None:
            # Awaited: once acknowledged, no node fetches the deleted value.
            await self.remote.delete(block_id)
        if entry is None:
            return False
        await self._tombstone(entry)
        if self.catalog.is_live(entry):  # else a concurrent delete or overwrite took it
            self._discard(entry)
        return True

    async def _tombstone(self, entry: Entry) -> None:
        """Before a delete or overwrite is acknowledged: make sure the block's NVMe record
        (written, or being written) cannot come back after a crash."""
        if self.nvme is None or not (entry.nvme_record_bytes or entry.demoting):
            return
        await self._tombstone_generation(entry.block_id, entry.generation)

    async def _tombstone_generation(self, block_id: BlockId, generation: int) -> None:
        assert self.nvme is not None
        ns_id, key = block_id
        if self.nvme_health.online:
            try:
                await self.io.run(self.nvme.tombstone, ns_id, key, generation)
                self.nvme_health.succeeded()
                return
            except OSError as err:
                self._nvme_failed(err, "write a tombstone")
        # Retried by the watcher; until then a crash may resurrect the deleted record.
        self._unwritten_tombstones.append((block_id, generation))

    def stats(self) -> StoreStats:
        c = self._counters
        tiers = [
            TierUsage(
                "dram",
                sum(a.used_bytes for a in self.arenas.values()),
                sum(a.capacity_bytes for a in self.arenas.values()),
                self.catalog.count(TierName.DRAM),
                c.hits["dram"],
                c.evictions["dram"],
            ),
        ]
        if self.nvme is not None:
            tiers.append(
                TierUsage(
                    "nvme",
                    self.catalog.nvme_used_bytes,
                    self.nvme.capacity_bytes,
                    self.catalog.count(TierName.NVME),
                    c.hits["nvme"],
                    c.evictions["nvme"],
                    self.nvme_health.online,
                    self.nvme_health.errors_total,
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
            nvme_direct_io=bool(self.nvme and self.nvme.direct_io),
            leases=len(self._leases),
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
    def prefill_estimator(self, ns_id: str) -> PrefillEstimator:
        """The prefill estimate of a namespace's model (its first path segment)."""
        model = ns_id.partition("|")[2].split("/", 1)[0]
        if model not in MODELS:
            model = self.config.planner.default_model
        key = f"{tenant_of(ns_id)}|{model}"
        if key not in self._prefill:
            profile = MODELS[model]
            self._prefill[key] = PrefillEstimator(
                PrefillCost(profile.a_s_per_token, profile.c_s_per_token2)
            )
        return self._prefill[key]

    async def plan(
        self,
        ns_id: str,
        keys: list[bytes],
        tokens_per_block: int,
        prompt_tokens: int,
        engine_cached_blocks: int,
        overlap: Overlap,
        kv_bytes_per_token: int,
    ) -> tuple[Plan, BlockCosts]:
        """The plan for a chain, with its per-block tiers, fetch and recompute seconds."""
        tiers = self.catalog.lookup(ns_id, keys).tiers
        self._learn_chain(ns_id, keys, tiers)
        if self.remote is not None and None in tiers:
            tiers = await self._remote_tiers(ns_id, keys, tiers)
        if not kv_bytes_per_token:
            first = next((e for k in keys if (e := self.catalog.get((ns_id, k))) is not None), None)
            model = ns_id.partition("|")[2].split("/", 1)[0]
            profile = MODELS.get(model, MODELS[self.config.planner.default_model])
            kv_bytes_per_token = (
                max(1, first.size_bytes // tokens_per_block)
                if first
                else profile.kv_bytes_per_token
            )
        request = PlanRequest(
            prompt_tokens=prompt_tokens or len(keys) * tokens_per_block,
            tokens_per_block=tokens_per_block,
            kv_bytes_per_token=kv_bytes_per_token,
            cached_tiers=tiers,
            tier_costs=self._refresh_value_costs(),
            prefill=self.prefill_estimator(ns_id).estimate(),
            engine_cached_blocks=engine_cached_blocks,
            overlap=overlap,
        )
        result = make_plan(request)
        costs = result.block_costs()
        recompute = costs[2]
        for i in range(result.fetch_start, min(result.fetch_end, len(keys))):
            self._planned[(ns_id, keys[i])] = recompute[i]
            self._planned.move_to_end((ns_id, keys[i]))
        while len(self._planned) > PLANNED_BLOCKS_KEPT:
            self._planned.popitem(last=False)
        self._counters.planned_fetch_blocks += result.fetch_blocks
        self._counters.planned_recompute_blocks += (
            len(recompute) - result.engine_blocks - result.fetch_blocks
        )
        return result, costs

    def _served(
        self, block_id: BlockId, tier: TierName, size_bytes: int, measured_s: float | None
    ) -> None:
        """Count a hit; if a plan asked for this fetch, settle what it saved or cost."""
        self._counters.hits[tier.value] += 1
        recompute_s = self._planned.pop(block_id, None)
        if recompute_s is None:
            return
        fetch_s = (
            measured_s if measured_s is not None else self.path_cost(tier.value).fetch_s(size_bytes)
        )
        self._counters.recompute_avoided_s += recompute_s
        if fetch_s > recompute_s:
            self._counters.fetch_regret_s += fetch_s - recompute_s

    # ---- leases: the zero-copy path -----------------------------------------------------
    async def reserve(
        self, session_id: int, items: list[tuple[BlockId, int]], overwrite: bool
    ) -> tuple[int, list[LeasedSlot]]:
        """Reserve arena slots for blocks a client will write in place; one lease for all."""
        self._check_lease_room(session_id)
        writers: list[PutWriter] = []
        try:
            for block_id, size_bytes in items:
                writers.append(await self.put_begin(block_id, size_bytes, overwrite))
        except BaseException:
            for writer in writers:
                self.put_abort(writer)
            raise
        lease = self._new_lease(session_id)
        lease.writers = writers
        return lease.lease_id, [LeasedSlot(w.extent.offset, w.size_bytes) for w in writers]

    async def commit(
        self, session_id: int, lease_id: int, checksums: list[int], abort: bool
    ) -> list[CommitOutcome]:
        """Make reserved slots visible (each verified on its own), or give them back."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.session_id != session_id or not lease.writers:
            raise NotFound(f"no reservation with lease {lease_id}: it expired or was committed")
        if not abort and checksums and len(checksums) != len(lease.writers):
            raise InvalidArgument(
                f"commit carries {len(checksums)} checksums for {len(lease.writers)} slots"
            )
        self._take_lease(lease_id)
        outcomes: list[CommitOutcome] = []
        for i, writer in enumerate(lease.writers):
            if abort:
                self.put_abort(writer)
                continue
            try:
                writer.written_in_place()
                result = await self.put_commit(writer, checksums[i] if checksums else 0)
                outcomes.append(CommitOutcome(stored=not result.already_present))
            except KVTierError as err:
                outcomes.append(CommitOutcome(stored=False, error=err))
            finally:
                self.put_abort(writer)
        return outcomes

    async def acquire(
        self, session_id: int, block_ids: list[BlockId]
    ) -> tuple[int, list[LeasedSlot | None]]:
        """Pin blocks in DRAM (promoting NVMe-only ones) under one lease; None for a miss."""
        self._check_lease_room(session_id)
        found: list[tuple[Entry, TierName] | None] = []
        started_s = time.perf_counter()
        try:
            absent: list[int] = []  # not here: perhaps in the remote tier
            for block_id in block_ids:
                entry = self.catalog.get(block_id)
                if entry is None:
                    absent.append(len(found))
                    found.append(None)
                    continue
                self.catalog.touch(entry)
                self._used(entry)
                self.catalog.pin(entry)
                tier = entry.fastest_tier
                assert tier is not None
                found.append((entry, tier))
            # NVMe-only blocks are read together: the I/O threads overlap their latencies
            # (one after another, a run of 23 blocks at 250 ms each took 5.8 s, not 1.5);
            # so are remote ones.
            promote = [e for e, _ in filter(None, found) if e.dram_extent is None]
            from_remote = [block_ids[i] for i in absent] if self.remote is not None else []
            # A promotion that failed leaves its block without a DRAM extent: read below.
            _, fetched = await asyncio.gather(
                asyncio.gather(*(self._promote(e) for e in promote)),
                asyncio.gather(*(self._from_remote(b) for b in from_remote)),
            )
            by_index = dict(zip(absent, fetched, strict=False))
            for i in absent:
                entry = by_index.get(i)
                if entry is None or not self.catalog.is_live(entry):
                    self._missed(block_ids[i])
                    continue
                self.catalog.touch(entry)
                self._used(entry)
                self.catalog.pin(entry)
                found[i] = (entry, TierName.REMOTE)
            promote_s = time.perf_counter() - started_s if promote or from_remote else 0.0
        except BaseException:
            for item in found:
                if item is not None:
                    self._unpin(item[0])
            raise
        pinned: list[Entry] = []
        slots: list[LeasedSlot | None] = []
        for block_id, item in zip(block_ids, found, strict=True):
            if item is None:
                slots.append(None)
                continue
            entry, tier = item
            if entry.dram_extent is None:
                self._unpin(entry)
                self._counters.misses += 1
                slots.append(None)
                continue
            pinned.append(entry)
            self._served(block_id, tier, entry.size_bytes, None)
            slots.append(
                LeasedSlot(entry.dram_extent.offset, entry.size_bytes, entry.xxh3_64, tier)
            )
        if not pinned:
            return 0, slots
        lease = self._new_lease(session_id)
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
            lease = self._leases.get(lease_ids[0])
            if lease is not None and lease.session_id == session_id and lease.pinned:
                self._observe_engine_fetch(lease, fetch_s, fetch_bytes)
        released = 0
        for lease_id in lease_ids:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.session_id == session_id:
                self._end_lease(lease_id)
                released += 1
        return released

    def _observe_engine_fetch(self, lease: _Lease, fetch_s: float, fetch_bytes: int) -> None:
        # Per block, as the planner costs them: the request's round trip is shared by the
        # lease's blocks. Time spent promoting from NVMe is that path's, measured already.
        if fetch_bytes > sum(e.size_bytes for e in lease.pinned):
            return  # not what this lease served: ignore rather than skew the fit
        copy_s = fetch_s - lease.promote_s
        if copy_s <= 0:
            return
        blocks = len(lease.pinned)
        self.paths["dram"].observe(fetch_bytes // blocks, copy_s / blocks)
        self.telemetry.transfer("dram", "engine", fetch_bytes, copy_s)

    def release_session(self, session_id: int) -> int:
        """The client went away: end every lease it held."""
        ids = [i for i, lease in self._leases.items() if lease.session_id == session_id]
        return self.release(session_id, ids)

    def _check_lease_room(self, session_id: int) -> None:
        """Refuse a new lease before pinning anything: one client cannot pin the arena."""
        held = self._leases_by_session[session_id]
        limit = self.config.limits.max_leases_per_session
        if held >= limit:
            raise ResourceExhausted(
                f"this session holds {held} leases, the most allowed "
                "(limits.max_leases_per_session): release some before asking for more"
            )

    def _new_lease(self, session_id: int) -> _Lease:
        ttl_s = self.config.limits.lease_ttl_s
        lease = _Lease(self._next_lease_id, session_id, time.monotonic() + ttl_s)
        self._next_lease_id += 1
        self._leases[lease.lease_id] = lease
        self._leases_by_session[session_id] += 1
        return lease

    def _take_lease(self, lease_id: int) -> _Lease | None:
        """Forget a lease (and its count against its session); its resources stay with it."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._leases_by_session[lease.session_id] -= 1
            if not self._leases_by_session[lease.session_id]:
                del self._leases_by_session[lease.session_id]
        return lease

    def _end_lease(self, lease_id: int) -> None:
        lease = self._take_lease(lease_id)
        if lease is None:
            return
        for writer in lease.writers:
            self.put_abort(writer)
        for entry in lease.pinned:
            self._unpin(entry)

    async def _expire_leases_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.limits.lease_ttl_s / 4))
            now = time.monotonic()
            expired = [i for i, lease in self._leases.items() if lease.expires_s <= now]
            for lease_id in expired:
                self._end_lease(lease_id)
            if expired:
                logger.warning("reclaimed %d expired leases", len(expired))

    async def _promote(self, entry: Entry) -> bool:
        """Copy a pinned NVMe-only block into DRAM (verified); False if it cannot be. One
        promotion per block at a time (`_once`)."""
        return await self._once(self._promotions, entry, lambda: self._promote_pinned(entry))

    async def _promote_pinned(self, entry: Entry) -> bool:
        # Its own pin: a cancelled caller unpins, and the block must not be freed under it.
        self.catalog.pin(entry)
        try:
            return await self._promote_once(entry)
        finally:
            self._unpin(entry)

    async def _promote_once(self, entry: Entry) -> bool:
        assert self.nvme is not None
        if not entry.nvme_record_bytes or entry.dram_extent is not None:
            return entry.dram_extent is not None  # a shared promotion finished it already
        header = self._record_header(entry)
        arena = self.arena_of(entry.block_id)
        if not self.nvme_health.online:
            return False
        extent = await self._reserve_dram(tenant_of(entry.block_id[0]), entry.size_bytes)
        view = arena.view(extent)
        try:
            _, read_s = await self.io.run_timed(
                self.nvme.read_into, header, _payload(view, entry)[0]
            )
            self.nvme_health.succeeded()
            self.paths["nvme"].observe(header.record_bytes, read_s)
            self.telemetry.transfer("nvme", "dram", header.record_bytes, read_s)
        except (CorruptRecord, OSError) as err:
            arena.free(extent)
            self._signal_space()
            self._on_bad_record(entry, header, err)
            return False
        finally:
            view.release()
        self.catalog.set_dram(entry, extent)
        if self.catalog.is_live(entry):
            self._dram_order[tenant_of(entry.block_id[0])].insert(entry.block_id, self._info(entry))
        self._counters.promotions += 1
        return True

    # ---- the remote tier ------------------------------------------------------------------
    async def _from_remote(self, block_id: BlockId) -> Entry | None:
        """Fetch a block this node does not hold from the remote tier into DRAM (verified)
        and catalogue it; None for a miss. One fetch per block at a time (`_once`)."""
        return await self._once(
            self._remote_fetches, block_id, lambda: self._fetch_remote(block_id)
        )

    async def _fetch_remote(self, block_id: BlockId) -> Entry | None:
        assert self.remote is not None
        tenant = tenant_of(block_id[0])
        arena = self.arena(tenant)
        largest = min(self.config.limits.max_block_bytes, arena.capacity_bytes)
        try:
            fetched = await self.remote.fetch(block_id, largest)
        except CorruptRecord as err:
            self._bad_remote_value(block_id, err)
            return None
        if fetched is None:
            return None
        extent = await self._reserve_dram(tenant, fetched.payload_bytes)
        view = arena.view(extent)
        try:
            fill_s = await self.remote.fill(fetched, view)
        except BaseException as err:
            arena.free(extent)
            self._signal_space()
            if not isinstance(err, CorruptRecord):
                raise
            self._bad_remote_value(block_id, err)
            return None
        finally:
            view.release()
        read_s = fetched.fetch_s + fill_s
        self.paths["remote"].observe(fetched.payload_bytes, read_s)
        self.telemetry.transfer("remote", "dram", len(fetched.value), read_s)
        existing = self.catalog.get(block_id)
        if existing is not None:  # put here while it was on its way: keep that one
            arena.free(extent)
            self._signal_space()
            return existing
        header = fetched.header
        entry = Entry(
            block_id,
            header.payload_bytes,
            header.xxh3_64,
            self._take_generation(),
            dram_extent=extent,
            in_remote=True,
        )
        self.catalog.add(entry)
        self.policies.accessed(entry.block_id, self._info(entry))
        self._dram_order[tenant].insert(entry.block_id, self._info(entry))
        self._counters.remote_fetches += 1
        return entry

    def _bad_remote_value(self, block_id: BlockId, err: CorruptRecord) -> None:
        assert self.remote is not None
        self._counters.checksum_failures += 1
        self._spawn(self.remote.discard_bad(block_id, err))

    async def _put_remote(self, entry: Entry) -> None:
        """Put a block into the remote tier: pinned while its value is copied out of DRAM
        (what an eviction waits for), then sent from that copy in the background."""
        assert self.remote is not None
        if entry.dram_extent is None or entry.in_remote or not self.catalog.is_live(entry):
            return
        started_s = time.perf_counter()
        self.catalog.pin(entry)
        view = self.arena_of(entry.block_id).view(entry.dram_extent)
        try:
            value = await self.remote.encode(
                entry.block_id, entry.generation, view[: entry.size_bytes], entry.xxh3_64
            )
        finally:
            view.release()
            self._unpin(entry)
        if value is None:
            return
        entry.in_remote = True  # on its way: an eviction need not put it again
        self._spawn(self._send_remote(entry, value, started_s))

    async def _send_remote(self, entry: Entry, value: bytes, started_s: float) -> None:
        assert self.remote is not None
        if await self.remote.send(entry.block_id, value, entry.size_bytes):
            self._counters.remote_puts += 1
            self.telemetry.transfer("dram", "remote", len(value), time.perf_counter() - started_s)
        else:
            entry.in_remote = False

    # ---- making room --------------------------------------------------------------------
    async def _reserve_dram(self, tenant: str, size_bytes: int) -> Extent:
        arena = self.arena(tenant)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.limits.reserve_wait_s
        while True:
            extent = arena.allocate(size_bytes)
            if extent is not None:
                return extent
            victims = self._pick_dram_victims(tenant, size_bytes)
            if victims:
                await self._run_to_end(*(self._evict_from_dram(v) for v in victims))
                continue
            # Everything left is being written or read; wait (bounded) for some to finish.
            remaining = deadline - loop.time()
            if remaining > 0 and self._busy_in_dram(tenant):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._space_freed.wait(), remaining)
                continue
            raise ResourceExhausted(
                f"no room for a {size_bytes}-byte block: DRAM is full of blocks being written "
                "or read; retry later"
            )

    def _busy_in_dram(self, tenant: str) -> bool:
        # Reservations in progress and pinned blocks free space when they finish.
        if (
            self.arena(tenant).used_bytes > self._catalogued_bytes(tenant)
            or self._reserving[tenant] > 1
        ):
            return True
        return any(e.pins or e.demoting for e in self._dram_entries(tenant))

    def _dram_entries(self, tenant: str) -> Iterator[Entry]:
        for entry in self.catalog.entries():
            if entry.dram_extent is not None and tenant_of(entry.block_id[0]) == tenant:
                yield entry

    def _catalogued_bytes(self, tenant: str) -> int:
        return sum(
            e.dram_extent.size_bytes
            for e in self._dram_entries(tenant)
            if e.dram_extent is not None
        )

    def _pick_dram_victims(self, tenant: str, size_bytes: int) -> list[Entry]:
        arena = self.arena(tenant)
        shortfall = size_bytes - (arena.capacity_bytes - arena.used_bytes)
        victims: list[Entry] = []
        freed = 0
        order = self._dram_order[tenant]
        # At least one even when the bytes are free: they may be too fragmented to use.
        while (freed < shortfall or not victims) and len(victims) < self.io.threads:
            block_id = order.victim(self._evictable)
            if block_id is None:
                break
            entry = self.catalog.get(block_id)  # type: ignore[arg-type]
            if entry is None or entry.dram_extent is None:
                continue  # stale: the policy's view lagged the catalog
            victims.append(entry)
            freed += entry.dram_extent.size_bytes
        for entry in victims:
            entry.demoting = True
        return victims

    async def _evict_from_dram(self, entry: Entry) -> None:
        try:
            if self.remote is not None and self.config.remote.admission == "on_evict":
                await self._put_remote(entry)
            wanted = self.nvme is not None and not entry.nvme_record_bytes
            if wanted and not self.policies.admission.admit_on_evict(
                entry.block_id, self._info(entry)
            ):
                wanted = False
                self._counters.not_admitted += 1
            if wanted and await self._write_nvme(entry, evicting=True):
                self._counters.demotions += 1
                self._counters.admitted += 1
                if failpoints.ACTIVE:
                    failpoints.fire("store.evict")
        finally:
            entry.demoting = False
        if entry.pins:
            # A reader pinned it while it was being written out: its DRAM copy stays (now
            # also on NVMe, so a later eviction is free) and is freed no earlier than unpin.
            if self.catalog.is_live(entry):
                self._dram_order[tenant_of(entry.block_id[0])].insert(
                    entry.block_id, self._info(entry)
                )
            self._signal_space()
            return
        self._counters.evictions["dram"] += 1
        live = self.catalog.is_live(entry)
        extent = self.catalog.drop_dram(entry)
        if extent is not None:
            self.arena_of(entry.block_id).free(extent)
        if live and not self.catalog.is_live(entry):
            self._counters.eviction_reasons["dram", "dropped"] += 1
            self._dropped(entry)
        else:
            self._counters.eviction_reasons["dram", "demoted"] += 1
        self._after_use(entry)
        self._signal_space()

    async def _write_nvme(self, entry: Entry, evicting: bool) -> bool:
        assert self.nvme is not None and entry.dram_extent is not None
        if not self.nvme_health.online:
            return False
        header = self._record_header(entry)
        need = header.record_bytes
        if not self._make_nvme_room(need, tenant_of(entry.block_id[0])):
            return False
        self._nvme_reserved_bytes += need
        self._nvme_reserved_by_tenant[tenant_of(entry.block_id[0])] += need
        view = self.arena_of(entry.block_id).view(entry.dram_extent)
        started_s = time.perf_counter()
        try:
            record_bytes = await self.io.run(self.nvme.write, header, _payload(view, entry))
            self.nvme_health.succeeded()
            self.telemetry.transfer("dram", "nvme", record_bytes, time.perf_counter() - started_s)
        except OSError as err:
            self._nvme_failed(err)
            logger.warning(
                "could not write a %s record to NVMe (%s); the block %s",
                human_size(need),
                err.strerror or err,
                "is dropped" if evicting else "stays in DRAM only",
            )
            return False
        finally:
            view.release()
            self._nvme_reserved_bytes -= need
            self._nvme_reserved_by_tenant[tenant_of(entry.block_id[0])] -= need
        self.catalog.set_nvme(entry, record_bytes)
        if self.catalog.is_live(entry):
            self._nvme_order.insert(entry.block_id, self._info(entry))
        return True

    def _make_nvme_room(self, need_bytes: int, tenant: str | None = None) -> bool:
        """Room for `need_bytes` of `tenant`'s: first within its quota (evicting its own
        blocks), then in the shared tier (evicting by the policy, anyone's)."""
        assert self.nvme is not None
        capacity = self.nvme.capacity_bytes
        if need_bytes > capacity:
            return False
        quota = self._nvme_quota(tenant)
        if quota and need_bytes > quota:
            return False
        if quota:
            assert tenant is not None

            def own(block_id: object) -> bool:
                return self._evictable(block_id) and tenant_of(block_id[0]) == tenant  # type: ignore[index]

            used = self.catalog.nvme_used_by_tenant
            while used[tenant] + self._nvme_reserved_by_tenant[tenant] + need_bytes > quota:
                if not self._evict_nvme(own):
                    return False
        while self.catalog.nvme_used_bytes + self._nvme_reserved_bytes + need_bytes > capacity:
            if not self._evict_nvme(self._evictable):
                return False
        return True

    def _nvme_quota(self, tenant: str | None) -> int:
        settings = self.config.tenants.get(tenant) if tenant is not None else None
        return settings.nvme_capacity_bytes if settings is not None else 0

    def _evict_nvme(self, evictable: Callable[[object], bool]) -> bool:
        """Remove one NVMe record chosen by the policy; False when none may go."""
        assert self.nvme is not None
        while True:
            block_id = self._nvme_order.victim(evictable)
            if block_id is None:
                return False
            victim = self.catalog.get(block_id)  # type: ignore[arg-type]
            if victim is None or not victim.nvme_record_bytes:
                continue
            header = self._record_header(victim)
            self.catalog.drop_nvme(victim)
            self._counters.evictions["nvme"] += 1
            self._counters.eviction_reasons["nvme", "capacity"] += 1
            if not self.catalog.is_live(victim):
                self._dropped(victim)
            self._schedule_removal(header)
            return True

    # ---- releasing ----------------------------------------------------------------------
    def _discard(self, entry: Entry) -> None:
        """Remove from lookups now; free its memory and record once nothing uses it."""
        self.catalog.remove(entry)
        self._forget(entry)
        self._after_use(entry)

    def _after_use(self, entry: Entry) -> None:
        if not entry.doomed or entry.pins or entry.demoting:
            return
        if entry.dram_extent is not None:
            self.arena_of(entry.block_id).free(entry.dram_extent)
            entry.dram_extent = None
            self._signal_space()
        if entry.nvme_record_bytes and self.nvme is not None:
            self._schedule_removal(self._record_header(entry))
            entry.nvme_record_bytes = 0

    def _unpin(self, entry: Entry) -> None:
        self.catalog.unpin(entry)
        self._after_use(entry)
        if not entry.pins:
            self._signal_space()

    # ---- NVMe health ---------------------------------------------------------------------
    def _nvme_failed(self, err: OSError, doing: str = "") -> None:
        if doing:
            logger.warning("could not %s on NVMe: %s", doing, err.strerror or err)
        if err.errno not in _FULL_ERRNOS:  # a full disk is not a failing one
            self.nvme_health.failed(err)

    def _schedule_removal(self, header: RecordHeader) -> None:
        """Remove a record the catalog no longer has, in the background; until it is gone,
        a new value of its block waits for a tombstone (see put_commit)."""
        block_id = (header.ns_id, header.key)
        self._removing[block_id] = max(self._removing.get(block_id, 0), header.generation)
        self._spawn(self._remove_record(header))

    async def _remove_record(self, header: RecordHeader) -> None:
        assert self.nvme is not None
        try:
            await self.io.run(self.nvme.remove, header)
        except FileNotFoundError:
            pass
        except OSError as err:
            self._nvme_failed(err, "remove a record")
            self._unremoved.append(header)  # retried by the watcher: disk must not leak
            return
        else:
            self.nvme_health.succeeded()
        block_id = (header.ns_id, header.key)
        if self._removing.get(block_id) == header.generation:
            del self._removing[block_id]

    async def _watch_nvme_forever(self) -> None:
        """Probe an offline tier until it works again, then finish what failed on it."""
        interval_s = self.config.nvme.offline_retry_s
        while True:
            await asyncio.sleep(interval_s if not self.nvme_health.online else interval_s / 4)
            try:
                if not self.nvme_health.online:
                    if not await self._probe_nvme():
                        continue
                    self.nvme_health.recovered()
                await self._retry_failed_nvme_work()
            except Exception:  # the watcher must outlive any one failure
                logger.exception("NVMe health check failed")

    async def _probe_nvme(self) -> bool:
        """Write, read back and remove one small record; True if all of it worked."""
        assert self.nvme is not None
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
            await self.io.run(self.nvme.write, header, [memoryview(payload)])
            await self.io.run(self.nvme.read, header)
            await self.io.run(self.nvme.remove, header)
            return True
        except (OSError, CorruptRecord) as err:
            # `payload` is not closed here: the traceback may still hold views of it.
            logger.info("NVMe tier still failing its probe: %s", err)
            return False

    async def _retry_failed_nvme_work(self) -> None:
        assert self.nvme is not None
        tombstones, self._unwritten_tombstones = self._unwritten_tombstones, []
        for block_id, generation in tombstones:
            await self._tombstone_generation(block_id, generation)
        headers, self._unremoved = self._unremoved, []
        for header in headers:
            await self._remove_record(header)

    def _on_bad_record(self, entry: Entry, header: RecordHeader, err: Exception) -> None:
        assert self.nvme is not None
        if isinstance(err, CorruptRecord):
            self._counters.checksum_failures += 1
            logger.warning(
                "NVMe record failed verification (%s); served as a miss and dropped", err
            )
        elif isinstance(err, FileNotFoundError):
            logger.warning("NVMe record missing from disk; served as a miss and forgotten")
        elif isinstance(err, OSError):
            self._nvme_failed(err)
            entry.read_errors += 1
            if entry.read_errors < READ_ERRORS_BEFORE_DROP:
                # Perhaps transient: a miss now, the record kept for the next read.
                logger.warning("NVMe record unreadable (%s); served as a miss", err)
                return
            logger.warning("NVMe record unreadable (%s) again; served as a miss and dropped", err)
        if self.catalog.is_live(entry) and entry.nvme_record_bytes:
            self.catalog.drop_nvme(entry)
            self._counters.eviction_reasons["nvme", "corrupt"] += 1
            self._nvme_order.remove(entry.block_id)
            if not self.catalog.is_live(entry):
                self._counters.dropped_blocks += 1
                self._forget(entry)
        self._schedule_removal(header)

    # ---- policy bookkeeping ---------------------------------------------------------------
    def _evictable(self, block_id: object) -> bool:
        entry = self.catalog.get(block_id)  # type: ignore[arg-type]
        return entry is not None and entry.pins == 0 and not entry.demoting

    def _info(self, entry: Entry) -> BlockInfo:
        # Learned from chains (see _learn_chain); a block never looked up as part of one
        # is valued as if it were first in its chain.
        return self._infos.get(entry.block_id) or BlockInfo(entry.size_bytes)

    def _learn_chain(self, ns_id: str, keys: list[bytes], tiers: list[str | None]) -> None:
        """A chain an engine asked about: where each cached block sits in it (on every
        Plan, so the common case — nothing changed since the last one — is a dict probe)."""
        last = len(keys) - 1
        infos, ghosts = self._infos, self.policies.ghosts
        parent: BlockId | None = None
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            if key in seen:
                # A chain that names a block twice is not a chain past that point: a block
                # must never become its own ancestor (the policy walks parents).
                break
            seen.add(key)
            block_id = (ns_id, key)
            if tiers[i] is None:
                if ghosts.take(block_id):
                    self._counters.lost_reuse += 1
            else:
                known = infos.get(block_id)
                if known is None or known.position != i or known.from_end != last - i:
                    entry = self.catalog.get(block_id)
                    if entry is not None:
                        infos[block_id] = BlockInfo(entry.size_bytes, i, parent, last - i)
            parent = block_id

    def _used(self, entry: Entry) -> None:
        info = self._info(entry)
        self.policies.accessed(entry.block_id, info)
        if entry.dram_extent is not None:
            self._dram_order[tenant_of(entry.block_id[0])].hit(entry.block_id)
        if entry.nvme_record_bytes:
            self._nvme_order.hit(entry.block_id)

    def _missed(self, block_id: BlockId) -> None:
        self._counters.misses += 1
        if self.policies.ghosts.take(block_id):
            self._counters.lost_reuse += 1

    def _dropped(self, entry: Entry) -> None:
        """Evicted from every tier: remember the key to count reuse lost to it."""
        self._counters.dropped_blocks += 1
        self.policies.ghosts.add(entry.block_id)
        self._forget(entry)

    def _forget(self, entry: Entry) -> None:
        self._dram_order[tenant_of(entry.block_id[0])].remove(entry.block_id)
        self._nvme_order.remove(entry.block_id)
        self._infos.pop(entry.block_id, None)

    def _refresh_value_costs(self) -> dict[str, TierCost]:
        """The engine-visible cost of each tier now (read by the planner and the policy)."""
        for name in self.paths:
            self._value_costs[name] = self.path_cost(name)
        return dict(self._value_costs)

    async def _write_through(self, entry: Entry) -> None:
        """policy.admission = write_through: every new block goes to NVMe right away."""
        if not self.catalog.is_live(entry) or entry.demoting or entry.nvme_record_bytes:
            return
        entry.demoting = True
        try:
            if await self._write_nvme(entry, evicting=False):
                self._counters.admitted += 1
        finally:
            entry.demoting = False
            self._after_use(entry)

    def _signal_space(self) -> None:
        self._space_freed.set()
        self._space_freed = asyncio.Event()

    async def _run_to_end(self, *works: Coroutine[Any, Any, T]) -> list[T]:
        """Await `works`, which go on to their end even if the caller is cancelled (a client
        gone, a deadline): each moves bytes on an I/O thread and then brings the catalog in
        step, so one stopped half-way would leave a record on disk, or an extent, that
        nothing knows of."""
        return await asyncio.shield(asyncio.gather(*(self._spawn(w) for w in works)))

    def _once(
        self,
        running: dict[K, asyncio.Future[T]],
        key: K,
        work: Callable[[], Coroutine[Any, Any, T]],
    ) -> asyncio.Future[T]:
        """One run of `work` per key at a time, shared by every caller and run to its end
        even when they are cancelled (it fills an extent on an I/O thread, which must end
        attached to its block or freed, never half-way)."""
        task = running.get(key)
        if task is None:
            task = self._spawn(work())
            running[key] = task
            task.add_done_callback(lambda _: running.pop(key, None))
        return asyncio.shield(task)

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _take_generation(self) -> int:
        gen = self._next_generation
        self._next_generation += 1
        return gen

    @staticmethod
    def _record_header(entry: Entry) -> RecordHeader:
        ns_id, key = entry.block_id
        return RecordHeader(
            ns_id=ns_id,
            key=key,
            generation=entry.generation,
            payload_bytes=entry.size_bytes,
            xxh3_64=entry.xxh3_64,
            header_bytes=header_size_for(ns_id, key),
        )
