"""A daemon whose DRAM order runs in C (kvtier/index/_arc_native.c), in Python on request,
and in Python for a policy without a C order: each says which at start, and each evicts
to NVMe and serves every block back bit-exact, hot blocks kept in DRAM. Its demotion
batches are checked and their headers encoded in C (kvtier/tiers/_batch_native.c) or,
on request, in Python: it says which, and the blocks come back from NVMe either way."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from kvtier.index.dense_native import NATIVE
from kvtier.tiers import record_batch
from tests.conftest import DaemonProcess, block_bytes

NS = "model/native-order"
StartDaemon = Callable[..., DaemonProcess]
BLOCK_BYTES = 64 << 10
BLOCKS = 400  # 25 MiB through an 8 MiB arena


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, "DRAM's order in C (kvtier/index/_arc_native.c)"),
        ({"KVTIER_NATIVE": "0"}, "DRAM's order in Python (KVTIER_NATIVE=0)"),
        ({"KVTIER_POLICY__NAME": "lru"}, "DRAM's order in Python (this policy has no C order)"),
    ],
    ids=["native", "python-on-request", "lru"],
)
def test_daemon_evicts_through_its_dram_order_and_says_which(
    start_daemon: StartDaemon, env: dict[str, str], says: str
) -> None:
    if NATIVE is None and "in C" in says and os.environ.get("KVTIER_REQUIRE_NATIVE") != "1":
        pytest.skip("kvtier/index/_arc_native.c was not built")
    daemon = start_daemon(dram="8MiB", nvme="256MiB", env=env)
    assert says in daemon.log()
    if record_batch.NATIVE is not None or os.environ.get("KVTIER_REQUIRE_NATIVE") == "1":
        batches = "in Python (KVTIER_NATIVE=0)" if env.get("KVTIER_NATIVE") == "0" else "in C"
        assert f"a demotion batch's checks and headers {batches}" in daemon.log()
    hot = [f"b{i}" for i in range(0, 40, 4)]  # all put by the first reads below
    with daemon.client() as client:
        for i in range(BLOCKS):
            client.put(NS, f"b{i}", block_bytes(i, BLOCK_BYTES))
            if i % 10 == 9 and i >= 40:  # a few blocks asked for again and again: worth keeping
                for key in hot:
                    assert client.get(NS, key) == block_bytes(int(key[1:]), BLOCK_BYTES)
        tiers = client.stats()["tiers"]
        assert tiers["nvme"]["blocks"] > BLOCKS // 2  # the order chose victims, many
        assert tiers["dram"]["used_bytes"] <= 8 << 20
        in_dram = [key for key in hot if "dram" in client.lookup(NS, [key]).tiers]
        for i in range(BLOCKS):
            assert client.get(NS, f"b{i}") == block_bytes(i, BLOCK_BYTES), i
    if "lru" not in env.get("KVTIER_POLICY__NAME", ""):
        # The chain ARC protects what is used again: the hot blocks outlived the stream.
        assert len(in_dram) >= len(hot) // 2, in_dram
