"""systemd's notification protocol (sd_notify(3)): readiness, status, watchdog, stopping.

A datagram of newline-separated `KEY=VALUE` lines to the socket named by `$NOTIFY_SOCKET`
(a path, or an abstract name written with a leading '@'). Without that variable (not run
by systemd with Type=notify) every call does nothing. The protocol is a few lines of
socket code; libsystemd's Python binding would add a C dependency for them.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

logger = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int = 0) -> None:
        self._address = "\0" + address[1:] if address and address.startswith("@") else address
        self._sock: socket.socket | None = None
        self.watchdog_usec = watchdog_usec
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        watchdog_usec = 0
        # WATCHDOG_PID, when set, names the process the watchdog is for (not a child).
        if env.get("WATCHDOG_USEC") and env.get("WATCHDOG_PID", str(os.getpid())) == str(
            os.getpid()
        ):
            try:
                watchdog_usec = max(0, int(env["WATCHDOG_USEC"]))
            except ValueError:
                logger.warning("ignoring WATCHDOG_USEC=%r: not a number", env["WATCHDOG_USEC"])
        return cls(address, watchdog_usec)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def watchdog_interval_s(self) -> float:
        """How often to ping: half the watchdog timeout, as sd_watchdog_enabled(3) advises;
        0 when systemd set no watchdog."""
        return self.watchdog_usec / 2e6

    def send(self, **fields: str | int) -> bool:
        """Send KEY=VALUE lines (e.g. READY=1, STATUS=...); False if it could not be sent."""
        if self._sock is None or self._address is None:
            return False
        message = "\n".join(f"{key}={_one_line(value)}" for key, value in fields.items())
        try:
            self._sock.sendto(message.encode(), self._address)
        except OSError as err:
            logger.debug("sd_notify to %s failed: %s", self._address, err)
            return False
        return True

    def extend_timeout(self, seconds: float) -> bool:
        """Ask systemd for `seconds` more before it gives up on a start or stop step."""
        return self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _one_line(value: str | int) -> str:
    return str(value).replace("\n", " ")
