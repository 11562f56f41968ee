"""A real daemon over a real socket: bytes come back exact, lookups report the right tiers."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvtier import chain_keys
from tests.conftest import DaemonProcess, block_bytes

NS = "llama3-8b/bf16-b16-tp1"
StartDaemon = Callable[..., DaemonProcess]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["uds", "tcp"])
def test_300_random_blocks_come_back_bit_exact(start_daemon: StartDaemon, transport: str) -> None:
    listen = "127.0.0.1:0" if transport == "tcp" else None
    # Plain TCP on loopback: measures the byte path, not TLS (tests/integration/test_tls.py).
    env = {"KVTIER_SERVER__TLS_INSECURE": "true"} if transport == "tcp" else None
    daemon = start_daemon(dram="512MiB", nvme="4GiB", listen=listen, env=env)
    if transport == "tcp":
        assert not daemon.target.startswith("unix:")
    rng = random.Random(300)
    sizes = [rng.randint(1 << 10, 16 << 20) for _ in range(300)]
    keys = [rng.randbytes(32) for _ in sizes]
    with daemon.client() as client:
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            assert client.put(NS, key, block_bytes(i, size)) is True
        for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            got = client.get(NS, key)
            assert got is not None, f"block {i} missing"
            assert len(got) == size and got == block_bytes(i, size), f"block {i} differs"
        stats = client.stats()
    assert stats["tiers"]["dram"]["used_bytes"] <= stats["tiers"]["dram"]["capacity_bytes"]
    assert stats["checksum_failures"] == 0
    # 2.4 GB of blocks cannot fit a 512 MiB arena: the older ones must have come from NVMe.
    assert stats["tiers"]["nvme"]["hits"] > 0 and stats["tiers"]["dram"]["hits"] > 0


def test_lookup_reports_prefix_and_tiers(start_daemon: StartDaemon) -> None:
    # No free headroom kept by the demoter: which blocks sit in DRAM is exact here (with
    # it, a fourth 4 MiB block is demoted ahead of the next put, by the policy's choice).
    env = {"KVTIER_DRAM__DEMOTE_FREE_FRACTION": "0"}
    daemon = start_daemon(dram="16MiB", nvme="256MiB", env=env)
    chain = chain_keys(NS, [list(range(i * 16, i * 16 + 16)) for i in range(12)])
    with daemon.client() as client:
        empty = client.lookup(NS, chain)
        assert empty.prefix_blocks == 0 and empty.tiers == [None] * 12
        # Blocks 0..7 stored (4 MiB each: the first ones spill to NVMe), 8 missing, 9 stored.
        for i in [*range(8), 9]:
            client.put(NS, chain[i], block_bytes(i, 4 << 20))
        result = client.lookup(NS, chain)
        assert result.prefix_blocks == 8
        assert result.tiers[8] is None and result.tiers[10:] == [None, None]
        assert result.tiers[9] == "dram"
        assert set(result.tiers[:8]) == {"dram", "nvme"}
        assert result.tiers[0] == "nvme"  # least recently used spilled first
        for i, tier in enumerate(result.tiers):
            stat = client.stat(NS, chain[i])
            assert (stat.tiers[0] if stat else None) == tier
        # Another namespace sees nothing of this one.
        assert client.lookup("other/model", chain).prefix_blocks == 0
        assert client.get("other/model", chain[0]) is None
        # Deleting the first block breaks the prefix at once.
        assert client.delete(NS, chain[0]) is True
        assert client.delete(NS, chain[0]) is False
        assert client.lookup(NS, chain).prefix_blocks == 0
        assert client.get(NS, chain[0]) is None
        assert client.get(NS, chain[1]) == block_bytes(1, 4 << 20)


@pytest.mark.slow
def test_spill_400MiB_through_64MiB_dram(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="64MiB", nvme="1GiB")
    rng = random.Random(400)
    written = 0
    blocks: list[tuple[bytes, int]] = []
    with daemon.client() as client:
        while written < 400 << 20:
            size = rng.randint(1 << 10, 8 << 20)
            key = rng.randbytes(16)
            client.put(NS, key, block_bytes(len(blocks), size))
            blocks.append((key, size))
            written += size
            dram = client.stats()["tiers"]["dram"]
            assert dram["used_bytes"] <= 64 << 20 == dram["capacity_bytes"]
        tiers = client.lookup(NS, [k for k, _ in blocks]).tiers
        assert tiers[0] == "nvme" and "dram" in tiers and None not in tiers
        for i, (key, size) in enumerate(blocks):
            assert client.get(NS, key) == block_bytes(i, size), f"block {i} differs"
        stats = client.stats()
    assert stats["tiers"]["dram"]["used_bytes"] <= 64 << 20
    assert stats["tiers"]["nvme"]["used_bytes"] <= 1 << 30
    assert stats["dropped_blocks"] == 0


def test_nvme_capacity_is_bounded_and_evicts_oldest(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="8MiB", nvme="32MiB")
    with daemon.client() as client:
        for i in range(40):  # 40 MiB through 8 MiB DRAM + 32 MiB NVMe (records carry headers)
            client.put(NS, f"b{i}", block_bytes(i, 1 << 20))
        stats = client.stats()
        assert stats["tiers"]["nvme"]["used_bytes"] <= 32 << 20
        assert stats["dropped_blocks"] > 0
        assert client.get(NS, "b0") is None  # the oldest fell off the end
        assert client.get(NS, "b39") == block_bytes(39, 1 << 20)
        # Whatever is still listed is served exactly.
        for stat in client.list(NS):
            i = int(stat.key.decode()[1:])
            assert client.get(NS, stat.key) == block_bytes(i, 1 << 20)


def test_put_is_idempotent_and_never_silently_overwrites(start_daemon: StartDaemon) -> None:
    import kvtier

    daemon = start_daemon(dram="16MiB", nvme="64MiB")
    with daemon.client() as client:
        assert client.put(NS, b"k", b"one") is True
        assert client.put(NS, b"k", b"one") is False  # same bytes: already present
        with pytest.raises(kvtier.AlreadyExists):
            client.put(NS, b"k", b"two")
        assert client.get(NS, b"k") == b"one"
        assert client.put(NS, b"k", b"two", overwrite=True) is True
        assert client.get(NS, b"k") == b"two"
        assert client.put(NS, b"empty", b"") is True
        assert client.get(NS, b"empty") == b""


async def test_async_client_roundtrip(start_daemon: StartDaemon) -> None:
    import asyncio

    import kvtier

    daemon = start_daemon(dram="32MiB", nvme="128MiB")
    async with kvtier.AsyncClient(daemon.target) as client:
        payloads = {f"a{i}".encode(): block_bytes(i, (i + 1) * 300_000) for i in range(24)}
        await asyncio.gather(*(client.put(NS, k, v) for k, v in payloads.items()))
        got = await asyncio.gather(*(client.get(NS, k) for k in payloads))
        assert got == list(payloads.values())
        lookup = await client.lookup(NS, list(payloads))
        assert lookup.prefix_blocks == len(payloads)
        assert await client.get(NS, b"missing") is None
        assert await client.delete(NS, b"a0") is True
        assert (await client.stat(NS, b"a0")) is None
        listed = [s.key async for s in client.list(NS)]
        assert sorted(listed) == sorted(k for k in payloads if k != b"a0")
        stats = await client.stats()
        assert {"used_bytes", "capacity_bytes"} <= set(stats["tiers"]["dram"])
