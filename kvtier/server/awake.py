"""The event loop kept awake for a moment after it answers on a session socket.

A loop with nothing to do sleeps in `epoll_wait`, and on a virtual machine its vCPU halts:
the next request's wake-up then costs tens of microseconds (the hypervisor must run the
vCPU again) before any of the request's work starts. A client that calls in a loop (an
engine's puts, gets and plans) sends its next request within a few hundred microseconds
of a reply. So after each reply the loop does not sleep for `window_s`: a callback that
schedules itself again makes every loop turn poll its selector without blocking, so the
next request on any session is seen at once, and every other callback and timer runs as
it would. Measured on the 2-vCPU VM (BENCHMARKS.md, "The daemon's loop kept awake after a
reply"): a 4 KiB put 0.6x the p50, a 256 KiB put 0.75x, a 256-block plan 0.7-0.8x.

The cost is bounded: at most `window_s` of one CPU a reply (`kick` returns what it added,
counted in the side socket's metrics), and never while the host has no CPU to spare
(`kvtier.hostload`), where that CPU is taken from the clients and the host's other work.
Between polls the loop takes the GIL back at once, so a thread waiting for it (an I/O
completion) may wait until the window ends or a switch interval passes. `window_s` 0:
the loop always sleeps.
"""

from __future__ import annotations

import asyncio
import time

from kvtier.hostload import host_busy


class LoopAwake:
    """`kick()` after a reply: the running loop polls instead of sleeping until
    `window_s` from now (a later kick extends it)."""

    def __init__(self, window_s: float = 0.0) -> None:
        self.window_s = window_s
        self._until_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticking = False

    def kick(self) -> float:
        """Open or extend the window; the seconds of polling this added (0.0 if none)."""
        if self.window_s <= 0 or host_busy():
            return 0.0
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a first kick, or a loop that ended with a window open
            self._loop, self._ticking = loop, False
        now_s = time.perf_counter()
        until_s = now_s + self.window_s
        added_s = until_s - max(self._until_s, now_s)
        self._until_s = until_s
        if not self._ticking:
            self._ticking = True
            loop.call_soon(self._tick, loop)
        return added_s

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        # A ready callback makes the loop's next select non-blocking: one poll a turn.
        if time.perf_counter() < self._until_s:
            loop.call_soon(self._tick, loop)
        else:
            self._ticking = False
