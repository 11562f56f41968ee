"""Worker threads run below the event loop's priority (kvtier/workers.py): the daemon's I/O
pool threads, in process, and a real daemon's threads as an operator sees them in /proc."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.movers.io import IoPool
from kvtier.workers import WORKER_NICE_STEP, lower_priority
from tests.conftest import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_an_io_pool_thread_is_nicer_than_its_caller_and_the_caller_is_not() -> None:
    async def run() -> tuple[int, int]:
        pool = IoPool(2)
        return _own_nice(), await pool.run(_own_nice)

    caller, worker = asyncio.run(run())
    assert worker == min(caller + WORKER_NICE_STEP, 19)
    assert _own_nice() == caller


def test_lowering_stops_at_the_nicest_level() -> None:
    seen: list[int] = []

    def thrice() -> None:
        for _ in range(3):  # 0 -> 10 -> 19 -> 19
            lower_priority()
        seen.append(_own_nice())

    thread = threading.Thread(target=thrice)
    thread.start()
    thread.join()
    assert seen == [19]


def _thread_nice(pid: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # the thread ended
            continue
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice
    return out


def test_a_daemons_workers_run_below_its_event_loop(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="64MiB", nvme="256MiB")
    assert daemon.proc is not None
    pid = daemon.proc.pid
    with daemon.client() as client:
        client.put("t", b"k", b"x" * 4096)  # work for its threads besides what start did
    deadline = time.monotonic() + 10
    while True:
        nice = _thread_nice(pid)
        loop = nice[pid]  # the main thread runs the event loop
        workers = [n for tid, n in nice.items() if n != loop]
        if workers or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert workers, nice
    assert all(n == min(loop + WORKER_NICE_STEP, 19) for n in workers), nice
