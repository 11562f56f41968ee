"""Two stores in-process sharing one remote backend (a dict): the remote tier's ordering,
admission modes and failures, at the level of the store's own calls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.engine.store import Store
from kvtier.errors import ConfigError
from kvtier.tiers import remote as remote_mod
from tests.conftest import block_bytes
from tests.engine.test_store import NS, get, put
from tests.tiers.test_remote import MemoryBackend

SIZE = 256 << 10


class FlakyBackend(MemoryBackend):
    """A store that can be unplugged, and counts what it is asked."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.probes = 0
        self.put_delay_s = 0.0

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("store unreachable")

    def put(self, name: str, value: bytes) -> None:
        self._check()
        time.sleep(self.put_delay_s)
        super().put(name, value)

    def get(self, name: str) -> bytes | None:
        self._check()
        return super().get(name)

    def exists(self, names: Sequence[str]) -> list[bool]:
        self.probes += 1
        self._check()
        return super().exists(names)

    def delete(self, name: str) -> None:
        self._check()
        super().delete(name)


def _config(
    tmp_path: Path, name: str, admission: str, dram: int = 8 << 20, pending: int = 256 << 20
) -> Config:
    return Config.model_validate(
        {
            "server": {"listen": f"unix://{tmp_path}/{name}.sock"},
            "limits": {"reserve_wait_s": 0.5},
            "dram": {"capacity_bytes": dram, "prefault": False},
            "nvme": {"enabled": False},
            "planner": {"calibration_s": 0},
            "remote": {
                "backend": "redis",
                "url": "redis://unused",
                "admission": admission,
                "offline_after_errors": 2,
                "offline_retry_s": 0.2,
                "max_pending_bytes": pending,
            },
        }
    )


@pytest.fixture
async def backend(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FlakyBackend]:
    shared = FlakyBackend()
    monkeypatch.setattr(remote_mod, "connect", lambda config: shared)
    yield shared


async def _node(tmp_path: Path, name: str, admission: str = "write_through", **kw: int) -> Store:
    store = Store(_config(tmp_path, name, admission, **kw))
    await store.start()
    return store


async def _settle(store: Store) -> None:
    """Let background puts to the remote finish."""
    await store.tasks.drain()


async def test_write_through_makes_a_block_fetchable_by_another_node_bit_exact(
    tmp_path: Path, backend: FlakyBackend
) -> None:
    a, b = await _node(tmp_path, "a"), await _node(tmp_path, "b")
    try:
        keys = [f"k{i}".encode() for i in range(4)]
        for i, key in enumerate(keys):
            await put(a, key, block_bytes(i, SIZE))
        await _settle(a)
        assert len(backend.values) == 4
        assert (await b.lookup(NS, keys)).tiers == ["remote"] * 4
        for i, key in enumerate(keys):
            assert await get(b, key) == block_bytes(i, SIZE)
        assert (await b.lookup(NS, keys)).tiers == ["dram"] * 4
        assert b.stats().remote_fetches == 4
    finally:
        await a.close()
        await b.close()


async def test_on_evict_puts_a_block_only_when_it_leaves_dram(
    tmp_path: Path, backend: FlakyBackend
) -> None:
    a = await _node(tmp_path, "a", "on_evict", dram=2 << 20)  # room for 8 blocks
    b = await _node(tmp_path, "b")
    try:
        await put(a, b"first", block_bytes(1, SIZE))
        await _settle(a)
        assert not backend.values  # still in A's DRAM only
        for i in range(12):  # pushes "first" out of A's DRAM
            await put(a, f"fill{i}".encode(), block_bytes(100 + i, SIZE))
        await _settle(a)
        assert (await a.lookup(NS, [b"first"])).tiers == ["remote"]
        assert await get(b, b"first") == block_bytes(1, SIZE)
    finally:
        await a.close()
        await b.close()


async def test_a_delete_or_overwrite_is_seen_by_every_node(
    tmp_path: Path, backend: FlakyBackend
) -> None:
    a, b = await _node(tmp_path, "a"), await _node(tmp_path, "b")
    try:
        await put(a, b"gone", block_bytes(1, SIZE))
        await put(a, b"changed", block_bytes(2, SIZE))
        await _settle(a)
        assert await a.delete((NS, b"gone"))
        await put(a, b"changed", block_bytes(3, SIZE), overwrite=True)
        await _settle(a)
        assert await get(b, b"gone") is None
        assert await get(b, b"changed") == block_bytes(3, SIZE)  # never the old value
    finally:
        await a.close()
        await b.close()


async def test_an_unreachable_store_is_a_miss_then_offline_then_back(
    tmp_path: Path, backend: FlakyBackend
) -> None:
    a, b = await _node(tmp_path, "a"), await _node(tmp_path, "b")
    try:
        await put(a, b"k", block_bytes(1, SIZE))
        await _settle(a)
        backend.down = True
        assert await get(b, b"k") is None  # a miss, not an error
        assert (await b.lookup(NS, [b"k"])).tiers == [None]
        assert b.remote is not None and not b.remote.health.online  # 2 errors in a row
        probes = backend.probes
        assert (await b.lookup(NS, [b"k"])).tiers == [None]
        assert backend.probes == probes  # offline: not asked at all
        backend.down = False
        for _ in range(50):
            if b.remote.health.online:
                break
            await asyncio.sleep(0.05)
        assert b.remote.health.online
        assert await get(b, b"k") == block_bytes(1, SIZE)
    finally:
        await a.close()
        await b.close()


async def test_a_slow_store_holds_neither_dram_nor_unbounded_memory(
    tmp_path: Path, backend: FlakyBackend
) -> None:
    """Each remote put takes 0.3 s; DRAM holds 8 blocks and 1 MiB (4 blocks) may wait to be
    sent. 24 puts in a row all succeed at local speed: values beyond the bound are skipped
    rather than pinned in DRAM or queued without limit."""
    backend.put_delay_s = 0.3
    a = await _node(tmp_path, "a", dram=2 << 20, pending=1 << 20)
    try:
        assert a.remote is not None
        started = time.perf_counter()
        for i in range(24):
            await put(a, f"k{i}".encode(), block_bytes(i, SIZE))
            assert a.remote.pending_bytes <= 1 << 20
        assert time.perf_counter() - started < 2.0  # not 24 x 0.3 s
        assert a.remote.skipped > 0
        await _settle(a)
        assert a.remote.pending_bytes == 0
        assert len(backend.values) == 24 - a.remote.skipped == a.stats().remote_puts
    finally:
        await a.close()


async def test_a_missing_cluster_key_file_stops_the_start_naming_the_setting(
    tmp_path: Path, backend: FlakyBackend
) -> None:
    config = _config(tmp_path, "a", "write_through")
    config.remote.auth_key_file = str(tmp_path / "cluster.key")
    store = Store(config)
    with pytest.raises(ConfigError, match=r"remote\.auth_key_file: .*kvtier keygen"):
        await store.start()
    await store.close()
