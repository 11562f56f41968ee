"""Fault rows: a client process SIGKILLed mid-stream, mid-reservation and mid-lease.

A dead client must leave nothing behind: its half-sent or half-written block is never
visible, every other block reads back exactly, the DRAM it held is free again (used bytes
back to what the catalogued blocks account for, no lease left), and the blocks it pinned
can be overwritten and evicted afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import zlib
from collections.abc import Callable
from typing import Any

import kvtier
from tests.conftest import DaemonProcess, block_bytes
from tests.faults import _child
from tests.faults.harness import Report, Row, Shadow, check_all, still_serves, wait_for

NS = "faults/clients"
StartDaemon = Callable[..., DaemonProcess]
ALIGN_BYTES = 4096
ENV = {"KVTIER_LIMITS__RESERVE_WAIT_S": "1", "KVTIER_POLICY__NAME": "lru"}


def dram(client: kvtier.Client) -> dict[str, Any]:
    return dict(client.stats()["tiers"]["dram"])


def catalogued_dram_bytes(client: kvtier.Client) -> int:
    """DRAM the listed blocks account for (extents are page-aligned)."""
    return sum(
        -(-max(b.size_bytes, 1) // ALIGN_BYTES) * ALIGN_BYTES
        for b in client.list()
        if "dram" in b.tiers
    )


def no_leak(client: kvtier.Client) -> bool:
    """No lease left, and DRAM holds exactly the listed blocks."""
    leases = client.stats()["leases"]
    return bool(leases == 0 and dram(client)["used_bytes"] == catalogued_dram_bytes(client))


def kill(row: Row, proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child; counted only if the signal is what ended it."""
    proc.kill()
    proc.communicate(timeout=30)
    if proc.returncode == -signal.SIGKILL:
        row.injected += 1
    else:
        row.notes.append(f"child exited with {proc.returncode} before the kill")


def put_blocks(client: kvtier.Client, shadow: Shadow, names: list[str], size: int) -> None:
    for name in names:
        data = block_bytes(zlib.crc32(name.encode()), size)
        client.put(NS, name, data)
        shadow.put(NS, name, data, acknowledged=True)


def test_client_killed_mid_put_stream(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row(
        "client killed mid-stream", "SIGKILL of a client halfway through a 32 MiB gRPC Put stream"
    )
    daemon = start_daemon(dram="64MiB", nvme="256MiB", env=ENV)
    shadow = Shadow()
    kept = [f"kept{i}" for i in range(8)]
    with daemon.client() as client:
        put_blocks(client, shadow, [*kept, "overwritten"], 512 << 10)
        baseline = dram(client)["used_bytes"]
        for key, overwrite in (("partial", False), ("overwritten", True)):
            child = _child.spawn("stream", daemon.target, NS, key, 32 << 20, int(overwrite))
            _child.expect_line(child, "midway")
            # The fault is live: the daemon holds an extent for the half-received block.
            wait_for(
                lambda: dram(client)["used_bytes"] >= baseline + (32 << 20),
                "the put stream never reserved its DRAM",
            )
            assert client.get(NS, key) == (None if key == "partial" else shadow_value(shadow, key))
            kill(row, child)
            wait_for(lambda: dram(client)["used_bytes"] == baseline, "a dead stream leaked DRAM")
        assert no_leak(client)
        shadow.check(row, NS, "partial", client.get(NS, "partial"))
        assert client.stat(NS, "partial") is None
        check_all(row, client, shadow, must_survive={*kept, "overwritten"})
        fill_the_arena(client, shadow)
        check_all(row, client, shadow, must_survive={*kept, "overwritten"})
        row.serving = still_serves(client)
    row.assert_ok()


def test_client_killed_mid_reservation(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row(
        "client killed mid-reservation",
        "SIGKILL of a client holding a zero-copy Reserve (2 x 8 MiB, half written, no Commit)",
    )
    daemon = start_daemon(dram="32MiB", nvme="256MiB", env=ENV)
    shadow = Shadow()
    kept = [f"kept{i}" for i in range(6)]
    with daemon.client() as client:
        put_blocks(client, shadow, [*kept, "overwritten"], 1 << 20)
        baseline = dram(client)["used_bytes"]
        child = _child.spawn("reserve", daemon.target, NS, 8 << 20, "reserved", "overwritten")
        _child.expect_line(child, "committed")
        committed = _child.det_bytes(_child.COMMITTED_SEED, _child.COMMITTED_BYTES)
        shadow.put(NS, _child.COMMITTED_KEY, committed, acknowledged=True)
        _child.expect_line(child, "holding 2")
        stats = client.stats()
        assert stats["leases"] == 1, "the reservation is not held"
        assert stats["tiers"]["dram"]["used_bytes"] == baseline + (17 << 20)
        kill(row, child)
        wait_for(lambda: client.stats()["leases"] == 0, "a dead client's reservation leaked", 5)
        assert dram(client)["used_bytes"] == baseline + _child.COMMITTED_BYTES
        assert no_leak(client)
        shadow.check(row, NS, "reserved", client.get(NS, "reserved"))
        assert client.stat(NS, "reserved") is None
        must = {*kept, "overwritten", _child.COMMITTED_KEY}
        check_all(row, client, shadow, must_survive=must)
        fill_the_arena(client, shadow)
        check_all(row, client, shadow, must_survive=must)
        row.serving = still_serves(client)
    row.assert_ok()


def test_client_killed_mid_lease(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row(
        "client killed mid-lease",
        "SIGKILL of a client holding 6 zero-copy Acquire leases (some promoted from NVMe)",
    )
    daemon = start_daemon(dram="8MiB", nvme="128MiB", env=ENV)
    shadow = Shadow()
    names = [f"b{i:02d}" for i in range(12)]  # 12 MiB through 8 MiB: the first ones on NVMe
    leased = names[:3] + names[-3:]
    with daemon.client() as client:
        put_blocks(client, shadow, names, 1 << 20)
        assert "nvme" in client.lookup(NS, leased).tiers
        child = _child.spawn("acquire", daemon.target, NS, *leased)
        _child.expect_line(child, "holding 6")
        assert client.stats()["leases"] == 6, "the leases are not held"
        assert client.lookup(NS, leased).tiers == ["dram"] * 6
        kill(row, child)
        wait_for(lambda: client.stats()["leases"] == 0, "a dead client's leases leaked", 5)
        assert no_leak(client)
        check_all(row, client, shadow, must_survive=set(names))
        # The formerly leased blocks can be overwritten ...
        for name in leased[:2]:
            data = block_bytes(1000 + names.index(name), 1 << 20)
            client.put(NS, name, data, overwrite=True)
            shadow.put(NS, name, data, acknowledged=True)
        # ... and evicted: 8 MiB of newer blocks push every one of them out of DRAM (LRU).
        fresh = [f"fresh{i}" for i in range(8)]
        put_blocks(client, shadow, fresh, 1 << 20)
        tiers = {name: client.stat(NS, name).tiers for name in leased}  # type: ignore[union-attr]
        assert all("dram" not in t for t in tiers.values()), tiers
        assert client.stats()["tiers"]["dram"]["evictions"] >= 6
        check_all(row, client, shadow, must_survive={*names, *fresh})
        assert no_leak(client)
        row.serving = still_serves(client)
    row.assert_ok()


def shadow_value(shadow: Shadow, key: str) -> bytes:
    (value,) = shadow.allowed(NS, key)
    return value


def fill_the_arena(client: kvtier.Client, shadow: Shadow) -> None:
    """One block as large as the arena less 1 MiB: fails if a dead client's extent leaked."""
    size = dram(client)["capacity_bytes"] - (1 << 20)
    data = os.urandom(size)
    client.put(NS, "fills-the-arena", data)
    shadow.put(NS, "fills-the-arena", data, acknowledged=True)
