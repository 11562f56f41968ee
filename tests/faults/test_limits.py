"""Calls that run into a limit while the daemon is busy: a client deadline shorter than a
put's wait for DRAM, and more concurrent calls than server.max_concurrent_rpcs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from tests.conftest import DaemonProcess, block_bytes
from tests.faults.harness import Report, Shadow, check_all, still_serves

StartDaemon = Callable[..., DaemonProcess]
NS = "faults/limits"


@contextmanager
def dram_pinned_full(daemon: DaemonProcess, shadow: Shadow) -> Iterator[kvtier.Client]:
    """Fill the 4 MiB arena with blocks and lease them all, so every put must wait."""
    with daemon.client() as client, daemon.client() as holder:
        for i in range(4):
            data = block_bytes(600 + i, 1 << 20)
            client.put(NS, f"pinned{i}", data)
            shadow.put(NS, f"pinned{i}", data, acknowledged=True)
        arena = holder._shared_arena()
        assert arena is not None
        lease = arena.call(
            Op.ACQUIRE,
            pb.AcquireRequest(namespace=NS, keys=[f"pinned{i}".encode() for i in range(4)]),
            pb.AcquireResponse,
        )
        assert all(b.found for b in lease.blocks)
        yield client
        arena.send(Op.RELEASE, pb.ReleaseRequest(lease_ids=[lease.lease_id]))


def test_a_deadline_shorter_than_the_wait_is_honoured(
    start_daemon: StartDaemon, report: Report
) -> None:
    row = report.row(
        "client deadline shorter than a put's wait for DRAM",
        "puts with a 0.4 s deadline while every DRAM block is leased (reserve_wait_s=10)",
    )
    daemon = start_daemon(dram="4MiB", nvme="64MiB", env={"KVTIER_LIMITS__RESERVE_WAIT_S": "10"})
    shadow = Shadow()
    with dram_pinned_full(daemon, shadow) as client:
        used_bytes = client.stats()["tiers"]["dram"]["used_bytes"]
        with daemon.client(timeout_s=0.4) as hasty:
            for i in range(3):
                data = block_bytes(700 + i, 512 << 10)
                started_s = time.monotonic()
                try:
                    hasty.put(NS, f"late{i}", data)
                    raise AssertionError("a put into leased-full DRAM succeeded")
                except kvtier.KVTierError as err:
                    assert "deadline exceeded" in str(err).lower(), err
                assert time.monotonic() - started_s < 2.0
                shadow.put(NS, f"late{i}", data, acknowledged=False)
                row.injected += 1
        # The daemon gave up on the expired calls: nothing reserved for them lingers.
        time.sleep(0.3)
        assert client.stats()["tiers"]["dram"]["used_bytes"] == used_bytes
    with daemon.client() as client:
        time.sleep(0.5)
        for i in range(3):  # not stored behind the caller's back once room came
            row.wrong_bytes += client.get(NS, f"late{i}") is not None
        check_all(row, client, shadow, must_survive={f"pinned{i}" for i in range(4)})
        row.serving = still_serves(client)
    row.assert_ok()


def test_more_calls_than_max_concurrent_rpcs_are_refused(
    start_daemon: StartDaemon, report: Report
) -> None:
    row = report.row(
        "more concurrent calls than server.max_concurrent_rpcs",
        "8 puts at once, each waiting for leased-full DRAM, against max_concurrent_rpcs=3",
    )
    daemon = start_daemon(
        dram="4MiB",
        nvme="64MiB",
        env={"KVTIER_LIMITS__RESERVE_WAIT_S": "3", "KVTIER_SERVER__MAX_CONCURRENT_RPCS": "3"},
    )
    shadow = Shadow()
    codes: list[str] = []
    lock = threading.Lock()

    def waiting_put(i: int) -> None:
        with daemon.client(timeout_s=20) as c:
            try:
                c.put(NS, f"queued{i}", block_bytes(800 + i, 512 << 10))
                code = "OK"
            except kvtier.KVTierError as err:
                code = type(err).__name__
        with lock:
            codes.append(code)

    with dram_pinned_full(daemon, shadow):
        threads = [threading.Thread(target=waiting_put, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    refused = codes.count("ResourceExhausted")
    row.injected = len(codes)
    row.notes.append(f"answers: {sorted(codes)}")
    # The 2 leasing clients' calls are done; 3 slots: at least 5 of the 8 refused at once.
    assert refused >= 5, codes
    assert set(codes) <= {"ResourceExhausted"}, codes
    with daemon.client() as client:
        for i in range(8):
            shadow.put(NS, f"queued{i}", block_bytes(800 + i, 512 << 10), acknowledged=False)
        check_all(row, client, shadow, must_survive={f"pinned{i}" for i in range(4)})
        row.serving = still_serves(client)
    row.assert_ok()
