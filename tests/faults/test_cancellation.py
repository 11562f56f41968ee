"""Fault rows: a call cancelled (its deadline passed) while the daemon moves bytes for it.

A put that must first demote a block to NVMe, and a lease that must first promote one from
NVMe, both hand the copy to an I/O thread. When the caller's deadline passes half-way, the
copy still lands; the daemon must still account for it: every record file on disk is a
block its catalog lists (none orphaned until the next restart), and the DRAM arena holds
exactly the listed blocks (no extent filled for a promotion and then forgotten).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from tests.conftest import DaemonProcess, block_bytes
from tests.faults.harness import Report, Shadow, check_all, fired, still_serves, wait_for
from tests.faults.test_clients import no_leak
from tests.faults.test_nvme_faults import record_files

StartDaemon = Callable[..., DaemonProcess]
NS = "faults/cancel"
MiB = 1 << 20
ENV = {"KVTIER_POLICY__NAME": "lru", "KVTIER_POLICY__ADMISSION": "write_back"}


def disk_matches_catalog(daemon: DaemonProcess, client: kvtier.Client) -> bool:
    return bool(len(record_files(daemon)) == client.stats()["tiers"]["nvme"]["blocks"])


def settle(daemon: DaemonProcess, client: kvtier.Client) -> None:
    """Wait for the copies the cancelled calls started; then disk and DRAM must agree with
    the catalog (a leak fails the row outright: it is neither a wrong byte nor a loss)."""
    wait_for(lambda: disk_matches_catalog(daemon, client), "record files == NVMe blocks")
    wait_for(lambda: no_leak(client), "DRAM used == listed blocks, no lease")


def put_base(client: kvtier.Client, shadow: Shadow, count: int) -> list[str]:
    keys = []
    for i in range(count):
        data = block_bytes(40_000 + i, 1 * MiB)
        client.put(NS, f"base{i}", data)
        shadow.put(NS, f"base{i}", data, acknowledged=True)
        keys.append(f"base{i}")
    return keys


def test_put_cancelled_mid_demotion(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row(
        "put cancelled mid-demotion",
        "0.3 s client deadline; the DRAM victim's NVMe write delayed 0.8 s (nvme.pwrite)",
    )
    env = {**ENV, "KVTIER_FAILPOINTS": "nvme.pwrite=delay:0.8"}
    daemon = start_daemon(dram="4MiB", nvme="256MiB", env=env)
    shadow = Shadow()
    with daemon.client(timeout_s=30) as client:
        base = put_base(client, shadow, 4)  # DRAM is full: each later put demotes one
        with daemon.client(timeout_s=0.3) as hasty:
            for i in range(3):
                data = block_bytes(41_000 + i, 1 * MiB)
                try:
                    hasty.put(NS, f"late{i}", data)
                    shadow.put(NS, f"late{i}", data, acknowledged=True)
                except kvtier.KVTierError as err:
                    assert "deadline exceeded" in str(err).lower(), err
                    shadow.put(NS, f"late{i}", data, acknowledged=False)
                    row.injected += 1
        settle(daemon, client)
        check_all(row, client, shadow, must_survive=set(base))
        row.serving = still_serves(client)
    assert fired(daemon.log(), "nvme.pwrite") > 0
    daemon.restart()
    with daemon.client() as client:
        check_all(row, client, shadow, must_survive=set(base))
        row.serving = row.serving and disk_matches_catalog(daemon, client)
    row.assert_ok()
    assert row.injected > 0, "no put ran past its deadline: the fault was not injected"


def test_client_gone_mid_promotion(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row(
        "client gone mid-promotion",
        "zero-copy Acquire sent, socket closed while its NVMe read is delayed 0.8 s",
    )
    daemon = start_daemon(dram="4MiB", nvme="256MiB", env=ENV)
    shadow = Shadow()
    with daemon.client() as client:
        base = put_base(client, shadow, 4)
    daemon.env = {**ENV, "KVTIER_FAILPOINTS": "nvme.read=delay:0.8"}
    daemon.restart()  # a clean stop writes DRAM out: the base blocks are NVMe-only now
    with daemon.client(timeout_s=30) as client:
        for key in base[:2]:
            with daemon.client() as leaving:
                arena = leaving._shared_arena()
                assert arena is not None
                arena.send(Op.ACQUIRE, pb.AcquireRequest(namespace=NS, keys=[key.encode()]))
                time.sleep(0.2)  # the promotion is under way on an I/O thread
            row.injected += 1
        time.sleep(1.0)  # both promotions land after their clients left
        settle(daemon, client)
        check_all(row, client, shadow, must_survive=set(base))
        row.serving = still_serves(client)
    assert fired(daemon.log(), "nvme.read") > 0
    row.assert_ok()
