"""Event-loop stalls, measured by a probe task that sleeps a short interval and records how
late it woke.

Everything in the daemon runs on one event loop, so a callback that keeps it (a full
garbage collection over millions of index objects, building the catalog at start, a long
synchronous scan) holds up every request for as long. Issue 22 asks for no stall over
20 ms at 10 M blocks; this is how that is measured, in production and by
benchmarks/scale.py.

Per wake-up the probe records the gap since its previous wake-up. No stall between two
wake-ups can be longer than that gap, so the longest gap (`stall_max_s`) is an upper bound
on the longest stall, `interval_s` coarse: an idle loop reads about `interval_s`. The
histogram holds each wake-up's lateness (gap − interval: about 0 when idle), the shape
Prometheus users expect of a loop-lag metric.

One monitor per process (the daemon has one loop): `start()` makes it, `running()` finds
it for the metrics endpoint and the Stats RPC. The recent maximum is "since the previous
Stats call": each call reads and resets it, so two pollers each see part of the stalls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.engine.telemetry import Histogram

PROBE_INTERVAL_S = 0.005  # 200 wake-ups a second: well under 1 % of a core


@dataclass(frozen=True, slots=True)
class LagReading:
    """Stall upper bounds (seconds between two probe wake-ups) since the monitor started and
    since the previous `read(reset_recent=True)`; `wakeups` counts probe wake-ups."""

    stall_max_s: float
    recent_stall_max_s: float
    wakeups: int


class LoopLag:
    """The probe's record. `observe` is the whole measurement (driven by `run`, or by a
    test with its own clock); `run` is the probe task itself."""

    def __init__(
        self, interval_s: float = PROBE_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self.lateness = Histogram()
        self._max_s = 0.0
        self._recent_max_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self.last_wake_s = clock()  # read by the stall tracer's thread (a float: atomic)
        # Told (start, end) of each gap over `listener_over_s` (stalltrace.py); None: off.
        self.listener: Callable[[float, float], None] | None = None
        self.listener_over_s = float("inf")

    def observe(self, gap_s: float) -> None:
        """One wake-up, `gap_s` after the previous one."""
        self.lateness.observe(max(0.0, gap_s - self.interval_s))
        if gap_s > self._max_s:
            self._max_s = gap_s
        if gap_s > self._recent_max_s:
            self._recent_max_s = gap_s

    def read(self, reset_recent: bool = False) -> LagReading:
        reading = LagReading(self._max_s, self._recent_max_s, self.lateness.count)
        if reset_recent:
            self._recent_max_s = 0.0
        return reading

    async def run(self) -> None:
        """Sleep, wake, record the gap; until cancelled."""
        last_s = self._clock()
        self.last_wake_s = last_s
        while True:
            await asyncio.sleep(self.interval_s)
            now_s = self._clock()
            self.last_wake_s = now_s
            self.observe(now_s - last_s)
            if self.listener is not None and now_s - last_s > self.listener_over_s:
                self.listener(last_s, now_s)
            last_s = now_s

    def start(self) -> None:
        """Run the probe on the running loop (it ends when the loop does, or `stop`)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="looplag")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


_running: LoopLag | None = None


def start(interval_s: float = PROBE_INTERVAL_S) -> LoopLag:
    """Start this process's monitor on the running loop (replacing any earlier one)."""
    global _running
    if _running is not None:
        _running.stop()
    _running = LoopLag(interval_s)
    _running.start()
    return _running


def running() -> LoopLag | None:
    """This process's monitor, if one was started."""
    return _running
