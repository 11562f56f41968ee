"""The sd_notify helper against a datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kvtier.server.sdnotify import Notifier


def test_messages_arrive_as_newline_separated_fields(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(tmp_path / "notify"))
        notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "notify")})
        assert notifier.send(READY=1, STATUS="two\nlines")
        assert notifier.extend_timeout(1.5)
        assert systemd.recv(4096) == b"READY=1\nSTATUS=two lines"
        assert systemd.recv(4096) == b"EXTEND_TIMEOUT_USEC=1500000"
        notifier.close()


def test_abstract_socket_names_are_supported() -> None:
    name = f"kvtier-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind("\0" + name)
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.send(WATCHDOG=1)
        assert systemd.recv(4096) == b"WATCHDOG=1"
        notifier.close()


def test_without_systemd_nothing_is_sent_and_the_watchdog_is_off() -> None:
    notifier = Notifier.from_env({})
    assert not notifier.enabled and not notifier.send(READY=1)
    assert notifier.watchdog_interval_s == 0


def test_watchdog_interval_is_half_the_timeout_and_only_for_this_process() -> None:
    mine = Notifier.from_env({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())})
    assert mine.watchdog_interval_s == 1.5
    other = Notifier.from_env({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s == 0
    assert Notifier.from_env({"WATCHDOG_USEC": "soon"}).watchdog_interval_s == 0


def test_a_vanished_socket_is_not_an_error(tmp_path: Path) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert notifier.enabled and not notifier.send(READY=1)
    notifier.close()
