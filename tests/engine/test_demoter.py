"""The demoter (kvtier/engine/demoter.py): its watermark arithmetic as properties, and the
store under a put stream through a tiny arena — batches, not one job per block, ahead of
the puts; every byte back; damaged DRAM bytes never written."""

from __future__ import annotations

import asyncio
import itertools
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.config import Config
from kvtier.engine import nvme as nvme_engine
from kvtier.engine.demoter import Watermarks, claim_bytes, coalesced, watermarks
from kvtier.engine.store import Store
from kvtier.tiers.allocator import ExtentAllocator
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.segments import SegmentTier
from kvtier.types import Extent
from tests.conftest import block_bytes
from tests.engine.test_store import NS, get, make_config, put

sizes = st.integers(min_value=0, max_value=1 << 40)


@given(st.integers(min_value=1 << 20, max_value=1 << 40), st.floats(0, 0.5))
def test_watermarks_stay_inside_the_arena_and_leave_a_gap(capacity: int, fraction: float) -> None:
    marks = watermarks(capacity, fraction)
    assert 0 <= marks.low_bytes <= marks.high_bytes <= capacity
    assert marks.high_bytes == min(capacity, 2 * marks.low_bytes)


@given(sizes, sizes, sizes, sizes, sizes)
def test_claims_reach_the_high_mark_from_a_step_below_it(
    low: int, gap: int, free: int, claimed: int, wanted: int
) -> None:
    marks = Watermarks(low, low + gap)
    need = claim_bytes(marks, free, claimed, wanted)
    coming = free + claimed
    assert need >= 0
    # The start is a half-gap step below the high mark: never below the low one.
    assert marks.low_bytes <= marks.start_bytes <= marks.high_bytes
    assert marks.high_bytes - marks.start_bytes == marks.step_bytes == gap // 2
    if coming < low + gap - gap // 2:  # below the start: up to the high mark (or wanted)
        assert coming + need == max(low + gap, wanted)
    elif wanted <= coming:  # above it and nobody waiting: nothing
        assert need == 0
    else:  # a reservation lacks room that is not coming: exactly that
        assert coming + need == wanted


@given(sizes, sizes, sizes)
def test_a_batch_in_flight_does_not_stop_the_next_claim(low: int, gap: int, used: int) -> None:
    """The stream's case: a step-sized batch is in flight (claimed) and the puts have used
    `used` bytes of the free space since. Past a step, the next batch is claimed even while
    the one in flight would bring the arena back over the low mark (claiming only below the
    low mark kept one batch in flight and the puts waiting for it)."""
    marks = Watermarks(low, low + gap)
    claimed = marks.step_bytes
    free = marks.high_bytes - claimed - used
    if free < 0:
        return
    need = claim_bytes(marks, free, claimed, 0)
    if used > marks.step_bytes:
        assert need == used  # back up to the high mark
    else:
        assert need == 0
    if marks.step_bytes < used <= gap:
        assert free + claimed >= low  # where the old rule claimed nothing


@given(
    st.lists(
        st.tuples(st.integers(0, 63), st.integers(1, 4)), unique_by=lambda t: t[0], max_size=40
    )
)
def test_coalesced_extents_cover_the_same_bytes_and_free_the_same(
    picks: list[tuple[int, int]],
) -> None:
    """Runs of neighbours become one extent; freeing the runs leaves the allocator's free
    list exactly as freeing each extent does."""
    page = 4096
    # Disjoint extents: each pick is a start page, taken only if its pages are untaken.
    taken: set[int] = set()
    extents = []
    for start, pages in picks:
        span = set(range(start, start + pages))
        if span & taken or start + pages > 64:
            continue
        taken |= span
        extents.append(Extent(start * page, pages * page))
    runs = coalesced(extents)
    covered = sorted(
        p for e in runs for p in range(e.offset // page, (e.offset + e.size_bytes) // page)
    )
    assert covered == sorted(taken)
    assert all(a.offset + a.size_bytes < b.offset for a, b in itertools.pairwise(runs))
    one_by_one, by_runs = ExtentAllocator(64 * page), ExtentAllocator(64 * page)
    for allocator in (one_by_one, by_runs):
        for e in [Extent(p * page, page) for p in range(64)]:
            assert allocator.allocate(page) == e  # the whole arena in use, page by page
        for p in set(range(64)) - taken:
            allocator.free(Extent(p * page, page))
    for e in extents:
        one_by_one.free(e)
    for e in runs:
        by_runs.free(e)
    assert by_runs.free_extents() == one_by_one.free_extents()
    assert by_runs.used_bytes == one_by_one.used_bytes


def config(tmp_path: Path, dram: int, fraction: float, layout: str = "files") -> Config:
    base = make_config(tmp_path, dram, 256 << 20, layout=layout)
    return base.model_copy(
        update={"dram": base.dram.model_copy(update={"demote_free_fraction": fraction})}
    )


@pytest.mark.parametrize("layout", ["files", "segments"])
async def test_a_put_stream_is_demoted_in_batches_and_comes_back_exact(
    tmp_path: Path, layout: str
) -> None:
    store = Store(config(tmp_path, 4 << 20, 0.25, layout))
    await store.start()
    blocks = {f"s{i}".encode(): block_bytes(i, 64 << 10) for i in range(400)}  # 25 MiB
    for key, data in blocks.items():
        await put(store, key, data)  # none fails: NVMe has room
    await store.tasks.drain()
    stats = store.stats()
    nvme = next(t for t in stats.tiers if t.name == "nvme")
    # 25 MiB through 4 MiB: all but what DRAM still holds reached NVMe, by demotion.
    assert stats.demotions >= 400 - 64 and nvme.blocks == stats.demotions
    assert stats.dropped_blocks == 0 and stats.checksum_failures == 0
    # In batches: a 1 MiB gap between the watermarks is 16 blocks a batch, not 1.
    assert store.demoter.batches_written * 4 <= stats.demotions
    # Ahead of the puts: the arena is kept below its low watermark's worth of use.
    arena = store.arena("default")
    assert arena.capacity_bytes - arena.used_bytes >= (1 << 20) - (64 << 10)
    for key, data in blocks.items():
        assert await get(store, key) == data
    await store.close()
    again = Store(config(tmp_path, 4 << 20, 0.25, layout))
    await again.start()
    back = [await get(again, key) == data for key, data in blocks.items()]
    assert sum(back) >= stats.demotions  # every demoted block survives a restart
    await again.close()


async def test_without_a_watermark_only_a_put_that_needs_room_demotes(tmp_path: Path) -> None:
    store = Store(config(tmp_path, 4 << 20, 0.0))
    await store.start()
    for i in range(4):  # exactly fills the arena: nothing demoted ahead
        await put(store, f"f{i}".encode(), block_bytes(i, 1 << 20))
    await store.tasks.drain()
    assert store.stats().demotions == 0
    await put(store, b"more", block_bytes(9, 1 << 20))
    await store.tasks.drain()
    assert store.stats().demotions == 1
    assert (await store.lookup(NS, [b"f0", b"more"])).tiers == ["nvme", "dram"]
    await store.close()


async def test_a_block_damaged_in_dram_is_never_written_and_becomes_a_miss(
    tmp_path: Path,
) -> None:
    store = Store(config(tmp_path, 4 << 20, 0.0))
    await store.start()
    await put(store, b"hurt", block_bytes(1, 1 << 20))
    entry = store.stat((NS, b"hurt"))
    assert entry is not None and entry.dram_extent is not None
    view = store.arena("default").view(entry.dram_extent)
    view[100] ^= 0xFF  # a bit flip in DRAM after the commit
    view.release()
    for i in range(4):  # the oldest, the damaged one, is the first victim
        await put(store, f"n{i}".encode(), block_bytes(10 + i, 1 << 20))
    await store.tasks.drain()
    stats = store.stats()
    assert stats.checksum_failures == 1
    assert await get(store, b"hurt") is None
    assert not any(h.key == b"hurt" for h in _records(store))
    assert await get(store, b"n0") == block_bytes(10, 1 << 20)
    await store.close()


def _records(store: Store) -> list[object]:
    assert store.nvme is not None
    tier = store.nvme.tier
    if isinstance(tier, SegmentTier):
        return [h for _, _, h in tier.record_locations()]
    headers = []
    for path in (tier.root / "v1").rglob("*.kvr"):
        headers.append(tier._read_header(path))
    return headers


async def test_a_put_waits_for_a_batch_in_flight_and_never_writes_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(config(tmp_path, 2 << 20, 0.0))
    await store.start()
    release, entered = threading.Event(), threading.Event()
    writers: set[str] = set()
    real = NvmeTier.write_many

    def slow(self: NvmeTier, headers: object, payloads: object) -> object:
        writers.add(threading.current_thread().name)
        entered.set()
        release.wait(10)
        return real(self, headers, payloads)  # type: ignore[arg-type]

    monkeypatch.setattr(NvmeTier, "write_many", slow)
    checked_on: set[str] = set()
    real_check = nvme_engine.digests

    def check(payloads: object, nbytes: object) -> list[int]:
        checked_on.add(threading.current_thread().name)
        return real_check(payloads, nbytes)  # type: ignore[arg-type]

    monkeypatch.setattr(nvme_engine, "digests", check)
    await put(store, b"a", block_bytes(1, 1 << 20))
    await put(store, b"b", block_bytes(2, 1 << 20))
    third = asyncio.ensure_future(put(store, b"c", block_bytes(3, 1 << 20)))
    assert await asyncio.to_thread(entered.wait, 10)
    await asyncio.sleep(0.05)
    assert not third.done()  # DRAM is full of a block being written: the put waits
    release.set()
    await asyncio.wait_for(third, 10)
    # The bytes were checked and written on I/O threads, not on the event loop.
    assert writers and all(name.startswith("kvtier-io") for name in writers)
    assert checked_on and all(name.startswith("kvtier-io") for name in checked_on)
    assert [await get(store, k) for k in (b"a", b"b", b"c")] == [
        block_bytes(i, 1 << 20) for i in (1, 2, 3)
    ]
    await store.close()


async def test_flush_waits_for_the_demotions_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A demotion batch's victims are on neither list while it writes: a flush that wrote
    # only the DRAM-only blocks returned with them not yet on NVMe (the daemon's stop).
    store = Store(config(tmp_path, 4 << 20, 0.25))
    await store.start()
    entered, release = threading.Event(), threading.Event()
    real = NvmeTier.write_many

    def slow(self: NvmeTier, headers: object, payloads: object) -> object:
        if not entered.is_set():  # the first batch only: the flush's own writes go at once
            entered.set()
            release.wait(10)
        return real(self, headers, payloads)  # type: ignore[arg-type]

    monkeypatch.setattr(NvmeTier, "write_many", slow)
    # 3.25 MiB into 4 MiB: past the low mark (a batch claimed), no put waits for room.
    blocks = {f"w{i}".encode(): block_bytes(i, 256 << 10) for i in range(13)}
    for key, data in blocks.items():
        await put(store, key, data)
    assert await asyncio.to_thread(entered.wait, 10)
    assert any(store.demoter._batches.values())  # a batch is being written now
    flushing = asyncio.ensure_future(store.flush())
    await asyncio.sleep(0.05)
    assert not flushing.done()  # it waits for the batch, which waits for the disk
    release.set()
    await asyncio.wait_for(flushing, 10)
    assert not any(store.demoter._batches.values())
    for key in blocks:  # every block has its record now, as the daemon's stop expects
        entry = store.stat((NS, key))
        assert entry is not None and entry.nvme_record_bytes
    await store.close()


@pytest.mark.parametrize("layout", ["files", "segments"])
async def test_a_flush_across_tenants_writes_each_block_from_its_own_arena(
    tmp_path: Path, layout: str
) -> None:
    """A demotion batch is one arena's victims, but a flush's batches span tenants: a block
    written from another tenant's arena (same offset, other bytes) would fail its
    checksum and be lost at the restart."""
    cfg = Config.model_validate(
        {
            "server": {"listen": f"unix://{tmp_path}/s.sock"},
            "dram": {"capacity_bytes": 2 << 20, "prefault": False},
            "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 64 << 20, "layout": layout},
            "tenants": {
                "alice": {"dram_capacity_bytes": "2MiB"},
                "bob": {"dram_capacity_bytes": "2MiB"},
            },
        }
    )
    blocks = {
        (f"{tenant}|m/l", f"k{i}".encode()): block_bytes(i + 100 * n, 64 << 10)
        for n, tenant in enumerate(("alice", "bob"))
        for i in range(8)
    }
    store = Store(cfg)
    await store.start()
    for block_id, data in blocks.items():  # both arenas fill from offset 0 alike
        writer = await store.put_begin(block_id, len(data), False)
        try:
            writer.write(data)
            await store.put_commit(writer, 0)
        finally:
            store.put_abort(writer)
    assert await store.flush() == len(blocks)  # one flush batch holds both tenants' blocks
    await store.close()
    store = Store(cfg)
    await store.start()
    try:
        for block_id, data in blocks.items():
            reader = await store.open_block(block_id)
            assert reader is not None, f"{block_id} lost after the flush and restart"
            try:
                assert b"".join(bytes(c) for c in reader.chunks(1 << 20)) == data
            finally:
                reader.close()
    finally:
        await store.close()
