"""The CUDA movers' ordering and buffer lifetimes, on a fake device whose streams run in a
random interleaving (kvtier/movers/fake.py); the same code on a real GPU is in
tests/movers/test_cuda_gpu.py (marked gpu)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.movers.cuda import Mover, StagedUpload
from kvtier.movers.fake import FakeDevice


def test_a_transfer_is_done_only_when_its_copies_ran_and_frees_nothing_before() -> None:
    device = FakeDevice(seed=1, max_steps_per_query=0)  # nothing runs unless we say so
    mover = Mover(device)
    src, dst = bytearray(os.urandom(64)), bytearray(64)
    freed: list[str] = []
    transfer = mover.submit("h2d", [(dst, src)], on_done=lambda: freed.append("src"))
    assert not transfer.done() and mover.poll() == 0
    assert freed == [] and src in transfer.keep  # still held: a copy may touch it
    device.drain()
    assert mover.poll() == 1
    assert dst == src and freed == ["src"] and transfer.keep == []
    assert device.violations == []


def test_wait_is_the_one_call_that_synchronises() -> None:
    device = FakeDevice(seed=2, max_steps_per_query=0)
    mover = Mover(device)
    src, dst = bytearray(b"x" * 32), bytearray(32)
    transfer = mover.submit("d2h", [(dst, src)])
    mover.wait(transfer)
    assert transfer.reaped and dst == src and mover.in_flight == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), chains=st.integers(1, 6))
def test_a_transfer_after_another_never_runs_before_it_on_any_interleaving(
    seed: int, chains: int
) -> None:
    device = FakeDevice(seed=seed, max_steps_per_query=3)
    mover = Mover(device, streams_per_direction=3)
    bufs = [bytearray(os.urandom(16)) for _ in range(chains + 1)]
    transfers = []
    previous: list[Any] = []
    for i in range(chains):
        # Each step copies what the previous step wrote: wrong order = wrong bytes.
        direction = ("h2d", "d2d", "d2h")[i % 3]
        t = mover.submit(direction, [(bufs[i + 1], bufs[i])], after=previous)  # type: ignore[arg-type]
        transfers.append(t)
        previous = [t]
    expected = bytes(bufs[0])
    while mover.in_flight:
        device.step()
        mover.poll()
    # The fake snapshots each source at enqueue: order is proven by the bytes arriving
    # unchanged only if each copy ran after the one before it finished writing.
    copies = [entry for entry in device.log if entry[0] == "copy"]
    assert [c[1] for c in copies] == [id(b) for b in bufs[1:]]
    assert bytes(bufs[-1]) == expected


def test_events_are_reused_only_after_their_transfer_is_reaped() -> None:
    device = FakeDevice(seed=3, max_steps_per_query=0)
    mover = Mover(device)
    for _ in range(10):
        transfer = mover.submit("h2d", [(bytearray(8), bytearray(8))])
        mover.wait(transfer)
    assert mover.events_created == 2  # one start/end pair, recycled
    held = [mover.submit("h2d", [(bytearray(8), bytearray(8))]) for _ in range(3)]
    assert mover.events_created == 6  # none free while three transfers are in flight
    device.drain()
    assert mover.poll() == len(held)


def _io_pool() -> Any:
    async def run_io(fn: Any, *args: Any) -> Any:
        await asyncio.sleep(0)  # the disk read happens elsewhere; the loop goes on
        return fn(*args)

    return run_io


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), slots=st.integers(2, 4), blocks=st.integers(1, 12))
def test_staged_upload_delivers_every_block_exactly_on_any_interleaving(
    seed: int, slots: int, blocks: int
) -> None:
    device = FakeDevice(seed=seed, max_steps_per_query=2)
    mover = Mover(device)
    data = [os.urandom(256) for _ in range(blocks)]
    staging = [bytearray(256) for _ in range(slots)]
    dests = [bytearray(256) for _ in range(blocks)]
    reads: list[int] = []

    def read(i: int, buf: bytearray) -> bytearray:
        reads.append(i)
        buf[:] = data[i]  # a disk read into a staging buffer
        return buf

    asyncio.run(StagedUpload(mover, staging, _io_pool()).run(read, dests))
    assert [bytes(d) for d in dests] == data
    assert device.violations == []  # no staging buffer refilled under an in-flight copy
    assert mover.in_flight == 0 and reads == list(range(blocks))


def test_the_fake_catches_a_pipeline_that_reuses_staging_too_early() -> None:
    """The check above can fail: a pipeline that refills a staging buffer as soon as its
    copy is enqueued (not reaped) corrupts blocks, and the fake reports it."""
    device = FakeDevice(seed=5, max_steps_per_query=0)
    mover = Mover(device)
    staging = [bytearray(64), bytearray(64)]
    dests = [bytearray(64) for _ in range(6)]
    for i, dst in enumerate(dests):
        buf = staging[i % 2]
        buf[:] = bytes([i]) * 64
        mover.submit("h2d", [(dst, buf)])  # wrong: buf is refilled two blocks later
    device.drain()
    assert device.violations


def test_the_read_of_the_next_block_overlaps_the_copy_of_this_one() -> None:
    """Pipelining: with a device slower than the disk, block i+1 is read before block i's
    copy has run (an upload that waited for each copy before the next read fails this)."""
    device = FakeDevice(seed=7, max_steps_per_query=1)
    mover = Mover(device)
    dests = [bytearray(32) for _ in range(6)]

    def read(i: int, buf: bytearray) -> bytearray:
        device.log.append(("read", i))
        buf[:] = bytes([i]) * 32
        return buf

    asyncio.run(StagedUpload(mover, [bytearray(32) for _ in range(3)], _io_pool()).run(read, dests))
    assert all(bytes(d) == bytes([i]) * 32 for i, d in enumerate(dests))
    assert device.violations == []
    read_at = {e[1]: n for n, e in enumerate(device.log) if e[0] == "read"}
    ids = [id(d) for d in dests]
    copied_at = {ids.index(e[1]): n for n, e in enumerate(device.log) if e[0] == "copy"}
    assert any(read_at[i + 1] < copied_at[i] for i in range(5)), device.log
    with pytest.raises(ValueError):
        StagedUpload(mover, [bytearray(8)], _io_pool())
