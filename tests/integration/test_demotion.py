"""A real daemon under a stream of puts through a tiny DRAM arena: the demoter writes the
blocks to NVMe in batches behind the puts (kvtier/engine/demoter.py); no put fails while
NVMe has room, every byte comes back exact, before and after a restart."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.conftest import DaemonProcess, block_bytes

NS = "llama3-8b/bf16-b16-tp1"
StartDaemon = Callable[..., DaemonProcess]
BLOCK = 64 << 10


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_a_put_stream_through_a_tiny_dram_lands_on_nvme_exact(
    start_daemon: StartDaemon, layout: str
) -> None:
    daemon = start_daemon(dram="4MiB", nvme="512MiB", env={"KVTIER_NVME__LAYOUT": layout})
    keys = [b"stream-%05d" % i for i in range(640)]  # 40 MiB through 4 MiB
    with daemon.client() as client:
        for start in range(0, len(keys), 16):
            batch = keys[start : start + 16]
            stored = client.put_many(
                NS, [(k, block_bytes(start + j, BLOCK)) for j, k in enumerate(batch)]
            )
            assert all(stored), f"a put failed at block {start}"
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
