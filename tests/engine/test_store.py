"""The store in-process: eviction, demotion, pins and failures against a model of what was put."""

from __future__ import annotations

import asyncio
import errno
import os
import random
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import Config
from kvtier.engine.store import Store
from kvtier.errors import ResourceExhausted
from kvtier.tiers.nvme import NvmeTier
from kvtier.types import BlockId
from tests.conftest import block_bytes

NS = "default|m/l"


def make_config(tmp_path: Path, dram: int, nvme: int, **nvme_extra: object) -> Config:
    return Config.model_validate(
        {
            "server": {"listen": f"unix://{tmp_path}/s.sock"},
            "limits": {"reserve_wait_s": 0.5},
            "dram": {"capacity_bytes": dram, "prefault": False},
            "nvme": {
                "path": str(tmp_path / "nvme"),
                "capacity_bytes": nvme,
                "io_threads": 3,
                **nvme_extra,
            },
        }
    )


async def put(store: Store, key: bytes, data: bytes, overwrite: bool = False) -> None:
    writer = await store.put_begin((NS, key), len(data), overwrite)
    try:
        for start in range(0, len(data), 1 << 20):
            writer.write(data[start : start + (1 << 20)])
        await store.put_commit(writer, 0)
    finally:
        store.put_abort(writer)


async def get(store: Store, key: bytes) -> bytes | None:
    reader = await store.open_block((NS, key))
    if reader is None:
        return None
    try:
        return b"".join(bytes(c) for c in reader.chunks(1 << 20))
    finally:
        reader.close()


@pytest.mark.parametrize("seed", range(4))
async def test_random_operations_match_a_model(tmp_path: Path, seed: int) -> None:
    store = Store(make_config(tmp_path, 4 << 20, 64 << 20))
    await store.start()
    rng = random.Random(seed)
    model: dict[bytes, bytes] = {}
    for step in range(300):
        key = f"k{rng.randrange(40)}".encode()
        op = rng.random()
        if op < 0.45:
            data = block_bytes(step, rng.choice([1, 4096, 70_000, 1 << 20, 1_500_000]))
            await put(store, key, data, overwrite=True)
            model[key] = data
        elif op < 0.85:
            assert await get(store, key) == model.get(key)
        else:
            assert await store.delete((NS, key)) == (key in model)
            model.pop(key, None)
        assert store.arena("default").used_bytes <= store.arena("default").capacity_bytes
        assert store.residency.catalog.nvme_used_bytes <= 64 << 20
    for key, data in model.items():
        assert await get(store, key) == data
    await store.close()
    # Everything on disk after a restart is exactly what the model holds (or absent).
    again = Store(make_config(tmp_path, 4 << 20, 64 << 20))
    await again.start()
    for entry in list(again.residency.catalog.entries()):
        key = entry.block_id[1]
        assert await get(again, key) == model[key]
    await again.close()


async def put_deferred(store: Store, key: bytes, data: bytes, armed: bool = True) -> None:
    """A put whose cataloguing may wait past its reply, where the transport arms it (as
    the session socket does)."""
    writer = await store.put_begin((NS, key), len(data), True)
    try:
        writer.write(data)
        store.afterwards.armed = armed
        try:
            await store.put_commit(writer, 0, defer=True)
        finally:
            store.afterwards.armed = False
    finally:
        store.put_abort(writer)


@pytest.mark.parametrize("seed", range(3))
async def test_puts_catalogued_after_their_replies_land_in_order(tmp_path: Path, seed: int) -> None:
    """A put deferred past its reply (kvtier/engine/afterwards.py) is catalogued when the
    transport runs the work; a put or a delete of a key with work due runs it first, so
    the last acknowledged write of each key wins, and nothing leaks."""
    store = Store(make_config(tmp_path, 4 << 20, 64 << 20))
    await store.start()
    rng = random.Random(seed)
    model: dict[bytes, bytes] = {}
    directory = store.directories.of("default")
    assert directory is not None
    for step in range(200):
        key = f"k{rng.randrange(8)}".encode()
        if rng.random() < 0.6:
            data = block_bytes(step, rng.choice([1, 4096, 70_000]))
            new = key not in model
            published = len(directory)
            await put_deferred(store, key, data)
            model[key] = data
            if new:
                assert store.stat((NS, key)) is None  # not yet: after the reply
                assert len(directory) == published + 1  # but direct reads find it now
            if rng.random() < 0.5:
                continue  # left due: a later put or delete of the key runs it first
        else:
            assert await store.delete((NS, key)) == (key in model)
            model.pop(key, None)
        store.afterwards.run()
        for k in {key, f"k{rng.randrange(8)}".encode()}:
            assert await get(store, k) == model.get(k)
    store.afterwards.run()
    for k in [f"k{i}".encode() for i in range(8)]:
        assert await get(store, k) == model.get(k)
    assert len(directory) == len(model)
    used = sum(a.used_bytes for a in store.arenas.values())
    assert used == sum(-(-len(d) // 4096) * 4096 or 4096 for d in model.values())
    await store.close()


async def test_a_deferred_put_is_published_once_and_stays_published(tmp_path: Path) -> None:
    """Published before its reply, a deferred put is not published again when it is
    catalogued (nothing ran on the loop between: the same copy), and stays readable."""
    store = Store(make_config(tmp_path, 4 << 20, 64 << 20))
    await store.start()
    directory = store.directories.of("default")
    assert directory is not None
    published: list[BlockId] = []
    publish = directory.publish

    def counted(block_id: BlockId, *args: Any, **kwargs: Any) -> bool:
        published.append(block_id)
        return publish(block_id, *args, **kwargs)

    directory.publish = counted  # type: ignore[method-assign]
    for i in range(3):
        await put_deferred(store, f"k{i}".encode(), block_bytes(i, 4096))
    assert published == [(NS, f"k{i}".encode()) for i in range(3)]
    store.afterwards.run()
    assert published == [(NS, f"k{i}".encode()) for i in range(3)]  # not twice
    assert len(directory) == 3
    await put_deferred(store, b"now", b"bytes", armed=False)  # catalogued at once: once
    assert published[3:] == [(NS, b"now")] and len(directory) == 4
    for i in range(3):
        assert await get(store, f"k{i}".encode()) == block_bytes(i, 4096)
    await store.close()


async def test_a_deferred_put_is_catalogued_at_once_unless_the_transport_armed_it(
    tmp_path: Path,
) -> None:
    store = Store(make_config(tmp_path, 4 << 20, 64 << 20))
    await store.start()
    await put_deferred(store, b"k", b"bytes", armed=False)  # no reply follows at once
    assert not store.afterwards
    assert await get(store, b"k") == b"bytes"
    await store.close()


async def test_concurrent_puts_into_a_tiny_arena_do_not_deadlock(tmp_path: Path) -> None:
    store = Store(make_config(tmp_path, 4 << 20, 256 << 20))
    await store.start()
    blocks = {f"c{i}".encode(): block_bytes(i, 1 << 20) for i in range(40)}
    await asyncio.wait_for(asyncio.gather(*(put(store, k, v) for k, v in blocks.items())), 60)
    for key, data in blocks.items():
        assert await get(store, key) == data
    await store.close()


async def test_a_pinned_block_is_never_evicted_or_reused(tmp_path: Path) -> None:
    store = Store(make_config(tmp_path, 4 << 20, 64 << 20))
    await store.start()
    await put(store, b"pinned", block_bytes(1, 1 << 20))
    reader = await store.open_block((NS, b"pinned"))
    assert reader is not None
    for i in range(12):  # 12 MiB through a 4 MiB arena while the reader holds its pin
        await put(store, f"f{i}".encode(), block_bytes(100 + i, 1 << 20))
    assert (await store.lookup(NS, [b"pinned"])).tiers == ["dram"]
    assert b"".join(bytes(c) for c in reader.chunks(65536)) == block_bytes(1, 1 << 20)
    # Deleting it while it is read: gone from lookups at once, memory freed at close.
    used = store.arena("default").used_bytes
    assert await store.delete((NS, b"pinned"))
    assert await get(store, b"pinned") is None
    assert store.arena("default").used_bytes == used
    reader.close()
    assert store.arena("default").used_bytes == used - (1 << 20)
    await store.close()


async def test_full_of_pinned_blocks_is_resource_exhausted(tmp_path: Path) -> None:
    store = Store(make_config(tmp_path, 2 << 20, 64 << 20))
    await store.start()
    readers = []
    for i in range(2):
        await put(store, f"p{i}".encode(), block_bytes(i, 1 << 20))
        reader = await store.open_block((NS, f"p{i}".encode()))
        assert reader is not None
        readers.append(reader)
    with pytest.raises(ResourceExhausted, match="retry later"):
        await put(store, b"more", block_bytes(9, 1 << 20))
    for reader in readers:
        reader.close()
    await put(store, b"more", block_bytes(9, 1 << 20))
    assert await get(store, b"more") == block_bytes(9, 1 << 20)
    await store.close()


async def test_disk_full_drops_blocks_but_never_corrupts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(make_config(tmp_path, 2 << 20, 64 << 20))
    await store.start()
    real_write = NvmeTier.write
    full = True

    def write(self: NvmeTier, header: object, payload: object) -> int:
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, header, payload)  # type: ignore[arg-type]

    monkeypatch.setattr(NvmeTier, "write", write)
    for i in range(6):
        await put(store, f"e{i}".encode(), block_bytes(i, 1 << 20))
    stats = store.stats()
    assert stats.dropped_blocks >= 4 and stats.demotions == 0
    for i in range(6):
        assert await get(store, f"e{i}".encode()) in (None, block_bytes(i, 1 << 20))
    assert await get(store, b"e5") == block_bytes(5, 1 << 20)
    full = False
    for i in range(6, 10):
        await put(store, f"e{i}".encode(), block_bytes(i, 1 << 20))
    assert store.stats().demotions >= 1
    assert not list((tmp_path / "nvme" / "tmp").iterdir())
    await store.close()


async def test_flush_writes_dram_only_blocks(tmp_path: Path) -> None:
    store = Store(make_config(tmp_path, 8 << 20, 64 << 20))
    await store.start()
    for i in range(5):
        await put(store, f"f{i}".encode(), block_bytes(i, 500_000))
    assert await store.flush() == 5
    assert await store.flush() == 0
    assert set((await store.lookup(NS, [f"f{i}".encode() for i in range(5)])).tiers) == {"dram"}
    await store.close()
    again = Store(make_config(tmp_path, 8 << 20, 64 << 20))
    await again.start()
    assert [await get(again, f"f{i}".encode()) for i in range(5)] == [
        block_bytes(i, 500_000) for i in range(5)
    ]
    await again.close()


async def test_without_nvme_blocks_are_dropped_lru(tmp_path: Path) -> None:
    store = Store(make_config(tmp_path, 2 << 20, 64 << 20, enabled=False))
    await store.start()
    for i in range(4):
        await put(store, f"n{i}".encode(), block_bytes(i, 1 << 20))
    assert await get(store, b"n0") is None
    assert await get(store, b"n3") == block_bytes(3, 1 << 20)
    assert [t.name for t in store.stats().tiers] == ["dram"]
    await store.close()


async def test_a_block_read_while_it_is_being_demoted_keeps_its_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    store = Store(make_config(tmp_path, 2 << 20, 64 << 20))
    await store.start()
    release, entered = threading.Event(), threading.Event()
    real_write = NvmeTier.write

    def slow_write(self: NvmeTier, header: object, payload: object) -> int:
        entered.set()
        release.wait(10)
        return real_write(self, header, payload)  # type: ignore[arg-type]

    monkeypatch.setattr(NvmeTier, "write", slow_write)
    await put(store, b"a", block_bytes(1, 1 << 20))
    await put(store, b"b", block_bytes(2, 1 << 20))
    third = asyncio.ensure_future(put(store, b"c", block_bytes(3, 1 << 20)))
    assert await asyncio.to_thread(entered.wait, 10)
    demoting = next(e for e in store.residency.catalog.entries() if e.demoting)
    reader = await store.open_block(demoting.block_id)  # pinned mid-demotion, from DRAM
    assert reader is not None and reader.tier.value == "dram"
    release.set()
    await asyncio.wait_for(third, 10)
    for i in range(4, 8):  # more traffic that would reuse a freed extent
        await put(store, f"x{i}".encode(), block_bytes(i, 1 << 20))
    seed = 1 if demoting.block_id[1] == b"a" else 2
    assert b"".join(bytes(c) for c in reader.chunks(1 << 20)) == block_bytes(seed, 1 << 20)
    reader.close()
    assert await get(store, demoting.block_id[1]) == block_bytes(seed, 1 << 20)
    assert store.arena("default").used_bytes <= store.arena("default").capacity_bytes
    await store.close()


async def test_a_planned_fetch_slower_than_recompute_is_regret(tmp_path: Path) -> None:
    store = Store(make_config(tmp_path, 2 << 20, 64 << 20))
    await store.start()
    for i in range(4):
        await put(store, f"g{i}".encode(), block_bytes(i, 1 << 20))
    assert (await store.lookup(NS, [b"g0"])).tiers == ["nvme"]
    result, _costs = await store.plan(NS, [b"g0"], 16, 16, 0, "none", 0)
    assert result.fetch_blocks in (0, 1)
    store.costs.planned[(NS, b"g0")] = 1e-9  # as if the plan had expected a near-free recompute
    assert await get(store, b"g0") == block_bytes(0, 1 << 20)
    stats = store.stats()
    assert stats.fetch_regret_s > 0 and stats.recompute_avoided_s == pytest.approx(1e-9)
    await store.close()


async def test_fetch_reports_fit_the_dram_path_and_bad_reports_are_ignored(
    tmp_path: Path,
) -> None:
    store = Store(make_config(tmp_path, 8 << 20, 64 << 20))
    await store.start()
    sizes = {b"a": 1 << 20, b"b": 256 << 10}
    for key, size in sizes.items():
        await put(store, key, block_bytes(size, size))
    seed = store.costs.paths["dram"].estimate()

    async def fetch(key: bytes, seconds: float, reported_bytes: int) -> None:
        lease_id, slots = await store.acquire(7, [(NS, key)])
        assert slots[0] is not None
        assert store.release(7, [lease_id], seconds, reported_bytes) == 1

    for key, size in sizes.items():
        for _ in range(10):
            await fetch(key, float("nan"), size)
            await fetch(key, -1.0, size)
            await fetch(key, 1e-3, 2 * size)  # more bytes than the lease served
    assert store.costs.paths["dram"].estimate() == seed
    latency_s, bandwidth = 50e-6, 5e9
    for _ in range(10):
        for key, size in sizes.items():
            await fetch(key, latency_s + size / bandwidth, size)
    fitted = store.costs.paths["dram"].estimate()
    assert fitted.latency_s == pytest.approx(latency_s, rel=1e-3)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-3)
    await store.close()


def _tenant_config(tmp_path: Path, noisy_nvme_quota: str) -> Config:
    return Config.model_validate(
        {
            "server": {"listen": f"unix://{tmp_path}/s.sock"},
            "dram": {"capacity_bytes": 2 << 20, "prefault": False},
            "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 16 << 20},
            "tenants": {
                "quiet": {"dram_capacity_bytes": "2MiB", "nvme_capacity_bytes": "6MiB"},
                "noisy": {"dram_capacity_bytes": "2MiB", "nvme_capacity_bytes": noisy_nvme_quota},
            },
        }
    )


async def _tenant_put(store: Store, ns_id: str, key: bytes, data: bytes) -> None:
    writer = await store.put_begin((ns_id, key), len(data), True)
    try:
        writer.write(data)
        await store.put_commit(writer, 0)
    finally:
        store.put_abort(writer)


async def _quiet_blocks_after_noise(tmp_path: Path, noisy_quota: str, seed: int) -> int:
    store = Store(_tenant_config(tmp_path, noisy_quota))
    await store.start()
    quiet, noisy = "quiet|m/l", "noisy|m/l"
    for i in range(5):  # 5 MiB: DRAM holds 1-2, the rest within quiet's 6 MiB of NVMe
        await _tenant_put(store, quiet, f"q{i}".encode(), block_bytes(i, 1 << 20))
    rng = random.Random(seed)
    for step in range(60):
        key = f"n{rng.randrange(30)}".encode()
        if rng.random() < 0.7:
            await _tenant_put(store, noisy, key, block_bytes(100 + step, 1 << 20))
        else:
            reader = await store.open_block((noisy, key))
            if reader is not None:
                reader.close()
        used = store.residency.catalog.nvme_used_by_tenant
        if noisy_quota != "0":
            assert used["noisy"] <= 8 << 20
        assert used["quiet"] <= 6 << 20
        assert store.residency.catalog.nvme_used_bytes <= 16 << 20
    survivors = 0
    for i in range(5):
        reader = await store.open_block((quiet, f"q{i}".encode()))
        if reader is not None:
            assert b"".join(bytes(c) for c in reader.chunks(1 << 20)) == block_bytes(i, 1 << 20)
            reader.close()
            survivors += 1
    await store.close()
    return survivors


@pytest.mark.parametrize("seed", range(3))
async def test_nvme_quotas_hold_under_a_noisy_tenant(tmp_path: Path, seed: int) -> None:
    assert await _quiet_blocks_after_noise(tmp_path / "quota", "8MiB", seed) == 5
    # Without a quota of its own the noisy tenant takes the shared tier from the quiet one.
    assert await _quiet_blocks_after_noise(tmp_path / "shared", "0", seed) < 5


async def test_a_session_cannot_hold_more_leases_than_its_limit(tmp_path: Path) -> None:
    config = make_config(tmp_path, 8 << 20, 64 << 20)
    config.limits.max_leases_per_session = 3
    store = Store(config)
    await store.start()
    await put(store, b"a", block_bytes(1, 4096))
    leases = [(await store.acquire(7, [(NS, b"a")]))[0] for _ in range(3)]
    with pytest.raises(ResourceExhausted, match="max_leases_per_session"):
        await store.acquire(7, [(NS, b"a")])
    with pytest.raises(ResourceExhausted, match="max_leases_per_session"):
        await store.reserve(7, [((NS, b"new"), 4096)], overwrite=False)
    entry = store.residency.catalog.get((NS, b"a"))
    assert entry is not None and entry.pins == 3  # the refused calls pinned nothing
    lease_id, _ = await store.acquire(8, [(NS, b"a")])  # another session is not affected
    store.release(8, [lease_id])
    store.release(7, [leases[0]])
    reserved, _ = await store.reserve(7, [((NS, b"new"), 4096)], overwrite=False)
    await store.commit(7, reserved, [], abort=True)  # a commit ends its lease too
    lease_id, _ = await store.acquire(7, [(NS, b"a")])
    assert store.release_session(7) == 3 and entry.pins == 0
    await store.close()
