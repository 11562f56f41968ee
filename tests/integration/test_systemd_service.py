"""The daemon as systemd runs it: sd_notify readiness, watchdog, stop, reload (real process)."""

from __future__ import annotations

import itertools
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier.client._common import GetAssembler
from tests.conftest import DaemonProcess, block_bytes

StartDaemon = Callable[..., DaemonProcess]
NS = "m/systemd"


class NotifySocket:
    """What systemd would receive: every datagram, with the time it arrived."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.on_ready: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            if fields.get("READY") == "1" and self.on_ready is not None:
                self.on_ready()
            with self._lock:
                self.messages.append((time.monotonic(), fields))

    def times_of(self, key: str, value: str | None = None) -> list[float]:
        with self._lock:
            return [t for t, f in self.messages if key in f and (value is None or f[key] == value)]

    def values_of(self, key: str) -> list[str]:
        with self._lock:
            return [f[key] for _, f in self.messages if key in f]

    def wait_for(self, key: str, value: str | None = None, timeout_s: float = 20.0) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            times = self.times_of(key, value)
            if times:
                return times[0]
            time.sleep(0.02)
        raise AssertionError(f"no {key}={value or '*'} in {self.messages}")

    def close(self) -> None:
        self._closed = True
        self._sock.close()


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()


def _env(notify: NotifySocket, **extra: str) -> dict[str, str]:
    return {"NOTIFY_SOCKET": str(notify.path), **extra}


def test_ready_only_once_serving_then_watchdog_pings_and_status(
    start_daemon: StartDaemon, notify: NotifySocket, tmp_path: Path
) -> None:
    target = f"unix://{tmp_path / 'kvtier.sock'}"
    channel = grpc.insecure_channel(target)
    health = health_pb2_grpc.HealthStub(channel)
    seen_at_ready: list[int] = []

    def check_health() -> None:  # runs the moment READY=1 arrives
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        seen_at_ready.append(reply.status)

    notify.on_ready = check_health
    start_daemon(listen=target, env=_env(notify, WATCHDOG_USEC="300000"))
    ready_s = notify.wait_for("READY", "1")
    assert seen_at_ready == [health_pb2.HealthCheckResponse.SERVING]
    extended = notify.times_of("EXTEND_TIMEOUT_USEC")
    assert extended and max(extended) <= ready_s  # asked for time while starting, not after
    time.sleep(1.5)
    pings = [t for t in notify.times_of("WATCHDOG", "1") if t > ready_s]
    assert len(pings) >= 5, pings  # every 0.15 s
    assert max(b - a for a, b in itertools.pairwise(pings)) < 0.6
    assert any(v.startswith("serving: dram") for v in notify.values_of("STATUS"))
    channel.close()


def test_sigterm_lets_in_flight_gets_finish_and_a_restart_serves_every_block(
    start_daemon: StartDaemon, notify: NotifySocket
) -> None:
    daemon = start_daemon(dram="32MiB", nvme="1GiB", env=_env(notify))
    size = 8 << 20
    keys = [f"b{i}".encode() for i in range(12)]  # 96 MiB: most of them end up on NVMe
    with daemon.client() as client:
        for i, key in enumerate(keys):
            client.put(NS, key, block_bytes(i, size))
        tiers = client.lookup(NS, keys).tiers
        assert "nvme" in tiers and "dram" in tiers
        streams = [
            client._get(pb.GetRequest(namespace=NS, key=key), timeout=60)
            for key in keys[:6] + keys[-2:]
        ]
        assemblers = [GetAssembler() for _ in streams]
        for stream, out in zip(streams, assemblers, strict=True):
            out.feed(next(stream))  # every stream has started
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING", "1")
        for stream, out in zip(streams, assemblers, strict=True):
            for msg in stream:
                out.feed(msg)
        indices = [*range(6), 10, 11]
        for i, out in zip(indices, assemblers, strict=True):
            assert out.result() == block_bytes(i, size)
        with pytest.raises(kvtier.Unavailable):
            client.get(NS, keys[0])
    assert daemon.proc.wait(60) == 0
    assert any(v.startswith("stopping") for v in notify.values_of("STATUS"))
    restarted = start_daemon(dram="32MiB", nvme="1GiB")
    with restarted.client() as client:
        for i, key in enumerate(keys):
            assert client.get(NS, key) == block_bytes(i, size), key


def test_a_stuck_io_worker_stops_the_watchdog_pings(
    start_daemon: StartDaemon, notify: NotifySocket
) -> None:
    daemon = start_daemon(
        dram="1MiB",
        nvme="64MiB",
        env=_env(
            notify,
            WATCHDOG_USEC="200000",
            KVTIER_SERVER__IO_STALL_S="1",
            KVTIER_NVME__DIRECT_IO="false",
            KVTIER_PLANNER__CALIBRATION_S="0",
            # The first record read does not come back for 5 s, as on a dead drive or a
            # hung mount. (A FIFO in place of the record did this once; the tier no longer
            # waits on one: tests/faults/test_hostile_files.py.)
            KVTIER_FAILPOINTS="nvme.read=delay:5*1",
        ),
    )
    with daemon.client(timeout_s=60) as client:
        client.put(NS, b"a", block_bytes(1, 1 << 20))
        client.put(NS, b"b", block_bytes(2, 1 << 20))  # the 1 MiB arena pushes a to NVMe
        assert client.lookup(NS, [b"a"]).tiers == ["nvme"]
        notify.wait_for("WATCHDOG", "1")
        stuck = threading.Thread(target=lambda: client.get(NS, b"a"), daemon=True)
        started_s = time.monotonic()
        stuck.start()
        time.sleep(3.0)
        pings = notify.times_of("WATCHDOG", "1")
        # Pings went on until the read had been stuck for io_stall_s, then stopped.
        assert pings[-1] < started_s + 1.0 + 0.5, pings[-1] - started_s
        assert "an I/O worker has been stuck" in daemon.log()
        stuck.join(30)  # the read comes back; pings resume
        resumed_after = time.monotonic()
        time.sleep(1.0)
        assert [t for t in notify.times_of("WATCHDOG", "1") if t > resumed_after]
        assert client.get(NS, b"b") == block_bytes(2, 1 << 20)


def test_sighup_reloads_what_it_can_without_dropping_connections(
    start_daemon: StartDaemon, notify: NotifySocket, tmp_path: Path
) -> None:
    config = tmp_path / "kvtier.toml"
    config.write_text('[log]\nlevel = "info"\n[limits]\nmax_key_bytes = 128\n')
    daemon = start_daemon(extra=["--config", str(config)], env=_env(notify))
    with daemon.client() as client:
        long_key = b"k" * 40
        client.put_from(NS, long_key, block_bytes(1, 4096))
        session = client._arena
        assert session is not None
        config.write_text(
            '[log]\nlevel = "debug"\n[limits]\nmax_key_bytes = 32\n[nvme]\nio_threads = 2\n'
        )
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "reloaded" not in daemon.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        log = daemon.log()
        assert "reloaded limits.max_key_bytes, log.level" in log
        assert "needs a restart to take effect: nvme.io_threads" in log
        # The datagrams may still be on their way to the listener thread when the log
        # line is seen (the daemon sends RELOADING=1 before it logs, READY=1 after).
        reloading_s = notify.wait_for("RELOADING", "1")
        deadline = time.monotonic() + 20
        while max(notify.times_of("READY", "1")) <= reloading_s and time.monotonic() < deadline:
            time.sleep(0.02)
        assert max(notify.times_of("READY", "1")) > reloading_s
        # Same connection, same zero-copy session; the new limit applies to it at once.
        buf = bytearray(4096)
        with pytest.raises(kvtier.InvalidArgument, match="key"):
            client.get_into(NS, long_key, buf)
        client.put_from(NS, b"short", block_bytes(2, 4096))
        assert client.get_into(NS, b"short", buf) == 4096 and bytes(buf) == block_bytes(2, 4096)
        assert client._arena is session
        # A bad file is refused whole; the daemon keeps running on what it had.
        config.write_text("[limits]\nmax_key_bytes = -1\n")
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "reload refused" not in daemon.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "reload refused" in daemon.log()
        assert client.get(NS, b"short") == block_bytes(2, 4096)
