"""Failpoints: named places in the data path where the fault suite and the soak inject faults.

Off unless `KVTIER_FAILPOINTS` is set when the daemon starts; then it is a comma-separated
list of `point=action[@probability][*count]`, for example

    KVTIER_FAILPOINTS="nvme.read=eio@0.2,nvme.pwrite=short@0.5,store.evict=kill@0.01*1"

Actions: `eio`, `enospc`, `efbig` (raise that OSError where the real system call would),
`short` (the write transfers part of what it was given, as the kernel may), `kill`
(SIGKILL the daemon there), `delay:SECONDS`. `probability` defaults to 1 and `count`
(how many times it may fire) to unlimited. `KVTIER_FAILPOINTS_SEED` makes the draws
reproducible. Every firing is logged (`failpoint P fired: A`), which is how the fault suite
counts what it injected.

Points: nvme.write (before a record's temporary file is opened), nvme.pwrite (each write
call), nvme.rename (record written, not yet visible), nvme.read, nvme.remove,
nvme.tombstone, nvme.compact (a complete recovery about to remove the tombstone logs of
earlier runs), nvme.recover_fan (recovery about to scan one fan directory, on its thread: a
delay there is a slow scan, a kill a crash mid-recovery; in the segment layout: one
segment loaded), segment.seal (a segment's footer about to be written), segment.relocate
(reclaim about to copy one live record out of a segment), segment.reclaim (reclaim about
to delete emptied segments), store.evict (a block written to NVMe, its DRAM copy not yet
freed), store.commit (a put's bytes received, not yet in
the catalog), remote.get (a fetch from the remote tier, inside its timed read: a delay
there is a slow network to the planner).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass

from kvtier.errors import ConfigError

logger = logging.getLogger(__name__)

ENV_SPEC = "KVTIER_FAILPOINTS"
ENV_SEED = "KVTIER_FAILPOINTS_SEED"
POINTS = frozenset(
    {
        "nvme.write",
        "nvme.pwrite",
        "nvme.rename",
        "nvme.read",
        "nvme.remove",
        "nvme.tombstone",
        "nvme.compact",
        "nvme.recover_fan",
        "segment.seal",
        "segment.reclaim",
        "segment.relocate",
        "store.evict",
        "store.commit",
        "remote.get",
    }
)
_ERRNOS = {"eio": errno.EIO, "enospc": errno.ENOSPC, "efbig": errno.EFBIG}
_ACTIONS = frozenset({*_ERRNOS, "short", "kill", "delay"})


@dataclass(slots=True)
class _Failpoint:
    action: str
    probability: float
    remaining: int | None
    delay_s: float = 0.0


ACTIVE = False  # read at call sites so a disarmed daemon pays one global lookup
_points: dict[str, _Failpoint] = {}
_rng = random.Random()
_lock = threading.Lock()  # fired from I/O threads and the event loop alike


def parse(spec: str) -> dict[str, _Failpoint]:
    """`point=action[@p][*n],...` -> failpoints; ConfigError names the bad part."""
    out: dict[str, _Failpoint] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        point, sep, rest = part.partition("=")
        if not sep or point not in POINTS:
            raise ConfigError(
                f"{ENV_SPEC}: {part!r} must be point=action with point one of "
                f"{', '.join(sorted(POINTS))}"
            )
        rest, _, count_text = rest.partition("*")
        action_text, _, prob_text = rest.partition("@")
        action, _, arg = action_text.partition(":")
        try:
            probability = float(prob_text) if prob_text else 1.0
            remaining = int(count_text) if count_text else None
            delay_s = float(arg) if action == "delay" else 0.0
        except ValueError:
            raise ConfigError(f"{ENV_SPEC}: {part!r} has a malformed number") from None
        if action not in _ACTIONS or not 0.0 <= probability <= 1.0:
            raise ConfigError(
                f"{ENV_SPEC}: {part!r}: action must be one of {', '.join(sorted(_ACTIONS))} "
                "and the probability within [0, 1]"
            )
        out[point] = _Failpoint(action, probability, remaining, delay_s)
    return out


def configure(spec: str | None = None, seed: int | None = None) -> None:
    """Arm the failpoints `spec` names (default: from the environment)."""
    global ACTIVE
    if spec is None:
        spec = os.environ.get(ENV_SPEC, "")
        seed_text = os.environ.get(ENV_SEED)
        seed = int(seed_text) if seed_text else None
    _points.clear()
    _points.update(parse(spec))
    _rng.seed(seed)
    ACTIVE = bool(_points)
    if ACTIVE:
        logger.warning("failpoints armed (%s=%s): faults will be injected", ENV_SPEC, spec)


def fire(point: str) -> str | None:
    """Inject `point`'s fault if it draws one: raises, kills or sleeps for the actions that
    do, and returns the action (or None) so a call site can act out `short` itself."""
    fp = _points.get(point)
    if fp is None:
        return None
    with _lock:
        if fp.remaining == 0 or _rng.random() >= fp.probability:
            return None
        if fp.remaining is not None:
            fp.remaining -= 1
    logger.warning("failpoint %s fired: %s", point, fp.action)
    if fp.action == "kill":
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if fp.action == "delay":
        time.sleep(fp.delay_s)
    code = _ERRNOS.get(fp.action)
    if code is not None:
        raise OSError(code, f"{os.strerror(code)} (failpoint {point})")
    return fp.action
