"""Disk I/O pool: blocking reads/writes run on threads (the GIL is released in the syscalls),
so several are in flight while the event loop keeps serving."""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

PAGE_BYTES = mmap.PAGESIZE


class IoPool:
    """A bounded pool of I/O threads; `await pool.run(fn, *args)` from the event loop."""

    def __init__(self, threads: int, name: str = "kvtier-io") -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=False)


def aligned_buffer(size_bytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned buffer (what O_DIRECT needs), of at least one page."""
    return mmap.mmap(-1, max(size_bytes, PAGE_BYTES))
