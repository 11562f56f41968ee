"""A put_many over the session socket gives the event loop back while its blocks are
stored (zerocopy.put_staged, BATCH_TURN_S), streamed or not: one StagedPut of many blocks
used to be one loop turn (and a streamed one still was, until the 1 M fill's 33-36 ms
stalls found it). Each block's commit sleeps 5 ms on the loop here (a failpoint), so a
batch of 64 held the loop for a third of a second before; now each turn is about one
block."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.client.write_area import STREAM_MIN_BYTES
from kvtier.engine.zerocopy import BATCH_TURN_S
from tests.conftest import DaemonProcess, block_bytes
from tests.integration.test_staged_put import NS, attached

StartDaemon = Callable[..., DaemonProcess]
BLOCKS = 64
COMMIT_SLEEP_S = 0.005


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_put_many_is_not_one_loop_turn(start_daemon: StartDaemon, streamed: bool) -> None:
    env = {"KVTIER_FAILPOINTS": f"store.commit=delay:{COMMIT_SLEEP_S}"}
    daemon = start_daemon(dram="64MiB", nvme="256MiB", env=env)
    with daemon.client() as client:
        arena = attached(client)
        assert arena.write_area is not None
        arena.write_area.one_exchange, arena.write_area.streams = True, streamed
        client.put(NS, "warm", b"x")  # start-up's stalls out of the window below
        client.stats()
        # 16 KiB each: a put_many of 1 MiB, which the client streams when told to.
        blocks = [(f"k{i}", block_bytes(i, 16 << 10)) for i in range(BLOCKS)]
        assert sum(len(data) for _, data in blocks) >= STREAM_MIN_BYTES
        assert client.put_many(NS, blocks) == [True] * BLOCKS
        stall_s = client.stats().event_loop_stall_recent_max_s
        for key, data in blocks[::9]:
            assert client.get(NS, key) == data
    # One turn was BLOCKS x 5 ms = 320 ms; now a block or two a turn (the margin is for
    # a shared machine descheduling the daemon now and then).
    assert stall_s < BLOCKS * COMMIT_SLEEP_S / 2, stall_s
    assert BATCH_TURN_S < COMMIT_SLEEP_S
