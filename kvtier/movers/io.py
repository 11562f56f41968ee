"""Disk I/O pool: blocking reads/writes run on threads (the GIL is released in the syscalls),
so several are in flight while the event loop keeps serving."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from kvtier.workers import lower_priority

P = ParamSpec("P")
T = TypeVar("T")


class IoPool:
    """A bounded pool of I/O threads; `await pool.run(fn, *args)` from the event loop.

    It knows how long each running job has been at it, so the watchdog can tell a wedged
    worker (a drive that stopped answering, a hung mount) from a busy one."""

    def __init__(self, threads: int, name: str = "kvtier-io") -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix=name, initializer=lower_priority
        )
        self._running: dict[int, tuple[float, str]] = {}  # job -> (started, what)
        self._next_job = 0
        self._lock = threading.Lock()

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: self._timed(fn, *args, **kwargs))

    async def run_timed(
        self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> tuple[T, float]:
        """`run`, with the seconds `fn` took on its thread: the device's service time,
        without the wait for a free thread (what a cost model of the device needs)."""
        spent_s = 0.0

        def timed() -> T:
            nonlocal spent_s
            started_s = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent_s = time.perf_counter() - started_s

        result = await self.run(timed)
        return result, spent_s

    def _timed(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        with self._lock:
            job = self._next_job
            self._next_job += 1
            self._running[job] = (time.monotonic(), getattr(fn, "__qualname__", repr(fn)))
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                del self._running[job]

    def longest_running(self) -> tuple[float, str] | None:
        """(seconds, function) of the job that has been running longest; None when idle."""
        with self._lock:
            if not self._running:
                return None
            started, what = min(self._running.values())
        return time.monotonic() - started, what

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=False)
