"""The event loop kept awake for a moment after it answers on a session socket.

A loop with nothing to do sleeps in `epoll_wait`, and on a virtual machine its vCPU halts:
the next request's wake-up then costs tens of microseconds (the hypervisor must run the
vCPU again) before any of the request's work starts. A client that calls in a loop (an
engine's puts, gets and plans) sends its next request within a few hundred microseconds
of a reply. So after each reply the loop does not sleep for `window_s`: a callback that
schedules itself again makes every loop turn poll its selector without blocking, so the
next request, on any session or on gRPC, or an I/O completion is seen at once, and
everything else the loop serves runs as it would. Measured on the 2-vCPU VM (BENCHMARKS.md,
"The daemon's loop kept awake after a reply"): a 4 KiB put 0.6x the p50, a 256 KiB put
0.75x, a 256-block plan 0.7-0.8x, at a bounded cost: at most `window_s` of one CPU after
each reply.

Never while the host has no CPU to spare (`kvtier.hostload`): there the window's CPU is
taken from the clients and the host's other work. `window_s` 0: the loop always sleeps.
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
        self.kicks = 0  # windows opened or extended, for tests and curiosity

    def kick(self) -> None:
        if self.window_s <= 0 or host_busy():
            return
        self._until_s = time.perf_counter() + self.window_s
        self.kicks += 1
        if not self._ticking:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._ticking = True
            self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        # A ready callback makes the loop's next select non-blocking: one poll a turn.
        if time.perf_counter() < self._until_s and self._loop is not None:
            self._loop.call_soon(self._tick)
        else:
            self._ticking = False
