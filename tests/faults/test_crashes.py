"""SIGKILL at chosen points of put, eviction, removal, delete and start-up, then restart.

A failpoint kills the daemon at one named point while a client runs puts, overwrites and
deletes; the call in flight is in doubt (the shadow allows the value before and after it).
After the restart every key must be a miss or an allowed value, and every block that was
on NVMe before the run and not touched by it must still be there.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests.conftest import DaemonProcess, block_bytes
from tests.faults.harness import (
    Report,
    Shadow,
    check_all,
    fired,
    random_workload,
    still_serves,
)

StartDaemon = Callable[..., DaemonProcess]
NS = "faults/crash"
KILL_POINTS = (
    "store.commit",  # a put's bytes received, not yet in the catalog
    "nvme.pwrite",  # a record half written
    "nvme.rename",  # a record written, not yet visible
    "store.evict",  # a block on NVMe, its DRAM copy not yet freed
    "nvme.tombstone",  # a delete or overwrite about to be made durable
    "nvme.remove",  # an old record being removed
)


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_at(point: str, start_daemon: StartDaemon, report: Report) -> None:
    row = report.row(f"SIGKILL at {point}", f"failpoint {point}=kill@0.2 (once per round)")
    shadow = Shadow()
    rng = random.Random(point)
    daemon = start_daemon(dram="3MiB", nvme="512MiB")
    with daemon.client() as c:
        base = []
        for i in range(8):
            data = block_bytes(50_000 + i, 256 << 10)
            c.put(NS, f"b{i}", data)
            shadow.put(NS, f"b{i}", data, acknowledged=True)
            base.append(f"b{i}")
    daemon.terminate()  # the base blocks are on NVMe now
    for round_ in range(3):
        daemon.env = {
            "KVTIER_FAILPOINTS": f"{point}=kill@0.2*1",
            "KVTIER_FAILPOINTS_SEED": str(round_),
            # Start-up calibration writes records too: the kill belongs in the workload.
            "KVTIER_PLANNER__CALIBRATION_S": "0",
        }
        daemon.start()
        with daemon.client(timeout_s=10) as c:
            died = random_workload(c, shadow, rng, row, ns=NS, ops=120)
        if died:
            assert daemon.proc is not None
            assert daemon.proc.wait(10) == -9, "the client failed but the daemon did not die"
            daemon.kill()  # reap, close the pipe
        else:
            daemon.terminate()
        row.injected = fired(daemon.log(), point)
        daemon.env = {}
        daemon.start()
        with daemon.client() as c:
            check_all(row, c, shadow, must_survive=set(base))
            row.serving = still_serves(c)
        daemon.terminate()
    row.assert_ok()


def test_sigkill_while_compacting_tombstones(start_daemon: StartDaemon, report: Report) -> None:
    """The start-up rewrite of the tombstone log (the nearest thing to an index checkpoint:
    the index itself is rebuilt from record headers) killed halfway, then started again."""
    row = report.row("SIGKILL at nvme.compact (start-up checkpoint)", "failpoint nvme.compact=kill")
    shadow = Shadow()
    daemon = start_daemon(dram="2MiB", nvme="256MiB")
    with daemon.client() as c:
        for i in range(12):
            data = block_bytes(70_000 + i, 256 << 10)
            c.put(NS, f"k{i}", data)
            shadow.put(NS, f"k{i}", data, acknowledged=True)
    daemon.restart()  # every block on NVMe
    with daemon.client() as c:
        for i in range(0, 12, 2):
            assert c.delete(NS, f"k{i}")
            shadow.delete(NS, f"k{i}", acknowledged=True)
    daemon.kill()  # no clean stop: the tombstones are all that says what was deleted
    daemon.env = {"KVTIER_FAILPOINTS": "nvme.compact=kill"}
    with pytest.raises(AssertionError, match=r"did not start|failed to start"):
        daemon.start(timeout_s=20)
    row.injected = fired(daemon.log(), "nvme.compact")
    daemon.kill()
    daemon.env = {}
    daemon.start()
    with daemon.client() as c:
        for i in range(0, 12, 2):
            row.wrong_bytes += c.get(NS, f"k{i}") is not None  # a delete must stay a delete
        check_all(row, c, shadow, must_survive={f"k{i}" for i in range(1, 12, 2)})
        row.serving = still_serves(c)
    row.assert_ok()
