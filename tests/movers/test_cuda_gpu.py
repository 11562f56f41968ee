"""The movers and the pinned arena on a real GPU (marked gpu: skipped without CUDA; run by
scripts/gpu_check.sh). The same logic runs on the fake device in test_cuda_movers.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvtier.movers.cuda import Mover, StagedUpload, TorchDevice
from kvtier.movers.io import IoPool
from kvtier.movers.pinned import pin, unregister
from kvtier.tiers.dram import DramTier
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for

pytestmark = pytest.mark.gpu


def _torch() -> Any:
    import torch

    return torch


def test_h2d_d2h_d2d_round_trip_exact_bytes_through_the_pinned_arena() -> None:
    torch = _torch()
    arena = DramTier(64 << 20, prefault=False)
    pin(arena.address, arena.capacity_bytes, threads=4)
    try:
        host = torch.frombuffer(memoryview(arena._map), dtype=torch.uint8)
        assert host.is_pinned()  # registered: copies go straight, no bounce buffer
        host[: 32 << 20] = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8)
        mover = Mover(TorchDevice(0))
        on_gpu = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        copy = torch.empty_like(on_gpu)
        up = mover.submit("h2d", [(on_gpu, host[: 32 << 20])])
        across = mover.submit("d2d", [(copy, on_gpu)], after=[up])
        down = mover.submit("d2h", [(host[32 << 20 :], copy)], after=[across])
        mover.wait(down)
        mover.poll()
        assert mover.in_flight == 0
        assert torch.equal(host[: 32 << 20], host[32 << 20 :])
        del host
    finally:
        unregister(arena.address)
        arena.close()


def test_nvme_records_stream_into_gpu_memory_bit_exact(tmp_path: Path) -> None:
    torch = _torch()
    tier = NvmeTier(tmp_path, 1 << 30, direct_io=True, sync_writes=False)
    tier.open()
    size, blocks = 4 << 20, 12
    headers = []
    for i in range(blocks):
        payload = bytearray(os.urandom(size))
        header = RecordHeader(
            "default|gpu", f"b{i}".encode(), i + 1, size, xxhash.xxh3_64_intdigest(payload),
            header_size_for("default|gpu", f"b{i}".encode()),
        )  # fmt: skip
        tier.write(header, [memoryview(payload)])
        headers.append((header, payload))
    staging = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(3)]
    dest = torch.empty((blocks, size), dtype=torch.uint8, device="cuda")
    io = IoPool(4)

    def read(i: int, buf: Any) -> Any:
        tier.read_into(headers[i][0], memoryview(buf.numpy()))
        return buf

    try:
        asyncio.run(StagedUpload(Mover(TorchDevice(0)), staging, io.run).run(read, list(dest)))
        for i, (_, payload) in enumerate(headers):
            assert bytes(dest[i].cpu().numpy()) == bytes(payload)
    finally:
        io.close()
        tier.close()
