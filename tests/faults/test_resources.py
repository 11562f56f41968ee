"""Fault rows: the daemon short of a resource — a DRAM tier full of leased blocks, no
lockable memory (prlimit --memlock=0:0), a small memory cgroup.

Short of room, a put must be refused quickly (RESOURCE_EXHAUSTED, with a message), never
wait forever or evict a leased block; short of lockable or cgroup memory the daemon must
start, serve and survive a restart. Every get is compared with the Shadow.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from tests.conftest import DaemonProcess, block_bytes
from tests.faults.harness import Report, Row, Shadow, check_all, still_serves, wait_for

NS = "faults/resources"
StartDaemon = Callable[..., DaemonProcess]
RESERVE_WAIT_S = 0.5


def data_for(name: str, size_bytes: int) -> bytes:
    return block_bytes(zlib.crc32(name.encode()), size_bytes)


def put_checked(
    client: kvtier.Client, shadow: Shadow, name: str, size_bytes: int, zero_copy: bool
) -> None:
    data = data_for(name, size_bytes)
    if zero_copy:
        client.put_from(NS, name, data, overwrite=True)
    else:
        client.put(NS, name, data, overwrite=True)
    shadow.put(NS, name, data, acknowledged=True)


def log_errors(daemon: DaemonProcess) -> list[str]:
    return [
        line
        for line in daemon.log().splitlines()
        if re.search(r"\b(ERROR|CRITICAL)\b|Traceback", line)
    ]


# ---- a DRAM tier full of leased blocks -----------------------------------------------------
def test_dram_full_of_leased_blocks(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row(
        "DRAM tier full of leased blocks",
        "zero-copy Acquire of every block of an 8 MiB DRAM arena, then puts "
        f"(limits.reserve_wait_s={RESERVE_WAIT_S})",
    )
    daemon = start_daemon(
        dram="8MiB",
        nvme="128MiB",
        env={
            "KVTIER_LIMITS__RESERVE_WAIT_S": str(RESERVE_WAIT_S),
            "KVTIER_POLICY__NAME": "lru",
            # Demote only when DRAM is full: the test needs it full of the blocks it leases.
            "KVTIER_DRAM__DEMOTE_FREE_FRACTION": "0",
        },
    )
    shadow = Shadow()
    names = [f"b{i:02d}" for i in range(10)]  # the first two end up on NVMe only
    with daemon.client() as client, daemon.client() as holder:
        for i, name in enumerate(names):
            put_checked(client, shadow, name, 1 << 20, zero_copy=bool(i % 2))
        in_dram = [
            n for n, t in zip(names, client.lookup(NS, names).tiers, strict=True) if t == "dram"
        ]
        dram = client.stats()["tiers"]["dram"]
        assert len(in_dram) == 8 and dram["used_bytes"] == dram["capacity_bytes"], dram
        arena = holder._shared_arena()
        assert arena is not None
        lease = arena.call(
            Op.ACQUIRE,
            pb.AcquireRequest(namespace=NS, keys=[n.encode() for n in in_dram]),
            pb.AcquireResponse,
        )
        assert all(b.found for b in lease.blocks) and client.stats()["leases"] == 1

        for size, zero_copy in ((1 << 20, False), (4096, False), (64 << 10, True), (1, True)):
            name = f"refused-{size}-{zero_copy}"
            row.injected += 1
            started_s = time.monotonic()
            with pytest.raises(kvtier.ResourceExhausted) as info:
                put_checked(client, Shadow(), name, size, zero_copy)
            waited_s = time.monotonic() - started_s
            assert str(info.value), "RESOURCE_EXHAUSTED without a message"
            assert waited_s < RESERVE_WAIT_S + 3.0, f"a refused put took {waited_s:.1f} s"
            shadow.check(row, NS, name, client.get(NS, name))  # a refused put stores nothing
        row.notes.append(f"refusal: {info.value}")

        # Leased blocks read back exactly, by both paths; NVMe-only ones over gRPC.
        check_all(row, client, shadow, must_survive=set(names))
        sink = bytearray(1 << 20)
        for name in in_dram:
            got = sink[: client.get_into(NS, name, sink) or 0]
            shadow.check(row, NS, name, bytes(got) if got else None)
        in_place = bytes(arena.view[lease.blocks[0].offset : lease.blocks[0].offset + (1 << 20)])
        shadow.check(row, NS, in_dram[0], in_place)
        assert client.lookup(NS, in_dram).tiers == ["dram"] * 8, "a leased block moved"

        arena.send(Op.RELEASE, pb.ReleaseRequest(lease_ids=[lease.lease_id]))
        wait_for(lambda: client.stats()["leases"] == 0, "release did not end the lease")
        for i in range(4):  # room again: new blocks push the released ones out
            put_checked(client, shadow, f"after{i}", 1 << 20, zero_copy=bool(i % 2))
        assert "dram" not in client.stat(NS, in_dram[0]).tiers  # type: ignore[union-attr]
        check_all(row, client, shadow, must_survive={*names, *(f"after{i}" for i in range(4))})
        row.serving = still_serves(client)
    assert not log_errors(daemon), log_errors(daemon)
    row.assert_ok()


# ---- no lockable memory ---------------------------------------------------------------------
def run_workload(
    row: Row, client: kvtier.Client, shadow: Shadow, tag: str, blocks: int
) -> set[str]:
    """`blocks` new 512 KiB blocks through both paths, then every one read back."""
    names: set[str] = set()
    sink = bytearray(512 << 10)
    for i in range(blocks):
        name = f"{tag}-{i:03d}"
        put_checked(client, shadow, name, 512 << 10, zero_copy=bool(i % 2))
        names.add(name)
    for i, name in enumerate(sorted(names)):
        if i % 2:
            size = client.get_into(NS, name, sink)
            shadow.check(row, NS, name, None if size is None else bytes(sink[:size]))
        else:
            shadow.check(row, NS, name, client.get(NS, name))
    return names


def memlock_limit(pid: int) -> str:
    limits = Path(f"/proc/{pid}/limits").read_text()
    match = re.search(r"^Max locked memory\s+(\S+)\s+(\S+)", limits, re.M)
    assert match, limits
    return f"{match.group(1)}:{match.group(2)}"


def test_no_lockable_memory(start_daemon: StartDaemon, report: Report) -> None:
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("prlimit (util-linux) is not installed")
    row = report.row(
        "pinned-memory limit (prlimit --memlock=0:0)",
        "the daemon started (and restarted) under prlimit --memlock=0:0",
    )
    daemon = start_daemon(dram="8MiB", nvme="128MiB", prefix=[prlimit, "--memlock=0:0"])
    shadow = Shadow()
    names: set[str] = set()
    for run in range(2):
        assert daemon.proc is not None
        assert memlock_limit(daemon.proc.pid) == "0:0"
        row.injected += 1
        with daemon.client() as client:
            check_all(row, client, shadow, must_survive=names)  # flushed at the clean stop
            names |= run_workload(row, client, shadow, f"run{run}", blocks=32)
            assert client.stats()["tiers"]["dram"]["evictions"] > 0
        daemon.restart()
    with daemon.client() as client:
        check_all(row, client, shadow, must_survive=names)
        row.serving = still_serves(client)
    assert not log_errors(daemon), log_errors(daemon)
    row.assert_ok()


# ---- a small memory cgroup -------------------------------------------------------------------
class MemoryCgroup:
    """A memory cgroup of our own (v1 or v2); `limit_bytes` may be set while it runs."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.version = version

    @property
    def limit_file(self) -> Path:
        return self.path / ("memory.limit_in_bytes" if self.version == 1 else "memory.max")

    def set_limit(self, limit_bytes: int) -> None:
        self.limit_file.write_text(str(limit_bytes))

    def usage_bytes(self) -> int:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return int((self.path / name).read_text())

    def peak_bytes(self) -> int:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        peak = self.path / name
        return int(peak.read_text()) if peak.exists() else self.usage_bytes()

    def limit_hits(self) -> int:
        if self.version == 1:
            return int((self.path / "memory.failcnt").read_text())
        events = (self.path / "memory.events").read_text()
        return int(re.search(r"^max (\d+)", events, re.M).group(1))  # type: ignore[union-attr]

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        match = re.search(r"^oom_kill (\d+)", (self.path / name).read_text(), re.M)
        return int(match.group(1)) if match else 0

    def holds(self, pid: int) -> bool:
        return str(pid) in (self.path / "cgroup.procs").read_text().split()

    def prefix(self) -> list[str]:
        """Run the command in this cgroup: a shell moves itself in, then execs it."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path)]


def _make_cgroup(name: str) -> MemoryCgroup:
    """Create a memory cgroup, or skip saying why not."""
    reasons = []
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        try:
            (v1 / name).mkdir()
            return MemoryCgroup(v1 / name, 1)
        except OSError as err:
            reasons.append(f"{v1}: {err.strerror}")
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        controllers = root / "cgroup.controllers"
        if not controllers.exists() or "memory" not in controllers.read_text().split():
            continue
        path = root / name
        try:
            path.mkdir()
        except OSError as err:
            reasons.append(f"{root}: {err.strerror}")
            continue
        if (path / "memory.max").exists():
            return MemoryCgroup(path, 2)
        path.rmdir()
        reasons.append(f"{root}: the memory controller is not enabled for its children")
    pytest.skip("cannot create a memory cgroup: " + ("; ".join(reasons) or "none mounted"))


@pytest.fixture
def cgroup() -> Iterator[MemoryCgroup]:
    group = _make_cgroup(f"kvtier-fault-{os.getpid()}")
    yield group
    for pid in (group.path / "cgroup.procs").read_text().split():
        # Only our daemon can be in it; kill it (it is ours) so the group can go.
        os.kill(int(pid), 9)
    deadline = time.monotonic() + 10
    while True:
        try:
            group.path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_small_memory_cgroup(
    start_daemon: StartDaemon, report: Report, cgroup: MemoryCgroup
) -> None:
    row = report.row(
        "small memory cgroup",
        "the daemon (16 MiB DRAM) in a memory cgroup limited to its measured need + 32 MiB, "
        "64 MiB of blocks through it, then restarted in it",
    )
    daemon = start_daemon(dram="16MiB", nvme="256MiB", prefix=cgroup.prefix())
    shadow = Shadow()
    with daemon.client() as client:
        names = run_workload(
            row, client, shadow, "warm", blocks=16
        )  # warm: arena, buffers, sessions
        need_bytes = cgroup.peak_bytes()
    limit_bytes = need_bytes + (32 << 20)
    cgroup.set_limit(limit_bytes)
    row.notes.append(f"measured {need_bytes >> 20} MiB, limit {limit_bytes >> 20} MiB")
    for run, restart in enumerate((False, True)):
        if restart:
            daemon.restart()
        assert daemon.proc is not None and cgroup.holds(daemon.proc.pid)
        row.injected += 1
        with daemon.client() as client:
            check_all(row, client, shadow, must_survive=names)
            names |= run_workload(row, client, shadow, f"run{run}", blocks=128)
            assert client.stats()["tiers"]["dram"]["evictions"] > 0
    with daemon.client() as client:
        check_all(row, client, shadow, must_survive=names)
        row.serving = still_serves(client)
    row.notes.append(
        f"peak {cgroup.peak_bytes() >> 20} MiB, limit hit {cgroup.limit_hits()} times, "
        f"oom kills {cgroup.oom_kills()}"
    )
    assert cgroup.oom_kills() == 0, row.notes
    assert not log_errors(daemon), log_errors(daemon)
    row.assert_ok()
