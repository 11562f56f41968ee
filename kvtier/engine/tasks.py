"""Tasks: work the store starts that must run to its end whoever awaits it.

Moving bytes for a call — a demotion, a flush, a promotion — runs on a task of its own even
when the call is cancelled (a client gone, a deadline passed): its I/O thread finishes
anyway, and the residency must learn of the record or the extent it produced (the soak
found orphan record files before this).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
K = TypeVar("K")


class Tasks:
    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._running)

    async def drain(self) -> None:
        """Wait for every task started, including those started meanwhile."""
        while self._running:
            await asyncio.gather(*list(self._running), return_exceptions=True)

    async def run_to_end(self, *works: Coroutine[Any, Any, T]) -> list[T]:
        """Await `works`, which go on to their end even if the caller is cancelled (a client
        gone, a deadline): each moves bytes on an I/O thread and then brings the residency
        in step, so one stopped half-way would leave a record on disk, or an extent, that
        nothing knows of."""
        return await asyncio.shield(asyncio.gather(*(self.spawn(w) for w in works)))

    def once(
        self,
        running: dict[K, asyncio.Future[T]],
        key: K,
        work: Callable[[], Coroutine[Any, Any, T]],
    ) -> asyncio.Future[T]:
        """One run of `work` per key at a time, shared by every caller and run to its end
        even when they are cancelled (it fills an extent on an I/O thread, which must end
        attached to its block or freed, never half-way)."""
        task = running.get(key)
        if task is None:
            task = self.spawn(work())
            running[key] = task
            task.add_done_callback(lambda _: running.pop(key, None))
        return asyncio.shield(task)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task
