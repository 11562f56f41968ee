"""Whether this host has a CPU to spare, for the ways that spend one waiting (the client
polling for its reply, the daemon's loop kept awake after a reply): the 1-minute load
average at least the CPUs this process may use plus a half means busy, looked at once a
second. A busy host needs those CPUs for its work; what polling costs that work is not in
the poller's own figures."""

from __future__ import annotations

import os
import time

LOAD_CHECK_S = 1.0


class _Host:
    """Whether the host is busy, as of the last look."""

    looked_s = float("-inf")
    busy = False


def host_busy() -> bool:
    now = time.monotonic()
    if now - _Host.looked_s >= LOAD_CHECK_S:
        _Host.looked_s = now
        try:
            _Host.busy = os.getloadavg()[0] >= _cpus() + 0.5
        except OSError:  # no load average here: judge by the figures alone
            _Host.busy = False
    return _Host.busy


def _cpus() -> int:
    """The CPUs this process may run on (a container's or a pinned process's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
