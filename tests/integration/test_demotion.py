"""A real daemon under a stream of puts through a tiny DRAM arena: the demoter writes the
blocks to NVMe in batches behind the puts (kvtier/engine/demoter.py); no put fails while
NVMe has room, every byte comes back exact, before and after a restart."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import kvtier
from kvtier.tiers.startup import LAYOUT_DIRS
from tests.conftest import DaemonProcess, block_bytes

NS = "llama3-8b/bf16-b16-tp1"
StartDaemon = Callable[..., DaemonProcess]
BLOCK = 64 << 10


def put_all(client: kvtier.Client, keys: list[bytes]) -> None:
    """`keys` put 16 a call, block i's bytes `block_bytes(i)`; every put must succeed."""
    for start in range(0, len(keys), 16):
        batch = keys[start : start + 16]
        stored = client.put_many(
            NS, [(k, block_bytes(start + j, BLOCK)) for j, k in enumerate(batch)]
        )
        assert all(stored), f"a put failed at block {start}"


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_a_put_stream_through_a_tiny_dram_lands_on_nvme_exact(
    start_daemon: StartDaemon, layout: str
) -> None:
    daemon = start_daemon(dram="4MiB", nvme="512MiB", env={"KVTIER_NVME__LAYOUT": layout})
    keys = [b"stream-%05d" % i for i in range(640)]  # 40 MiB through 4 MiB
    with daemon.client() as client:
        put_all(client, keys)
        stats = client.stats()
        on_nvme = stats["tiers"]["nvme"]["blocks"]
        assert on_nvme >= len(keys) - 64  # all but what 4 MiB of DRAM can still hold
        assert stats["demotions"] == on_nvme
        assert stats["dropped_blocks"] == 0 and stats["checksum_failures"] == 0
        for i, key in enumerate(keys):
            assert client.get(NS, key) == block_bytes(i, BLOCK), f"block {i} differs"
    daemon.terminate()
    daemon.start()
    with daemon.client() as client:
        for i, key in enumerate(keys):  # flushed at stop or demoted: all of them
            assert client.get(NS, key) == block_bytes(i, BLOCK), f"block {i} lost"


@pytest.mark.parametrize("layout", ["segments", "files"])
def test_a_stream_past_nvme_capacity_evicts_and_keeps_writing(
    start_daemon: StartDaemon, layout: str
) -> None:
    """A cache in its steady state: NVMe full, every new block pushes an old one out. The
    store must evict by the capacity the tier can hold (for segments, the configured one
    less the room reclaim keeps back), so that reclaim finds dead records to free: counting
    the configured capacity, the segments reached the disk limit with every record live,
    and each batch waited for a reclaim with nothing to do, then failed (its blocks lost)."""
    daemon = start_daemon(dram="4MiB", nvme="128MiB", env={"KVTIER_NVME__LAYOUT": layout})
    keys = [b"full-%05d" % i for i in range(6144)]  # 384 MiB: three times the tier
    with daemon.client() as client:
        put_all(client, keys)
        stats = client.stats()
        nvme = stats["tiers"]["nvme"]
        assert nvme["online"] and nvme["io_errors"] == 0 and stats["checksum_failures"] == 0
        # Out of every tier only by NVMe's evictions: none lost to a write that failed.
        assert stats["dropped_blocks"] <= nvme["evictions"]
        assert 0 < nvme["used_bytes"] <= nvme["capacity_bytes"] <= 128 << 20
        assert nvme["evictions"] > len(keys) // 2  # most of the stream went out again
        assert stats["demotions"] >= len(keys) - 64  # each one written, none dropped
        records = daemon.nvme_path / LAYOUT_DIRS[layout]  # the files layout's spares aside
        on_disk = sum(f.stat().st_size for f in records.rglob("*") if f.is_file())
        assert on_disk <= 128 << 20, f"{on_disk} bytes of records past the 128 MiB limit"
        # The newest blocks are all there, exact; an evicted one is a miss, never wrong.
        newest = len(keys) - nvme["blocks"] // 2
        for i, key in enumerate(keys):
            got = client.get(NS, key)
            if i >= newest:
                assert got == block_bytes(i, BLOCK), f"block {i} lost or differs"
            else:
                assert got is None or got == block_bytes(i, BLOCK), f"block {i} differs"
