"""The GPU path in-process on the fake device, where the test decides when copies run:
a call cancelled, or a session ended, while its copies are in flight."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.cuda_path import CudaBlock, CudaPath, EmulatedOpener
from kvtier.engine.store import Store
from kvtier.errors import NotFound
from kvtier.movers.cuda import Mover
from kvtier.movers.fake import FakeDevice
from tests.engine.test_store import NS, get, make_config

BLOCK = 64 << 10


class MemoryOpener(EmulatedOpener):
    """Engine memory is a bytearray; closing it is recorded."""

    def __init__(self, memory: bytearray) -> None:
        self.memory = memory
        self.closed = False

    def open(self, device: int, handle: bytes, offset: int, size: int) -> tuple[Any, Any]:
        def close() -> None:
            self.closed = True

        return memoryview(self.memory)[offset : offset + size], close


@asynccontextmanager
async def _gpu_path(
    tmp_path: Path, seed: int, blocks: int
) -> AsyncIterator[tuple[Store, FakeDevice, bytearray, MemoryOpener, CudaPath]]:
    """A store, a device whose copies run only when drained, and `blocks` of engine memory."""
    store = Store(make_config(tmp_path, 8 << 20, 64 << 20))
    await store.start()
    device = FakeDevice(seed=seed, max_steps_per_query=0)
    engine = bytearray(os.urandom(blocks * BLOCK))
    opener = MemoryOpener(engine)
    try:
        yield store, device, engine, opener, CudaPath(store, Mover(device), opener, 0)
    finally:
        await store.close()


async def test_a_cancelled_put_still_commits_after_its_copies_and_the_mapping_outlives_them(
    tmp_path: Path,
) -> None:
    async with _gpu_path(tmp_path, seed=1, blocks=4) as (store, device, engine, opener, path):
        buffer_id = path.register(7, "default", 0, b"h", 0, len(engine))
        blocks = [CudaBlock(f"k{i}".encode(), i * BLOCK, BLOCK) for i in range(4)]
        call = asyncio.ensure_future(path.put(7, NS, buffer_id, blocks, False))
        await asyncio.sleep(0.05)  # reserved and submitted, copies not run
        call.cancel()  # the client went away
        path.end_session(7)  # and its session with it
        await asyncio.sleep(0.05)
        assert not opener.closed  # copies still read the engine's memory
        for b in blocks:
            assert await get(store, b.key) is None  # nothing visible before the copies ran
        device.drain()
        await path.close()  # waits for the call to finish its work
        assert opener.closed
        for i, b in enumerate(blocks):
            assert await get(store, b.key) == bytes(engine[i * BLOCK : (i + 1) * BLOCK])
        assert device.violations == []


async def test_a_grouped_get_outlives_its_session_until_its_copies_ran(tmp_path: Path) -> None:
    """The engine's session ends with both groups' copies submitted and not run: the
    groups can no longer be waited for, but the mapping stays open and the leases held
    until the device has run them; then every byte is where it was asked to go."""
    async with _gpu_path(tmp_path, seed=2, blocks=8) as (store, device, engine, opener, path):
        buffer_id = path.register(7, "default", 0, b"h", 0, len(engine))
        stored = [CudaBlock(f"k{i}".encode(), i * BLOCK, BLOCK) for i in range(4)]
        put = asyncio.ensure_future(path.put(7, NS, buffer_id, stored, False))
        await asyncio.sleep(0.05)
        device.drain()
        assert all(o.stored for o in await put)
        expected = bytes(engine[: 4 * BLOCK])
        wanted = [CudaBlock(b.key, (4 + i) * BLOCK, BLOCK) for i, b in enumerate(stored)]
        request_id = path.start_get(7, NS, buffer_id, wanted, [1, 3])
        await asyncio.sleep(0.05)  # both groups leased and submitted
        assert store.stats().leases == 2
        path.end_session(7)
        with pytest.raises(NotFound, match="no group 0"):
            await asyncio.wait_for(path.wait(7, request_id, 0), 5)
        assert not opener.closed
        device.drain()
        await path.close()
        assert opener.closed and store.stats().leases == 0
        assert bytes(engine[4 * BLOCK :]) == expected
        assert device.violations == []
