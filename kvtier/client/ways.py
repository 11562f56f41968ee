"""Two ways to do one thing, chosen by what each took on this host: how the sync client
waits for a reply on its session socket (polling it, or asleep in recv), and whether a
large put is streamed (the daemon copying behind the client) or written whole first.

Neither way is right everywhere. A reply comes ~100-300 µs after its request, and on a
host with an idle CPU waking a thread asleep in recv is dear (on the 2-vCPU VM measured
here, ~40-60 µs of the daemon's send and as much again for the woken thread): polling
took a 256 KiB put from ~270 to ~205 µs p50. On a loaded host the poll takes a CPU the
daemon or other work needs (with one or two CPU-bound processes beside them, polling
every call made calls 1.1-2x slower). A streamed 4 MiB put overlaps the client's copy
and the daemon's, 1.6x faster here on the idle host, about even with two CPU-bound
processes beside it, and 3.9x slower than a whole one on a host loaded 12-fold
(BENCHMARKS.md, 2026-12-05 and issue 25's earlier sections).

So `TwoWays` keeps, per key (an op, a size class), a moving average of what each way took
and takes the one that took less, one call in `EXPLORE_EVERY` the other, to keep that
figure current. The dearer way (polling, streaming: each spends CPU waiting) is taken
only when it is clearly faster (by `MARGIN`); at a tie the cheap one. And never while
the host has no CPU to spare (`kvtier.hostload`: CPU pressure of 10 % or more, or the
quota throttled, else the load average; looked at once a second): what a way costs other
work there (the daemon's other calls, the host's other processes) is not in its own
figure, and with two CPU-bound processes beside it polling chosen by the figures alone
still made some calls' mean 1.2-1.6x the sleeping client's.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvtier.hostload import host_busy

SPIN_S = 300e-6  # the longest a reply is polled for before the client sleeps
EXPLORE_EVERY = 16
MARGIN = 0.95
_WEIGHT = 1 / 8  # of each new time in its way's moving average
_CLIP = 20.0  # a time over this many averages counts as this many (a stall, not the way)


class TwoWays:
    """Per key, the moving average of what the dear way and the cheap way took (0: not
    measured yet). `dear(key)` says which to take next; `took` is told what it took."""

    def __init__(self) -> None:
        # Per key: [dear way's average, cheap way's, calls counted] (a count per key: with
        # one for all, calls cycling through a few keys could always sample the same one).
        self._mean_s: dict[Hashable, list[float]] = {}

    def dear(self, key: Hashable) -> bool:
        if host_busy():
            return False
        means = self._mean_s.get(key)
        if means is None or not means[0]:
            return True  # measure each way once first
        if not means[1]:
            return False
        means[2] += 1
        faster = means[0] < means[1] * MARGIN
        return faster != (means[2] % EXPLORE_EVERY == 0)

    def took(self, key: Hashable, dear: bool, seconds: float) -> None:
        means = self._mean_s.setdefault(key, [0.0, 0.0, 0])
        way = 0 if dear else 1
        mean = means[way]
        if not mean:
            means[way] = seconds
            return
        means[way] = mean + _WEIGHT * (min(seconds, _CLIP * mean) - mean)

    def mean_s(self, key: Hashable) -> tuple[float, float]:
        """(dear, cheap) moving averages for `key` (0.0: not measured)."""
        dear, cheap, _ = self._mean_s.get(key, (0.0, 0.0, 0))
        return dear, cheap


class ReplyWait(TwoWays):
    """Per kind of call (an op, with the size class of what it moves): poll for the reply
    (the dear way) or sleep. `spin_s` 0: always asleep."""

    def __init__(self, spin_s: float = SPIN_S) -> None:
        super().__init__()
        self.spin_s = spin_s

    def polls(self, key: Hashable) -> bool:
        return self.spin_s > 0 and self.dear(key)
