"""Engine GPU memory as a source and destination: CUDA IPC registration, put and get.

An engine registers its KV tensor once (`register`: the CUDA IPC handle of the
allocation holding it, the tensor's offset and size), on its attached session; each
`put` or `get` then names blocks by byte range in it. The daemon copies between that
memory and the DRAM arena (pinned for the GPU) on its own streams (`Mover`): a put
reserves arena slots, copies device -> host, and commits (the checksum is computed from
the arena bytes, which only the daemon wrote); a get acquires the blocks (promoting them
from NVMe or the remote tier as the zero-copy path does), copies host -> device and
releases them. Each call answers once its copies are done, so the engine waits per
request; the blocks' arena memory is pinned by the lease until then and only then let go.
A grouped get (`start_get`, `wait`) starts every group's copies at once and answers per
group (an engine's layers), so later layers arrive while earlier ones are used.

Registrations end with their session (the engine's side connection closing), and the
IPC mappings are closed then. The engine must keep the registered tensor allocated while
it is registered: the daemon maps the allocation, not a reference to the tensor.

With `gpu.hbm_capacity_bytes`, blocks the engines read this way are kept in a
daemon-owned GPU pool too (`HbmCache`; which copies leave is the policy's choice): the
next read of one is a device-to-device copy, with no lease, no host memory, no PCIe. A
copy is valid only for the generation of the block it was made from (an overwrite or a
delete makes it a miss), it is written before the read that made it answers (the engine
may reuse its memory after that), and it is never freed while a copy out of it is in
flight. It holds copies, not blocks: the DRAM/NVMe tiers keep the block, and a block
evicted from all of them drops its HBM copy at its next read.

`CudaOpener` is what touches CUDA: `TorchOpener` opens handles with cupy (torch has no
public call for it) and views memory as torch tensors; `EmulatedOpener` (`gpu.emulate`)
treats a "handle" as the path of a shared-memory file and runs on `FakeDevice`, so the
whole path is tested end to end on machines without a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from kvtier.engine.store import CommitOutcome, TierUsage
from kvtier.errors import InvalidArgument, NotFound, ResourceExhausted
from kvtier.index.catalog import BlockId, TierName
from kvtier.index.estimators import PathEstimator
from kvtier.index.packed_policies import PackedPolicies
from kvtier.index.planner import TierCost
from kvtier.index.policy import BlockInfo, Key, TierPolicy
from kvtier.index.slots import NO_SLOT, key_digest
from kvtier.movers.cuda import Mover, Transfer
from kvtier.tiers.allocator import Extent, extent_allocator

if TYPE_CHECKING:
    from kvtier.engine.store import Store
    from kvtier.tiers.dram import DramTier

T = TypeVar("T")
MAX_BUFFERS_PER_SESSION = 64
MAX_GETS_PER_SESSION = 64  # grouped gets started and not yet waited for
HBM_ALIGN_BYTES = 256  # cudaMalloc's alignment: copies start on it


class CudaOpener(Protocol):
    def open(
        self, device: int, handle: bytes, offset: int, size: int
    ) -> tuple[Any, Callable[[], None]]:
        """The engine's memory as a 1-D byte buffer of `size`, and how to close it."""
        ...

    def host(self, arena: DramTier) -> Any:
        """A 1-D byte buffer over the whole arena, usable as a copy's source or target."""
        ...

    def window(self, buffer: Any, offset: int, size: int) -> Any: ...

    def alloc(self, device: int, size: int) -> Any:
        """Device memory the daemon owns (the HBM pool), as a 1-D byte buffer."""
        ...


class SlotOrder(TierPolicy):
    """A packed policy's order (kvtier/index/packed_policy.py) for a tier that is not in
    the catalog (HBM copies, a few thousand at most): each key gets a slot of its own
    here, freed when it leaves and no copy names it as a parent."""

    def __init__(
        self, policies: PackedPolicies, tier: str, fallback: str | None, capacity_bytes: int
    ) -> None:
        self._slots: dict[Key, int] = {}
        self._keys: list[Key | None] = []
        self._digests: list[int] = []
        self._free: list[int] = []
        self._parked: list[int] = []  # gone, but still named as a parent
        self._order = policies.new_tier(tier, fallback, capacity_bytes, self._digests.__getitem__)

    def _slot(self, key: Key) -> int:
        slot = self._slots.get(key)
        if slot is not None:
            return slot
        if self._parked:
            parked, self._parked = self._parked, []
            for s in parked:
                self._release(s)
        if self._free:
            slot = self._free.pop()
            self._keys[slot], self._digests[slot] = key, key_digest(key)
        else:
            slot = len(self._keys)
            self._keys.append(key)
            self._digests.append(key_digest(key))
        self._slots[key] = slot
        return slot

    def _release(self, slot: int) -> None:
        if self._order.names_as_parent(slot):
            self._parked.append(slot)
        else:
            self._free.append(slot)

    def _gone(self, key: Key) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._keys[slot] = None
            self._release(slot)

    def insert(self, key: Key, info: BlockInfo) -> None:
        parent = NO_SLOT if info.parent is None else self._slots.get(info.parent, NO_SLOT)
        self._order.insert(self._slot(key), info.size_bytes, info.position, parent)

    def hit(self, key: Key) -> None:
        slot = self._slots.get(key)
        if slot is not None:
            self._order.hit(slot)

    def remove(self, key: Key) -> None:
        slot = self._slots.get(key)
        if slot is not None:
            self._order.remove(slot)
            self._gone(key)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        keys = self._keys
        slot = self._order.victim(lambda s: evictable(keys[s]))
        if slot is None:
            return None
        key = keys[slot]
        self._gone(key)
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._order)


@dataclass(eq=False)
class HbmCopy:
    block_id: BlockId
    generation: int
    size_bytes: int
    extent: Extent
    pins: int = 0  # copies in flight out of (or into) it


class HbmCache:
    """Copies of hot blocks in one GPU allocation; bookkeeping only (the copies are the
    caller's, on the Mover). Which copy leaves for a new one is the daemon's policy's
    choice (`order`: an eviction order of the `hbm` tier, valued against DRAM as the tier
    a block falls back to); pinned copies never leave."""

    def __init__(self, memory: Any, capacity_bytes: int, order: TierPolicy) -> None:
        self.memory = memory
        self.capacity_bytes = capacity_bytes
        self._allocator = extent_allocator(capacity_bytes, HBM_ALIGN_BYTES)
        self._copies: dict[BlockId, HbmCopy] = {}
        self._order = order
        self.hits = 0
        self.promotions = 0
        self.evictions = 0

    @property
    def used_bytes(self) -> int:
        return self._allocator.used_bytes

    def __len__(self) -> int:
        return len(self._copies)

    def lookup(self, block_id: BlockId, generation: int, size_bytes: int) -> HbmCopy | None:
        """The block's copy, if it is of this generation and size (else it is dropped);
        a use of it for the policy."""
        copy = self._copies.get(block_id)
        if copy is None:
            return None
        if copy.generation != generation or copy.size_bytes != size_bytes:
            self._drop(copy)
            return None
        self._order.hit(block_id)
        return copy

    def reserve(self, block_id: BlockId, generation: int, info: BlockInfo) -> HbmCopy | None:
        """Room for a new copy of `info.size_bytes` (evicting unpinned copies in the
        policy's order); None when there is none. The caller pins it while its bytes are
        on their way."""
        old = self._copies.get(block_id)
        if old is not None and not self._drop(old):
            return None  # an older copy still in use: leave it
        while (extent := self._allocator.allocate(info.size_bytes)) is None:
            victim = self._order.victim(self._unpinned)
            if victim is None:
                return None
            self._drop(self._copies[cast(BlockId, victim)])
            self.evictions += 1
        copy = HbmCopy(block_id, generation, info.size_bytes, extent)
        self._copies[block_id] = copy
        self._order.insert(block_id, info)
        return copy

    def _unpinned(self, key: Key) -> bool:
        return not self._copies[cast(BlockId, key)].pins

    def _drop(self, copy: HbmCopy) -> bool:
        if copy.pins:
            return False
        if self._copies.get(copy.block_id) is copy:
            del self._copies[copy.block_id]
            self._order.remove(copy.block_id)
        self._allocator.free(copy.extent)
        return True

    def forget(self, copy: HbmCopy) -> None:
        """A copy whose bytes never arrived (its transfer failed)."""
        copy.pins = 0
        self._drop(copy)


@dataclass(eq=False)
class EngineBuffer:
    buffer_id: int
    session_id: int
    tenant: str
    size_bytes: int
    memory: Any
    closer: Callable[[], None]
    users: int = 0  # calls copying to or from it now
    ended: bool = False  # its session ended: close once no call uses it

    def close_when_unused(self) -> None:
        self.ended = True
        if not self.users:
            self.closer()


@dataclass(frozen=True, slots=True)
class CudaBlock:
    key: bytes
    offset_bytes: int
    size_bytes: int


class CudaPath:
    """Registrations and copies for one daemon (one GPU); used from the event loop."""

    def __init__(
        self,
        store: Store,
        mover: Mover,
        opener: CudaOpener,
        device: int,
        hbm_capacity_bytes: int = 0,
    ) -> None:
        self.store = store
        self.mover = mover
        self.opener = opener
        self.device = device
        self.hbm: HbmCache | None = None
        self._hbm_path: PathEstimator | None = None
        if hbm_capacity_bytes > 0:
            planner, hbm, dram = store.config.planner, TierName.HBM.value, TierName.DRAM.value
            seed = TierCost(planner.hbm_bandwidth_bytes_per_s, planner.hbm_latency_s)
            self._hbm_path = store.add_path(hbm, seed)
            self.hbm = HbmCache(
                opener.alloc(device, hbm_capacity_bytes),
                hbm_capacity_bytes,
                # Valued against DRAM, the tier an HBM copy falls back to.
                SlotOrder(store.policies, hbm, dram, hbm_capacity_bytes),
            )
            store.add_tier_report(self._hbm_usage)
        self._buffers: dict[int, EngineBuffer] = {}
        self._next_id = 1
        self._hosts: dict[str, Any] = {}  # tenant -> buffer over its arena
        self._tasks: set[asyncio.Task[Any]] = set()
        # Grouped gets in flight: (session, request) -> group -> its task (see start_get).
        self._gets: dict[tuple[int, int], dict[int, asyncio.Task[list[TierName | None]]]] = {}

    # ---- registrations --------------------------------------------------------------------
    def register(
        self, session_id: int, tenant: str, device: int, handle: bytes, offset: int, size: int
    ) -> int:
        if device != self.device:
            raise InvalidArgument(
                f"this daemon serves GPU {self.device} (gpu.device); the tensor is on GPU "
                f"{device}: register it with the daemon of that GPU"
            )
        if size <= 0 or not handle:
            raise InvalidArgument("register a tensor with an IPC handle and a size > 0")
        held = sum(b.session_id == session_id for b in self._buffers.values())
        if held >= MAX_BUFFERS_PER_SESSION:
            raise ResourceExhausted(
                f"this session registered {held} buffers, the most allowed: register the "
                "whole KV tensor once and name blocks by offset"
            )
        try:
            memory, close = self.opener.open(device, handle, offset, size)
        except (OSError, RuntimeError, ValueError) as err:
            raise InvalidArgument(
                f"could not open the CUDA IPC handle ({err}): send the handle of a live "
                "allocation on this GPU, from a process on this node"
            ) from None
        buffer_id = self._next_id
        self._next_id += 1
        self._buffers[buffer_id] = EngineBuffer(buffer_id, session_id, tenant, size, memory, close)
        return buffer_id

    def end_session(self, session_id: int) -> None:
        """Forget the session's buffers and grouped gets; a buffer is unmapped once no
        call (and no group still copying) uses it."""
        for pending in [k for k in self._gets if k[0] == session_id]:
            del self._gets[pending]
        for buffer_id in [i for i, b in self._buffers.items() if b.session_id == session_id]:
            self._buffers.pop(buffer_id).close_when_unused()

    def _hbm_usage(self) -> TierUsage:
        hbm = self.hbm
        assert hbm is not None
        return TierUsage(
            "hbm", hbm.used_bytes, hbm.capacity_bytes, len(hbm), hbm.hits, hbm.evictions
        )

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for buffer in self._buffers.values():
            buffer.close_when_unused()
        self._buffers.clear()
        self._hosts.clear()

    def _buffer(self, session_id: int, buffer_id: int, blocks: list[CudaBlock]) -> EngineBuffer:
        buffer = self._buffers.get(buffer_id)
        if buffer is None or buffer.session_id != session_id:
            raise InvalidArgument(
                f"no buffer {buffer_id} registered on this session: RegisterCuda first"
            )
        for i, block in enumerate(blocks):
            if block.size_bytes <= 0 or block.offset_bytes + block.size_bytes > buffer.size_bytes:
                raise InvalidArgument(
                    f"block {i} (bytes {block.offset_bytes}..+{block.size_bytes}) is not inside "
                    f"the registered buffer of {buffer.size_bytes} bytes"
                )
        return buffer

    def _host(self, tenant: str) -> Any:
        host = self._hosts.get(tenant)
        if host is None:
            host = self._hosts[tenant] = self.opener.host(self.store.arena(tenant))
        return host

    # ---- copies ---------------------------------------------------------------------------
    async def put(
        self,
        session_id: int,
        ns_id: str,
        buffer_id: int,
        blocks: list[CudaBlock],
        overwrite: bool,
    ) -> list[CommitOutcome]:
        """Store blocks from the engine's memory (device -> arena), then commit them."""
        buffer = self._buffer(session_id, buffer_id, blocks)
        return await self._to_end(buffer, self._put(session_id, ns_id, buffer, blocks, overwrite))

    async def _to_end(self, buffer: EngineBuffer, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` to its end even if the caller is cancelled (a client gone, a
        deadline): copies in flight on the device must finish before the arena slots,
        leases, HBM copies and engine mapping they touch are committed, released, freed
        or closed."""
        return await asyncio.shield(self._started(buffer, work))

    def _started(self, buffer: EngineBuffer, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """`work` on a task of its own that holds `buffer` mapped until it ends."""
        buffer.users += 1

        def done(task: asyncio.Future[T]) -> None:
            self._tasks.discard(task)
            buffer.users -= 1
            if buffer.ended and not buffer.users:
                buffer.closer()

        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(done)
        return task

    async def _put(
        self,
        session_id: int,
        ns_id: str,
        buffer: EngineBuffer,
        blocks: list[CudaBlock],
        overwrite: bool,
    ) -> list[CommitOutcome]:
        items: list[tuple[BlockId, int]] = [((ns_id, b.key), b.size_bytes) for b in blocks]
        lease_id, slots = await self.store.reserve(session_id, items, overwrite)
        host, window = self._host(buffer.tenant), self.opener.window
        transfer: Transfer | None = None
        try:
            transfer = self.mover.submit(
                "d2h",
                [
                    (
                        window(host, slot.offset, b.size_bytes),
                        window(buffer.memory, b.offset_bytes, b.size_bytes),
                    )
                    for b, slot in zip(blocks, slots, strict=True)
                ],
            )
            await self.mover.until_done(transfer)
        except BaseException:
            if transfer is not None:
                self.mover.wait(transfer)  # its slots are freed next: no copy may be left
            with contextlib.suppress(NotFound):  # the store closed: its leases are gone
                await self.store.commit(session_id, lease_id, [], abort=True)
            raise
        return await self.store.commit(session_id, lease_id, [], abort=False)

    async def get(
        self, session_id: int, ns_id: str, buffer_id: int, blocks: list[CudaBlock]
    ) -> list[TierName | None]:
        """Copy cached blocks into the engine's memory (from HBM device to device, else
        arena -> device); per block the tier it was found in, or None for a miss (its
        range is left as it was)."""
        buffer = self._buffer(session_id, buffer_id, blocks)
        return await self._to_end(buffer, self._get(session_id, ns_id, buffer, blocks))

    async def _get(
        self, session_id: int, ns_id: str, buffer: EngineBuffer, blocks: list[CudaBlock]
    ) -> list[TierName | None]:
        """NVMe -> pinned -> GPU as a pipeline: when blocks must be read from a drive (or
        fetched from the remote tier), the call (or group) is cut into runs of one read
        per I/O thread, all started at once; the reads queue in order, so each run's upload starts
        as soon as its reads are in, while the next run's reads go on. Blocks all in DRAM
        go as one run: nothing to overlap."""
        run = max(self.store.io.threads, 1)
        if len(blocks) <= run or all(self._in_memory(ns_id, b) for b in blocks):
            return await self._get_run(session_id, ns_id, buffer, blocks)
        runs = [blocks[i : i + run] for i in range(0, len(blocks), run)]
        # Every run to its end before the call ends (its copies use the buffer), even if
        # one fails; then the first failure is the call's.
        results = await asyncio.gather(
            *(self._get_run(session_id, ns_id, buffer, part) for part in runs),
            return_exceptions=True,
        )
        tiers: list[TierName | None] = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            tiers.extend(result)
        return tiers

    def _in_memory(self, ns_id: str, block: CudaBlock) -> bool:
        entry = self.store.stat((ns_id, block.key))
        return entry is not None and entry.dram_extent is not None

    def start_get(
        self,
        session_id: int,
        ns_id: str,
        buffer_id: int,
        blocks: list[CudaBlock],
        group_sizes: list[int],
    ) -> int:
        """A get in groups (an engine's layers): every group's copies start now, each on
        its own (its own lease), and `wait` answers for one group once its blocks are in
        the engine's memory, so the engine can run layer 0 while the rest arrive. Returns
        the request's id for `wait`."""
        buffer = self._buffer(session_id, buffer_id, blocks)
        if any(size <= 0 for size in group_sizes) or sum(group_sizes) != len(blocks):
            raise InvalidArgument(
                f"group_sizes {group_sizes} must be counts > 0 adding up to the "
                f"{len(blocks)} blocks named, in order"
            )
        held = sum(s == session_id for s, _ in self._gets)
        if held >= MAX_GETS_PER_SESSION:
            raise ResourceExhausted(
                f"this session has {held} grouped gets not yet waited for, the most allowed: "
                "wait for their groups (CudaWait) first"
            )
        request_id = self._next_id
        self._next_id += 1
        groups: dict[int, asyncio.Task[list[TierName | None]]] = {}
        first = 0
        for group, size in enumerate(group_sizes):
            task = self._started(
                buffer, self._get(session_id, ns_id, buffer, blocks[first : first + size])
            )
            # Read by `wait`, or by nobody if the session ends first: never "unretrieved".
            task.add_done_callback(_retrieve)
            groups[group] = task
            first += size
        self._gets[session_id, request_id] = groups
        return request_id

    async def wait(self, session_id: int, request_id: int, group: int) -> list[TierName | None]:
        """Per block of the group, the tier it was found in (None: a miss), once its copies
        are done. Each group is waited for once; the request is forgotten after its last."""
        groups = self._gets.get((session_id, request_id))
        task = groups.pop(group, None) if groups is not None else None
        if groups is None or task is None:
            raise NotFound(
                f"no group {group} of a grouped get {request_id} pending on this session "
                "(each group is waited for once, on the session that started it)"
            )
        if not groups:
            del self._gets[session_id, request_id]
        return await asyncio.shield(task)

    async def _get_run(
        self, session_id: int, ns_id: str, buffer: EngineBuffer, blocks: list[CudaBlock]
    ) -> list[TierName | None]:
        window = self.opener.window
        tiers: list[TierName | None] = [None] * len(blocks)
        from_hbm: list[tuple[int, HbmCopy]] = []
        rest: list[int] = []
        for i, block in enumerate(blocks):
            copy = self._hbm_copy((ns_id, block.key), block.size_bytes)
            if copy is None:
                rest.append(i)
                continue
            copy.pins += 1
            from_hbm.append((i, copy))
        transfers = []
        if from_hbm:
            hbm, path = self.hbm, self._hbm_path
            assert hbm is not None and path is not None
            started_s = time.perf_counter()

            def unpin() -> None:
                for _, c in from_hbm:
                    c.pins -= 1
                path.observe(
                    sum(c.size_bytes for _, c in from_hbm), time.perf_counter() - started_s
                )

            transfers.append(
                self.mover.submit(
                    "d2d",
                    [
                        (
                            window(buffer.memory, blocks[i].offset_bytes, c.size_bytes),
                            window(hbm.memory, c.extent.offset, c.size_bytes),
                        )
                        for i, c in from_hbm
                    ],
                    on_done=unpin,
                )
            )
            for i, c in from_hbm:
                tiers[i] = TierName.HBM
                hbm.hits += 1
                self.store.record_hit(c.block_id, TierName.HBM)
        if rest:
            for i, tier in zip(
                rest,
                await self._get_from_arena(
                    session_id, ns_id, buffer, [blocks[i] for i in rest], transfers
                ),
                strict=True,
            ):
                tiers[i] = tier
        for transfer in transfers:
            await self.mover.until_done(transfer)
        return tiers

    def _hbm_copy(self, block_id: BlockId, size_bytes: int) -> HbmCopy | None:
        if self.hbm is None:
            return None
        entry = self.store.stat(block_id)
        if entry is None:
            return None
        return self.hbm.lookup(block_id, entry.generation, size_bytes)

    async def _get_from_arena(
        self,
        session_id: int,
        ns_id: str,
        buffer: EngineBuffer,
        blocks: list[CudaBlock],
        transfers: list[Transfer],
    ) -> list[TierName | None]:
        """Arena -> engine under a lease (held until the copies are done), and each block
        read this way copied on into HBM (device to device, after it arrived)."""
        lease_id, slots = await self.store.acquire(session_id, [(ns_id, b.key) for b in blocks])
        try:
            host, window = self._host(buffer.tenant), self.opener.window
            copies, arrived = [], []
            for i, (block, slot) in enumerate(zip(blocks, slots, strict=True)):
                if slot is None:
                    continue
                if slot.size_bytes != block.size_bytes:
                    raise InvalidArgument(
                        f"block {i} is stored as {slot.size_bytes} bytes, but "
                        f"{block.size_bytes} were asked for: nothing was copied"
                    )
                engine = window(buffer.memory, block.offset_bytes, block.size_bytes)
                copies.append((engine, window(host, slot.offset, block.size_bytes)))
                arrived.append((block, engine))
            if copies:
                upload = self.mover.submit("h2d", copies)
                transfers.append(upload)
                promote = self._promote(ns_id, arrived, upload)
                if promote is not None:
                    transfers.append(promote)
                for transfer in transfers:
                    await self.mover.until_done(transfer)
        finally:
            for transfer in transfers:  # the lease's slots may be reused once released
                if not transfer.reaped:
                    self.mover.wait(transfer)
            if lease_id:
                self.store.release(session_id, [lease_id])
        return [slot.tier if slot is not None else None for slot in slots]

    def _promote(
        self, ns_id: str, arrived: list[tuple[CudaBlock, Any]], upload: Transfer
    ) -> Transfer | None:
        """Copy blocks that just reached the engine into HBM too (after `upload`, on the
        device), so their next read is device to device."""
        hbm = self.hbm
        if hbm is None:
            return None
        copies, promoted = [], []
        for block, engine in arrived:
            entry = self.store.stat((ns_id, block.key))
            if entry is None or entry.size_bytes != block.size_bytes:
                continue
            copy = hbm.reserve((ns_id, block.key), entry.generation, self.store.block_info(entry))
            if copy is None:
                continue
            copy.pins += 1
            promoted.append(copy)
            copies.append(
                (self.opener.window(hbm.memory, copy.extent.offset, copy.size_bytes), engine)
            )
        if not copies:
            return None

        def ready() -> None:
            for c in promoted:
                c.pins -= 1
            hbm.promotions += len(promoted)

        try:
            return self.mover.submit("d2d", copies, after=[upload], on_done=ready)
        except BaseException:
            for copy in promoted:  # never submitted: nothing writes into them
                hbm.forget(copy)
            raise


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class TorchOpener:
    """Real CUDA: cupy opens the IPC handle, torch views the memory (DLPack)."""

    def __init__(self) -> None:
        import cupy
        import torch

        self._cupy: Any = cupy
        self._torch: Any = torch

    def open(
        self, device: int, handle: bytes, offset: int, size: int
    ) -> tuple[Any, Callable[[], None]]:
        cupy = self._cupy
        with cupy.cuda.Device(device):
            base = cupy.cuda.runtime.ipcOpenMemHandle(handle)
            memory = cupy.cuda.UnownedMemory(base + offset, size, None, device)
            array = cupy.ndarray(
                (size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0)
            )
        tensor = self._torch.from_dlpack(array)

        def close() -> None:
            with cupy.cuda.Device(device):
                cupy.cuda.runtime.ipcCloseMemHandle(base)

        return tensor, close

    def host(self, arena: DramTier) -> Any:
        return self._torch.frombuffer(arena.whole, dtype=self._torch.uint8)

    def alloc(self, device: int, size: int) -> Any:
        return self._torch.empty(size, dtype=self._torch.uint8, device=f"cuda:{device}")

    def window(self, buffer: Any, offset: int, size: int) -> Any:
        return buffer[offset : offset + size]


class EmulatedOpener:
    """`gpu.emulate`: a handle is the UTF-8 path of a shared-memory file standing in for
    the engine's GPU memory (tests and demos on machines without a GPU)."""

    def open(
        self, device: int, handle: bytes, offset: int, size: int
    ) -> tuple[Any, Callable[[], None]]:
        fd = os.open(handle.decode(), os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, offset + size)
        finally:
            os.close(fd)
        view = memoryview(mapping)[offset : offset + size]

        def close() -> None:
            view.release()
            mapping.close()

        return view, close

    def host(self, arena: DramTier) -> Any:
        return arena.whole

    def alloc(self, device: int, size: int) -> Any:
        return memoryview(bytearray(size))

    def window(self, buffer: Any, offset: int, size: int) -> Any:
        return buffer[offset : offset + size]
