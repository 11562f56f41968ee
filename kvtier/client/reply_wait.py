"""How the sync client waits for a reply on its session socket: polling the socket for up
to `spin_s`, or asleep in recv. Chosen per kind of request (op) by what each way took.

A reply comes ~100-300 µs after its request. A thread asleep in recv must be woken for it,
and on a host with an idle CPU that wake-up is dear: on the 2-vCPU VM measured here it
cost the daemon's send ~40-60 µs and the woken thread as long again, and polling took a
256 KiB put from ~245 to ~185 µs p50 (BENCHMARKS.md, 2026-12-05). On a loaded host it is
the other way: the poll takes a CPU the daemon or other work needs (with one or two
CPU-bound processes beside them, polling made those calls 1.1-2x slower). Neither is
right everywhere, so the client measures both: the way that has taken less (a moving
average per op) is used, and one call in `EXPLORE_EVERY` waits the other way to keep
that way's figure current. Polling is chosen only when clearly faster (by `MARGIN`): at
a tie, sleeping costs no CPU. A poll that runs out (a large put, a promotion from NVMe)
falls back to sleeping and counts as what it took.
"""

from __future__ import annotations

SPIN_S = 300e-6
EXPLORE_EVERY = 16
MARGIN = 0.95
_WEIGHT = 1 / 8  # of each new time in its way's moving average
_CLIP = 4.0  # a time over this many averages counts as this many (a preemption, not the way)


class ReplyWait:
    """Per op, the moving average of what a wait took polling and asleep (0: not measured
    yet); `polls(op)` says how to wait for the next reply, `took` is told what it took."""

    def __init__(self, spin_s: float = SPIN_S) -> None:
        self.spin_s = spin_s  # 0: always asleep
        self._mean_s: dict[int, list[float]] = {}
        self._calls = 0

    def polls(self, op: int) -> bool:
        if self.spin_s <= 0:
            return False
        means = self._mean_s.get(op)
        if means is None or not means[0]:
            return True  # measure each way once first
        if not means[1]:
            return False
        self._calls += 1
        faster = means[0] < means[1] * MARGIN
        return faster != (self._calls % EXPLORE_EVERY == 0)

    def took(self, op: int, polled: bool, seconds: float) -> None:
        means = self._mean_s.setdefault(op, [0.0, 0.0])
        way = 0 if polled else 1
        mean = means[way]
        if not mean:
            means[way] = seconds
            return
        means[way] = mean + _WEIGHT * (min(seconds, _CLIP * mean) - mean)

    def mean_s(self, op: int) -> tuple[float, float]:
        """(polling, asleep) moving averages for `op` (0.0: not measured)."""
        polled, slept = self._mean_s.get(op, (0.0, 0.0))
        return polled, slept
