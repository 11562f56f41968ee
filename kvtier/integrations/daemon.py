"""An engine's link to its kvtier daemon, shared by the engine connectors (vLLM, SGLang).

The engine's rule for a daemon that is down: skip kvtier (one warning per outage, and
one when it answers again) and try again after `retry_s`, never stalling a step on it.
Nothing here imports an engine.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import kvtier


class Outage:
    """Whether a daemon outage has been logged: shared by the links of one engine process
    side (a worker's and its saver's), so an outage is one warning, and so is the recovery."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged = False

    def flip(self, logged: bool) -> bool:
        """Set the state; True if that changed it (the caller logs)."""
        with self._lock:
            changed, self._logged = self._logged != logged, logged
            return changed


class DaemonLink:
    """One thread's client, made on first use. `client()` is None while the daemon is
    considered down (for `retry_s` after a failure): the caller skips kvtier then.

    Extra config keys: `target` (default $KVTIER_TARGET, else the daemon's default
    socket), `token` (default $KVTIER_TOKEN), `timeout_s` (2), `retry_s` (5)."""

    def __init__(
        self,
        extra: Mapping[str, Any],
        outage: Outage | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self._target = extra.get("target") or os.environ.get("KVTIER_TARGET")
        self._token = extra.get("token")
        self._timeout_s = float(extra.get("timeout_s", 2.0))
        self._retry_s = float(extra.get("retry_s", 5.0))
        self._client: kvtier.Client | None = None
        self._down_until_s = 0.0
        self.outage = outage or Outage()
        self._logger = logger or logging.getLogger(__name__)

    def client(self) -> kvtier.Client | None:
        if time.monotonic() < self._down_until_s:
            return None
        if self._client is None:
            self._client = kvtier.Client(self._target, timeout_s=self._timeout_s, token=self._token)
        return self._client

    def failed(self, doing: str, err: Exception) -> None:
        self._down_until_s = time.monotonic() + self._retry_s
        if self.outage.flip(True):
            self._logger.warning(
                "kvtier: could not %s (%s); recomputing instead, retrying every %.0f s",
                doing,
                err,
                self._retry_s,
            )
        if self._client is not None:
            self._client.close()
            self._client = None

    def succeeded(self) -> None:
        if self.outage.flip(False):
            self._logger.warning("kvtier: the daemon answers again")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
