"""Hostile local users against the zero-copy side socket (`<sock>.arena`), issue 28 items 1
and 6: fd exhaustion, connections that never present a nonce, pipelined requests whose
replies are never read, oversize frames, and more sessions than a tenant may hold.

Each row runs a real daemon with two tenants: the victim (alice) reads its blocks through
the shared arena before and during the attack (p50/p99 in the row's notes, every byte
checked with the Shadow), the attacker (mallory, or nobody: the socket needs no token to
connect) uses raw sockets and raw gRPC calls. After the attacker goes, the daemon must
give back what it held (fds, sessions) and new zero-copy attaches must work.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import struct
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier._session import HEADER, Op, frame
from kvtier.keys import hash_token
from tests.conftest import DaemonProcess, block_bytes
from tests.faults.harness import Report, Row, Shadow, check_all, still_serves, wait_for

StartDaemon = Callable[..., DaemonProcess]
NS = "faults/hostile-socket"
TOKENS = {"alice": "alice-secret-token-1", "mallory": "mallory-secret-token-2"}
BLOCK_BYTES = 64 << 10
MAX_SESSIONS = 4
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def config_text(max_sessions: int = MAX_SESSIONS) -> str:
    return (
        "[auth.tokens]\n"
        + "".join(f'"{hash_token(t)}" = "{n}"\n' for n, t in TOKENS.items())
        + '[tenants.alice]\ndram_capacity_bytes = "16MiB"\nnvme_capacity_bytes = "64MiB"\n'
        + '[tenants.mallory]\ndram_capacity_bytes = "16MiB"\nnvme_capacity_bytes = "64MiB"\n'
        + f'[limits]\nmax_sessions_per_tenant = {max_sessions}\nsession_buffer_bytes = "1MiB"\n'
    )


class Hostile(DaemonProcess):
    metrics_port: int


@pytest.fixture
def hostile(start_daemon: StartDaemon, workdir: Path) -> Callable[..., Hostile]:
    """hostile(prefix=[...]) -> a two-tenant daemon (its config: workdir/hostile.toml)
    with its metrics on `metrics_port`."""

    def start(prefix: list[str] | None = None) -> Hostile:
        config = workdir / "hostile.toml"
        config.write_text(config_text())
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        extra = ["--config", str(config), "--metrics-listen", f"127.0.0.1:{port}"]
        daemon = start_daemon(dram="32MiB", nvme="256MiB", extra=extra, prefix=prefix)
        daemon.metrics_port = port
        return daemon  # type: ignore[no-any-return]

    return start


def side_metrics(daemon: Hostile) -> dict[str, float]:
    """The kvtier_session_socket_* samples, by name without the prefix."""
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        sample.name.removeprefix("kvtier_session_socket_"): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("kvtier_session_socket_")
    }


# ---- the victim ----------------------------------------------------------------------------
class Victim:
    """alice, attached to her arena, with a working set she reads back and checks."""

    def __init__(self, daemon: DaemonProcess, row: Row) -> None:
        self.client = daemon.client(token=TOKENS["alice"])
        self.row = row
        self.shadow = Shadow()
        self.keys = [f"v{i}" for i in range(16)]
        items = [(k, block_bytes(7_000 + i, BLOCK_BYTES)) for i, k in enumerate(self.keys)]
        self.client.put_many(NS, items)
        for key, data in items:
            self.shadow.put(NS, key, data, acknowledged=True)
        assert self.client._arena is not None, "the victim is not on the zero-copy path"
        self.buf = bytearray(BLOCK_BYTES)

    def timed_gets(self, n: int = 40) -> list[float]:
        """`n` zero-copy gets of its blocks, each checked; their times in seconds."""
        times_s = []
        for i in range(n):
            key = self.keys[i % len(self.keys)]
            started = time.perf_counter()
            got = self.client.get_into(NS, key, self.buf)
            times_s.append(time.perf_counter() - started)
            self.shadow.check(self.row, NS, key, None if got is None else bytes(self.buf[:got]))
        assert self.client._arena is not None, "the victim fell back to gRPC"
        return times_s

    def finish(self) -> None:
        check_all(self.row, self.client, self.shadow, must_survive=set(self.keys))
        self.row.serving = still_serves(self.client)
        self.client.close()


def p50_p99(times_s: list[float]) -> tuple[float, float]:
    return statistics.median(times_s), statistics.quantiles(times_s, n=100)[98]


def judge_latency(row: Row, alone_s: list[float], attacked_s: list[float]) -> None:
    """Note the victim's p50/p99 alone and under attack; fail if the attack shows."""
    (a50, a99), (d50, d99) = p50_p99(alone_s), p50_p99(attacked_s)
    row.notes.append(
        f"victim zero-copy get p50/p99: {a50 * 1e3:.2f}/{a99 * 1e3:.2f} ms alone, "
        f"{d50 * 1e3:.2f}/{d99 * 1e3:.2f} ms during the attack"
    )
    # Loose for 2 busy cores, far under what an attack that starves the loop costs.
    assert d50 < max(5 * a50, 0.05) and d99 < max(10 * a99, 0.25), row.notes[-1]


def fresh_attach(daemon: DaemonProcess, victim: Victim) -> tuple[bool, float]:
    """A new alice client's first zero-copy get: (attached, seconds it took)."""
    with daemon.client(token=TOKENS["alice"]) as fresh:
        return first_get(fresh, victim)


def first_get(client: kvtier.Client, victim: Victim) -> tuple[bool, float]:
    """`client`'s first get_into (which attaches it), checked: (attached, seconds)."""
    data = bytearray(BLOCK_BYTES)
    started = time.perf_counter()
    got = client.get_into(NS, victim.keys[0], data)
    took_s = time.perf_counter() - started
    victim.shadow.check(victim.row, NS, victim.keys[0], None if got is None else bytes(data))
    return client._arena is not None, took_s


# ---- the daemon, seen from outside --------------------------------------------------------
def pid_of(daemon: DaemonProcess) -> int:
    assert daemon.proc is not None
    return daemon.proc.pid


def open_fds(daemon: DaemonProcess) -> int:
    return len(os.listdir(f"/proc/{pid_of(daemon)}/fd"))


def rss_bytes(daemon: DaemonProcess) -> int:
    with open(f"/proc/{pid_of(daemon)}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def settled_rss_bytes(daemon: DaemonProcess, timeout_s: float = 20.0) -> int:
    """RSS once it stops growing (two samples 0.5 s apart within 1 MiB)."""
    deadline = time.monotonic() + timeout_s
    last = rss_bytes(daemon)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = rss_bytes(daemon)
        if abs(now - last) < 1 << 20:
            return now
        last = now
    return last


def socket_paths(daemon: DaemonProcess) -> tuple[str, str]:
    grpc_path = daemon.target.removeprefix("unix://")
    return grpc_path, grpc_path + ".arena"


def connect_nowait(path: str) -> socket.socket | None:
    """A connection that sends nothing; None while the listener's backlog is full."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(path)
    except BlockingIOError:
        s.close()
        return None
    return s


def closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False  # open, nothing to read
    except ConnectionError:
        return True


# ---- the attacker's raw sessions ------------------------------------------------------------
class RawSession:
    """mallory's side connection, attached with a raw gRPC Attach and spoken frame by frame."""

    def __init__(self, stub: pb_grpc.KVTierStub, connect: bool = True) -> None:
        md = [("authorization", f"Bearer {TOKENS['mallory']}")]
        self.attach = stub.Attach(pb.AttachRequest(), metadata=md, timeout=10)
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.settimeout(10)
        if connect:
            self.conn.connect(self.attach.arena_socket)
            self.conn.sendall(self.attach.nonce)
            msg, fds, _, _ = socket.recv_fds(self.conn, 16, 2)
            for fd in fds:
                os.close(fd)
            assert len(msg) == 16 and fds, "the daemon refused mallory's nonce"
            self.session_id = struct.unpack("<QQ", msg)[0]

    def reply(self) -> tuple[int, bytes]:
        length, code = HEADER.unpack(self._recv(HEADER.size))
        return code, self._recv(length)

    def _recv(self, size: int) -> bytes:
        out = bytearray()
        while len(out) < size:
            part = self.conn.recv(size - len(out))
            if not part:
                raise ConnectionError("the daemon closed the session")
            out += part
        return bytes(out)

    def close(self) -> None:
        self.conn.close()


@contextmanager
def mallory(daemon: DaemonProcess) -> Iterator[pb_grpc.KVTierStub]:
    channel = grpc.insecure_channel(daemon.target)
    try:
        yield pb_grpc.KVTierStub(channel)
    finally:
        channel.close()


def plan_frame(blocks: int, keys: int = 0) -> bytes:
    """A Plan whose reply carries three numbers per block: ~17 bytes of reply each."""
    request = pb.PlanRequest(
        namespace=NS,
        keys=[f"mallory-{i:08d}".encode() for i in range(keys)],
        tokens_per_block=16,
        prompt_tokens=16 * blocks,
    )
    return frame(Op.PLAN, request.SerializeToString())


# ---- the rows ------------------------------------------------------------------------------
def test_fd_exhaustion_does_not_end_zero_copy(
    hostile: Callable[..., Hostile], report: Report
) -> None:
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        pytest.skip("prlimit (util-linux) is not installed")
    row = report.row(
        "fd exhaustion (EMFILE) at the side socket",
        "daemon under prlimit --nofile=256; no-token connections to the gRPC socket and "
        "<sock>.arena, sending nothing, until accept() fails with EMFILE",
    )
    daemon = hostile(prefix=[prlimit, "--nofile=256", "--"])
    victim = Victim(daemon, row)
    alone_s = victim.timed_gets()
    racing = daemon.client(token=TOKENS["alice"])
    racing.stats()  # its gRPC connection, before the attack
    baseline_fds = open_fds(daemon)
    grpc_path, arena_path = socket_paths(daemon)
    flood: list[socket.socket] = []

    def fill(path: str, want: int, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(flood) < want and time.monotonic() < deadline:
            s = connect_nowait(path)
            if s is None:  # backlog full: the daemon is out of fds, or catching up
                if open_fds(daemon) >= 250:
                    return
                time.sleep(0.01)
            else:
                flood.append(s)

    racer: threading.Thread | None = None
    try:
        fill(grpc_path, 400)
        # gRPC accepts its backlog on its own thread: the side socket's flood must arrive
        # once every fd is taken, or its accepts succeed (and it sheds the oldest) instead
        # of failing.
        wait_for(lambda: open_fds(daemon) >= 250, "the daemon never ran out of fds", 20)
        fill(arena_path, len(flood) + 100)  # fewer than its backlog: the racer gets a place
        # The side socket's accept failed: logged by it (or, unfixed, by asyncio as the
        # exception that ended its accept loop).
        wait_for(
            lambda: "Too many open files" in daemon.log(),
            "the side socket never hit the fd limit:\n" + daemon.log()[-2000:],
            20,
        )
        row.injected = len(flood)
        row.notes.append(f"daemon fds {baseline_fds} before, {open_fds(daemon)} (max) during")
        attacked_s = victim.timed_gets()  # an attached session needs no new fd
        # An attach racing the exhaustion (over a gRPC connection made before it) waits
        # in the side socket's backlog until fds are free, then gets in.
        raced: list[tuple[bool, float]] = []
        racer = threading.Thread(target=lambda: raced.append(first_get(racing, victim)))
        racer.start()
        time.sleep(1.0)
    finally:
        for s in flood:
            s.close()
        if racer is not None:
            racer.join(30)
        racing.close()  # also when the attack failed: its socket must not outlive the test
    assert raced and raced[0][0], f"an attach racing the exhaustion never got in: {raced}"
    wait_for(lambda: open_fds(daemon) <= baseline_fds + 2, "fds not given back", 20)
    attached, took_s = fresh_attach(daemon, victim)
    assert attached, "no zero-copy attach after the attack:\n" + daemon.log()[-2000:]
    metrics = side_metrics(daemon)
    assert metrics["accept_errors_total"] > 0 and metrics["accepting"] == 1, metrics
    row.notes.append(
        f"attach racing the exhaustion got in after {raced[0][1]:.1f} s; a new one after "
        f"it took {took_s * 1e3:.1f} ms; accept errors logged, the loop kept serving"
    )
    judge_latency(row, alone_s, attacked_s)
    victim.finish()
    row.assert_ok()


def test_connections_that_never_send_a_nonce(
    hostile: Callable[..., Hostile], report: Report
) -> None:
    row = report.row(
        "side-socket connections that never send a nonce",
        "3000 no-token connections to <sock>.arena, opened as fast as they are accepted "
        "and never written to",
    )
    daemon = hostile()
    victim = Victim(daemon, row)
    alone_s = victim.timed_gets()
    baseline_fds = open_fds(daemon)
    _, arena_path = socket_paths(daemon)
    flood: list[socket.socket] = []
    stop = threading.Event()

    def attack() -> None:
        while not stop.is_set() and len(flood) < 3000:
            s = connect_nowait(arena_path)
            if s is None:
                time.sleep(0.001)
            else:
                flood.append(s)

    attacker = threading.Thread(target=attack)
    attacker.start()
    peak_fds = 0
    try:
        wait_for(lambda: len(flood) >= 1000, "the attacker could not connect", 20)
        peak_fds = max(peak_fds, open_fds(daemon))
        attached, took_s = fresh_attach(daemon, victim)  # during the flood
        attacked_s = victim.timed_gets()
        peak_fds = max(peak_fds, open_fds(daemon))
    finally:
        stop.set()
        attacker.join(30)
        shed = sum(closed_by_peer(s) for s in flood)
        for s in flood:
            s.close()
    row.injected = len(flood)
    row.notes.append(
        f"{len(flood)} connections, {shed} closed by the daemon before their 5 s "
        f"handshake timeout; daemon fds {baseline_fds} before, at most {peak_fds} during; "
        f"a new attach during the flood took {took_s * 1e3:.1f} ms"
    )
    assert attached, "a zero-copy attach during the flood failed"
    # At most MAX_HANDSHAKING (256) waiting, plus the fresh client's few.
    assert peak_fds <= baseline_fds + 256 + 16, row.notes[-1]
    wait_for(lambda: open_fds(daemon) <= baseline_fds + 2, "fds not given back", 20)
    assert fresh_attach(daemon, victim)[0], "no zero-copy attach after the flood"
    assert side_metrics(daemon)["handshakes_shed_total"] >= shed
    judge_latency(row, alone_s, attacked_s)
    victim.finish()
    row.assert_ok()


def test_pipelined_requests_whose_replies_are_never_read(
    hostile: Callable[..., Hostile], report: Report
) -> None:
    row = report.row(
        "side-socket requests pipelined, replies never read",
        "2 sessions of one tenant each send 3000 Plan requests (~35 KB of reply each, "
        "~1 KB of request) without reading a reply; limits.session_buffer_bytes = 1 MiB",
    )
    daemon = hostile()
    victim = Victim(daemon, row)
    alone_s = victim.timed_gets()
    baseline_fds = open_fds(daemon)
    request = plan_frame(2048, keys=64)
    with mallory(daemon) as stub:
        sessions = [RawSession(stub) for _ in range(2)]
        rss_before = settled_rss_bytes(daemon)
        sent = [0] * len(sessions)
        blocked = [False] * len(sessions)

        def pipeline(i: int) -> None:
            sessions[i].conn.settimeout(3)
            try:
                for _ in range(3000):
                    sessions[i].conn.sendall(request)
                    sent[i] += 1
            except TimeoutError:
                blocked[i] = True  # the daemon stopped reading this session

        senders = [threading.Thread(target=pipeline, args=(i,)) for i in range(len(sessions))]
        for t in senders:
            t.start()
        time.sleep(1.0)
        attacked_s = victim.timed_gets()
        for t in senders:
            t.join(120)
        rss_during = settled_rss_bytes(daemon)
        attacked_s += victim.timed_gets()
        row.injected = sum(sent)
        growth = rss_during - rss_before
        row.notes.append(
            f"{sum(sent)} requests sent before the daemon stopped reading "
            f"(senders blocked: {sum(blocked)}/{len(sessions)}); daemon RSS "
            f"+{growth / 2**20:.1f} MiB"
        )
        for s in sessions:
            s.close()
    assert growth < 32 << 20, row.notes[-1]
    assert all(blocked), row.notes[-1]
    wait_for(lambda: open_fds(daemon) <= baseline_fds, "the sessions' fds not given back", 20)
    judge_latency(row, alone_s, attacked_s)
    assert victim.client.stats()["leases"] == 0
    metrics = side_metrics(daemon)
    assert metrics["read_pauses_total"] >= 2 and metrics["sessions_paused"] == 0, metrics
    assert metrics["sessions"] == 1, metrics  # the victim's
    assert fresh_attach(daemon, victim)[0]
    victim.finish()
    row.assert_ok()


def test_oversize_frames(hostile: Callable[..., Hostile], report: Report) -> None:
    row = report.row(
        "side-socket frames over their op's cap",
        "a frame header declaring 4 GiB; 3 sessions declaring 48 MiB Commit frames and "
        "sending 40 MiB of them",
    )
    daemon = hostile()
    victim = Victim(daemon, row)
    alone_s = victim.timed_gets()
    baseline_fds = open_fds(daemon)
    declared, streamed = 48 << 20, 40 << 20
    with mallory(daemon) as stub:
        huge = RawSession(stub)
        huge.conn.sendall(HEADER.pack(0xFFFFFFFF, Op.PLAN))
        assert huge.conn.recv(1) == b"", "a 4 GiB frame header did not end the session"
        huge.close()
        row.injected += 1
        sessions = [RawSession(stub) for _ in range(3)]
        rss_before = settled_rss_bytes(daemon)
        for s in sessions:
            s.conn.sendall(HEADER.pack(declared, Op.COMMIT))
            code, message = s.reply()  # refused at once, not after 48 MiB
            assert code == RESOURCE_EXHAUSTED and b"limits.max_plan_blocks" in message, message
            row.injected += 1
        junk = b"\x00" * (1 << 20)

        def stream(s: RawSession) -> None:
            for _ in range(streamed // len(junk)):
                s.conn.sendall(junk)

        streamers = [threading.Thread(target=stream, args=(s,)) for s in sessions]
        for t in streamers:
            t.start()
        attacked_s = victim.timed_gets()
        for t in streamers:
            t.join(120)
        growth = settled_rss_bytes(daemon) - rss_before
        # The rest of the refused frame, then a well-formed request: answered as usual.
        for s in sessions:
            s.conn.sendall(b"\x00" * (declared - streamed) + plan_frame(4))
            assert s.reply()[0] == 0
            s.close()
    row.notes.append(
        f"daemon RSS +{growth / 2**20:.1f} MiB while 120 MiB of refused frames arrived"
    )
    assert growth < 24 << 20, row.notes[-1]
    assert side_metrics(daemon)["oversize_requests_total"] == 4
    wait_for(lambda: open_fds(daemon) <= baseline_fds, "the sessions' fds not given back", 20)
    judge_latency(row, alone_s, attacked_s)
    victim.finish()
    row.assert_ok()


def test_more_sessions_than_a_tenant_may_hold(
    hostile: Callable[..., Hostile], workdir: Path, report: Report
) -> None:
    row = report.row(
        "zero-copy sessions over limits.max_sessions_per_tenant",
        f"raw Attach calls past max_sessions_per_tenant = {MAX_SESSIONS} (half of them "
        "never connected), then a reload that raises it",
    )
    daemon = hostile()
    victim = Victim(daemon, row)
    alone_s = victim.timed_gets()
    with mallory(daemon) as stub:

        def refused() -> str:
            try:
                RawSession(stub).close()
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                return str(err.details())
            raise AssertionError("an Attach past the tenant's session limit was accepted")

        held = [RawSession(stub, connect=i % 2 == 0) for i in range(MAX_SESSIONS)]
        details = refused()
        row.injected += 1
        assert f"limits.max_sessions_per_tenant ({MAX_SESSIONS})" in details, details
        attacked_s = victim.timed_gets()
        assert fresh_attach(daemon, victim)[0], "the other tenant could not attach"
        # Sessions that end are given back at once.
        for s in held[::2]:
            s.close()
        again: list[RawSession] = []
        wait_for(lambda: _try_attach(stub, again), "no attach after sessions ended", 10)
        again.append(RawSession(stub))
        refused()
        row.injected += 1
        # A reload that raises the limit applies to the next Attach.
        config = workdir / "hostile.toml"
        config.write_text(config_text(MAX_SESSIONS + 2))
        reloads = daemon.log().count("reloaded")
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: daemon.log().count("reloaded") > reloads, "no reload", 20)
        again += [RawSession(stub), RawSession(stub)]
        refused()
        row.injected += 1
        for s in held + again:
            s.close()
    assert side_metrics(daemon)["sessions_refused_total"] == 3
    row.notes.append(
        f"Attach number {MAX_SESSIONS + 1} refused RESOURCE_EXHAUSTED naming the limit; "
        "ended sessions freed their slots at once, a reload raised it for new Attach calls"
    )
    judge_latency(row, alone_s, attacked_s)
    victim.finish()
    row.assert_ok()


def _try_attach(stub: pb_grpc.KVTierStub, into: list[RawSession]) -> bool:
    try:
        into.append(RawSession(stub))
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        return False
    return True
