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

Registrations end with their session (the engine's side connection closing), and the
IPC mappings are closed then. The engine must keep the registered tensor allocated while
it is registered: the daemon maps the allocation, not a reference to the tensor.

`CudaOpener` is what touches CUDA: `TorchOpener` opens handles with cupy (torch has no
public call for it) and views memory as torch tensors; `EmulatedOpener` (`gpu.emulate`)
treats a "handle" as the path of a shared-memory file and runs on `FakeDevice`, so the
whole path is tested end to end on machines without a GPU.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.errors import InvalidArgument, ResourceExhausted
from kvtier.index.catalog import BlockId, TierName
from kvtier.movers.cuda import Mover
from kvtier.server.store import CommitOutcome

if TYPE_CHECKING:
    from kvtier.server.store import Store
    from kvtier.tiers.dram import DramTier

MAX_BUFFERS_PER_SESSION = 64


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


@dataclass(eq=False)
class EngineBuffer:
    buffer_id: int
    session_id: int
    tenant: str
    size_bytes: int
    memory: Any
    close: Callable[[], None]


@dataclass(frozen=True, slots=True)
class CudaBlock:
    key: bytes
    offset_bytes: int
    size_bytes: int


class CudaPath:
    """Registrations and copies for one daemon (one GPU); used from the event loop."""

    def __init__(self, store: Store, mover: Mover, opener: CudaOpener, device: int) -> None:
        self.store = store
        self.mover = mover
        self.opener = opener
        self.device = device
        self._buffers: dict[int, EngineBuffer] = {}
        self._next_id = 1
        self._hosts: dict[str, Any] = {}  # tenant -> buffer over its arena

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
        for buffer_id in [i for i, b in self._buffers.items() if b.session_id == session_id]:
            self._buffers.pop(buffer_id).close()

    def close(self) -> None:
        for buffer in self._buffers.values():
            buffer.close()
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
        items: list[tuple[BlockId, int]] = [((ns_id, b.key), b.size_bytes) for b in blocks]
        lease_id, slots = await self.store.reserve(session_id, items, overwrite)
        host, window = self._host(buffer.tenant), self.opener.window
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
            await self.store.commit(session_id, lease_id, [], abort=True)
            raise
        return await self.store.commit(session_id, lease_id, [], abort=False)

    async def get(
        self, session_id: int, ns_id: str, buffer_id: int, blocks: list[CudaBlock]
    ) -> list[TierName | None]:
        """Copy cached blocks into the engine's memory (arena -> device); per block the
        tier it was found in, or None for a miss (its range is left as it was)."""
        buffer = self._buffer(session_id, buffer_id, blocks)
        lease_id, slots = await self.store.acquire(session_id, [(ns_id, b.key) for b in blocks])
        try:
            host, window = self._host(buffer.tenant), self.opener.window
            copies = []
            for i, (block, slot) in enumerate(zip(blocks, slots, strict=True)):
                if slot is None:
                    continue
                if slot.size_bytes != block.size_bytes:
                    raise InvalidArgument(
                        f"block {i} is stored as {slot.size_bytes} bytes, but "
                        f"{block.size_bytes} were asked for: nothing was copied"
                    )
                copies.append(
                    (
                        window(buffer.memory, block.offset_bytes, block.size_bytes),
                        window(host, slot.offset, block.size_bytes),
                    )
                )
            if copies:
                await self.mover.until_done(self.mover.submit("h2d", copies))
        finally:
            if lease_id:
                self.store.release(session_id, [lease_id])
        return [slot.tier if slot is not None else None for slot in slots]


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

    def window(self, buffer: Any, offset: int, size: int) -> Any:
        return buffer[offset : offset + size]
