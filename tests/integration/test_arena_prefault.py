"""The client populates its read-only arena mapping in the background at attach, so a
get's first read of a page does not fault (issue 25); above PREFAULT_MAX_BYTES it does not."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import pytest

import kvtier.client.zerocopy as zerocopy
from tests.conftest import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]
ARENA_BYTES = 64 << 20


def arena_rss_bytes() -> int:
    """Resident bytes of this process's mappings of a kvtier arena memfd."""
    rss_kib, in_arena = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:
                in_arena = "kvtier-dram" in line
            elif in_arena and fields[0] == "Rss:":
                rss_kib += int(fields[1])
    return rss_kib << 10


@pytest.mark.parametrize("prefault", [True, False], ids=["prefaulted", "over-the-cap"])
def test_the_arena_mapping_is_populated_in_the_background(
    start_daemon: StartDaemon, monkeypatch: pytest.MonkeyPatch, prefault: bool
) -> None:
    monkeypatch.setattr(zerocopy, "PREFAULT_MAX_BYTES", ARENA_BYTES if prefault else 0)
    daemon = start_daemon(dram="64MiB", nvme="64MiB")
    gc.collect()  # mappings of clients other tests left behind: counted before, not here
    before = arena_rss_bytes()
    with daemon.client() as client:
        assert client._shared_arena() is not None
        deadline = time.monotonic() + 20
        while prefault and arena_rss_bytes() - before < ARENA_BYTES * 0.9:
            assert time.monotonic() < deadline, f"only {arena_rss_bytes() - before} bytes mapped"
            time.sleep(0.05)
        if not prefault:
            time.sleep(0.5)  # what a populating thread would have done by now
            assert arena_rss_bytes() - before < ARENA_BYTES // 4
