"""Shared fixtures: a real daemon process on a real socket, and reproducible block data."""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

import kvtier

# Property tests are judged by what they check, not by how long one example took: on a
# shared 2-core machine Hypothesis' default 200 ms deadline fails them at random.
settings.register_profile("kvtier", deadline=None)
settings.load_profile("kvtier")

_POOL = os.urandom(48 << 20)


def block_bytes(seed: int, size_bytes: int) -> bytes:
    """Distinct, reproducible bytes for block `seed` without holding every block in memory."""
    head = seed.to_bytes(8, "little")
    body = size_bytes - len(head)
    if body <= 0:
        return head[:size_bytes]
    start = (seed * 2_654_435_761) % (len(_POOL) - body + 1)
    return head + _POOL[start : start + body]


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for a daemon's metrics or gRPC listener)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class DaemonProcess:
    """`kvtier serve` in a child process; `target` is the address it printed."""

    def __init__(
        self,
        workdir: Path,
        args: list[str],
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.args = args
        self.env = env
        self.prefix = prefix or []  # e.g. prlimit or unshare, to run it under a fault
        self.clients: list[kvtier.Client] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = ""
        self.log_path = workdir / "daemon.log"
        self.banner = ""
        self._stdout = b""

    @property
    def nvme_path(self) -> Path:
        return self.workdir / "nvme"

    def start(self, timeout_s: float = 30.0, wait_recovered: bool = True) -> DaemonProcess:
        """Start it; return once it serves and (`wait_recovered`) its NVMe index is
        complete: the daemon serves while the index fills, its blocks misses till then."""
        env = dict(os.environ, **(self.env or {}))
        log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "kvtier", "serve", *self.args],
            stdout=subprocess.PIPE,
            stderr=log,
            bufsize=0,  # lines are read off the pipe here, none hidden in a buffer
            env=env,
        )
        log.close()
        self._stdout = b""
        banner = self._readline(timeout_s)
        if banner is None:
            self.kill()
            raise AssertionError(f"daemon did not start in {timeout_s} s:\n{self.log()}")
        self.banner = banner
        match = re.search(r"serving on (\S+)", self.banner)
        if not match:
            self.proc.wait(10)
            self._close_pipe()
            raise AssertionError(f"daemon failed to start: {self.banner!r}\n{self.log()}")
        self.target = match.group(1)
        if wait_recovered and "recovering its index" in self.banner:
            self.wait_recovered(timeout_s)
        return self

    def wait_recovered(self, timeout_s: float = 30.0) -> str:
        """The line the daemon prints once its NVMe index recovery has ended."""
        line = self._readline(timeout_s)
        if line is None or "NVMe index" not in line:
            self.kill()
            raise AssertionError(
                f"daemon failed to start: no end of its NVMe index recovery in {timeout_s} s "
                f"({line!r}):\n{self.log()}"
            )
        return line

    def _readline(self, timeout_s: float) -> str | None:
        """The next line the daemon prints ("" at end of output), None if none in time."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline_s = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._stdout:
                if not sel.select(max(0.0, deadline_s - time.monotonic())):
                    return None
                chunk = os.read(fd, 4096)
                if not chunk:
                    line, self._stdout = self._stdout, b""
                    return line.decode()
                self._stdout += chunk
        line, _, self._stdout = self._stdout.partition(b"\n")
        return line.decode() + "\n"

    def client(self, **kwargs: object) -> kvtier.Client:
        client = kvtier.Client(self.target, **kwargs)  # type: ignore[arg-type]
        self.clients.append(client)
        return client

    def close_clients(self) -> None:
        """Close every client `client()` made: a test that failed half-way must not leave
        a socket for the garbage collector to warn about in a later test."""
        for client in self.clients:
            client.close()
        self.clients.clear()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def terminate(self, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout_s)
        self._close_pipe()
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def restart(self) -> DaemonProcess:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
        return self.start()


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Short path: a UNIX socket path must fit in 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="kvt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_daemon(workdir: Path) -> Iterator[object]:
    """start_daemon(dram="64MiB", nvme="1GiB", listen=None, extra=[...], env=None,
    prefix=None, wait_recovered=True) -> DaemonProcess."""
    started: list[DaemonProcess] = []

    def start(
        dram: str = "128MiB",
        nvme: str = "1GiB",
        listen: str | None = None,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        wait_recovered: bool = True,
    ) -> DaemonProcess:
        args = [
            "--listen",
            listen or f"unix://{workdir / 'kvtier.sock'}",
            "--dram-capacity",
            dram,
            "--nvme-path",
            str(workdir / "nvme"),
            "--nvme-capacity",
            nvme,
            *(extra or []),
        ]
        daemon = DaemonProcess(workdir, args, env, prefix)
        started.append(daemon)
        return daemon.start(wait_recovered=wait_recovered)

    yield start
    for daemon in started:
        daemon.close_clients()
        daemon.kill()
