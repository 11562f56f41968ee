"""Whether a tier is fit to use: taken offline after repeated I/O errors, back after a probe.

Pure bookkeeping (the store does the I/O): a disk that fails every call should cost each
request a miss, not an error and a timeout, and should stop receiving writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class TierHealth:
    def __init__(
        self,
        name: str,
        offline_after_errors: int,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.offline_after_errors = offline_after_errors
        self._clock_s = clock_s
        self.online = True
        self.consecutive_errors = 0
        self.errors_total = 0
        self.offline_transitions = 0
        self.offline_since_s: float | None = None

    def failed(self, err: BaseException) -> bool:
        """Count an I/O error; True when this one took the tier offline."""
        self.errors_total += 1
        self.consecutive_errors += 1
        if not self.online or self.consecutive_errors < self.offline_after_errors:
            return False
        self.online = False
        self.offline_transitions += 1
        self.offline_since_s = self._clock_s()
        logger.error(
            "%s tier offline after %d consecutive I/O errors (last: %s); serving from the "
            "other tiers and probing it again",
            self.name,
            self.consecutive_errors,
            err,
        )
        return True

    def succeeded(self) -> None:
        self.consecutive_errors = 0

    def recovered(self) -> None:
        """A probe went through: use the tier again."""
        if self.online:
            return
        down_s = self._clock_s() - (self.offline_since_s or 0.0)
        logger.warning("%s tier back online after %.1f s offline", self.name, down_s)
        self.online = True
        self.consecutive_errors = 0
        self.offline_since_s = None
