"""DramSpace: the tenants' arenas (kvtier/tiers/dram.py), reservation in them, and their
page-locking for the GPU.

One arena per tenant: a client maps its tenant's arena and nothing else. Reserving room
evicts through the store's demoter (engine/demoter.py: it writes victims to NVMe in
batches, ahead of need; a reservation only waits for it) and, when every block left is
in use, waits — bounded by `limits.reserve_wait_s` — for one to be let go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from kvtier.config import Config
from kvtier.errors import ConfigError, PermissionDenied, ResourceExhausted
from kvtier.keys import tenant_of
from kvtier.sizes import human_size
from kvtier.tiers.dram import DramTier
from kvtier.types import BlockId, Extent

logger = logging.getLogger(__name__)

# Make room in a tenant's arena for a block of so many bytes: True if something was
# evicted (try again), False if nothing could be.
MakeRoom = Callable[[str, int], Awaitable[bool]]
# Whether room will come by itself (a put in flight, a block in use).
Busy = Callable[[str], bool]


class Arena(DramTier):
    """A tenant's arena, whose every free first calls `before_free` (the directory's
    unpublish: a block readers may copy without a lease must vanish from the directory
    before its extent can be reused). Everything frees through here, the demoter too."""

    before_free: Callable[[Extent], None] | None = None

    def free(self, extent: Extent) -> None:
        if self.before_free is not None:
            self.before_free(extent)
        super().free(extent)


class DramSpace:
    def __init__(self, config: Config) -> None:
        self._config = config
        gpu = config.gpu
        self._pinning = gpu.device >= 0 and gpu.pin_arena and not gpu.emulate
        # An arena pinned for the GPU is faulted in by several threads before it is
        # registered, rather than by MAP_POPULATE on one.
        self.hooked: dict[str, Arena] = {  # the same arenas, with their free hook
            tenant: Arena(size, config.dram.prefault and not self._pinning)
            for tenant, size in config.tenant_arenas().items()
        }
        self.arenas: dict[str, DramTier] = dict(self.hooked)
        self._reserving: dict[str, int] = dict.fromkeys(self.arenas, 0)
        self._space_freed = asyncio.Event()
        self._handed = False  # whether anyone took `freed` since the last signal
        self._pinned: list[int] = []  # arena addresses registered with CUDA

    def arena(self, tenant: str) -> DramTier:
        """The DRAM arena of `tenant` (every tenant that can authenticate has one)."""
        try:
            return self.arenas[tenant]
        except KeyError:
            raise PermissionDenied(f"tenant {tenant!r} has no DRAM arena") from None

    def arena_of(self, block_id: BlockId) -> DramTier:
        return self.arena(tenant_of(block_id[0]))

    @property
    def used_bytes(self) -> int:
        return sum(a.used_bytes for a in self.arenas.values())

    @property
    def capacity_bytes(self) -> int:
        return sum(a.capacity_bytes for a in self.arenas.values())

    def largest_block_bytes(self, tenant: str, max_block_bytes: int) -> int:
        return min(max_block_bytes, self.arena(tenant).capacity_bytes)

    def free(self, block_id: BlockId, extent: Extent) -> None:
        self.arena_of(block_id).free(extent)
        self.signal()

    def signal(self) -> None:
        """Space was freed, or a block became evictable: wake the puts waiting for room.
        Every put and every free signals: when nobody took the event since the last
        signal, nobody can be waiting on it, and it is kept (a new Event a put cost
        ~1.5 µs on the loop)."""
        if self._handed:
            self._handed = False
            self._space_freed.set()
            self._space_freed = asyncio.Event()

    @property
    def freed(self) -> asyncio.Event:
        """Set at the next `signal` (the demoter's waiting reservations wait on it)."""
        self._handed = True
        return self._space_freed

    def reserving(self, tenant: str) -> int:
        """How many puts of `tenant` are reserving room now."""
        return self._reserving[tenant]

    async def reserve(
        self, tenant: str, size_bytes: int, make_room: MakeRoom, busy: Busy, put: bool = False
    ) -> Extent:
        """An extent of `size_bytes` in `tenant`'s arena, evicting (`make_room`) as needed;
        ResourceExhausted if none frees up within `limits.reserve_wait_s`. `put`: the
        reservation is a put's (counted in `reserving`)."""
        if put:
            self._reserving[tenant] += 1
        try:
            return await self._reserve(self.arena(tenant), tenant, size_bytes, make_room, busy)
        finally:
            if put:
                self._reserving[tenant] -= 1

    async def _reserve(
        self, arena: DramTier, tenant: str, size_bytes: int, make_room: MakeRoom, busy: Busy
    ) -> Extent:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.limits.reserve_wait_s
        while True:
            extent = arena.allocate(size_bytes)
            if extent is not None:
                return extent
            if await make_room(tenant, size_bytes):
                continue
            # Everything left is being written or read; wait (bounded) for some to end.
            remaining = deadline - loop.time()
            if remaining > 0 and busy(tenant):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.freed.wait(), remaining)
                continue
            raise ResourceExhausted(
                f"no room for a {size_bytes}-byte block: DRAM is full of blocks being "
                "written or read; retry later"
            )

    def reconfigure(self, config: Config) -> None:
        self._config = config

    # ---- page-locking for the GPU ---------------------------------------------------------
    def pin(self) -> None:
        """Page-lock every arena for the GPU (kvtier/movers/pinned.py) if configured;
        refuses to start when it cannot, rather than serve the GPU at bounce-buffer speed
        unnoticed. Blocking: run it on a thread."""
        if not self._pinning:
            return
        from kvtier.movers import pinned

        gpu = self._config.gpu
        for tenant, arena in self.arenas.items():
            try:
                report = pinned.pin(arena.address, arena.capacity_bytes, gpu.touch_threads)
            except RuntimeError as err:
                raise ConfigError(f"gpu.device = {gpu.device}: {err}") from None
            self._pinned.append(arena.address)
            logger.info(
                "pinned the %s DRAM arena of tenant %s for GPU %d in %.2f s (first touch "
                "%.2f s on %d threads, cudaHostRegister %.2f s)",
                human_size(arena.capacity_bytes),
                tenant,
                gpu.device,
                report.touch_s + report.register_s,
                report.touch_s,
                gpu.touch_threads,
                report.register_s,
            )

    def unpin(self) -> None:
        if not self._pinned:
            return
        from kvtier.movers import pinned

        for address in self._pinned:
            pinned.unregister(address)
        self._pinned.clear()
