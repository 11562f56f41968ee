"""The side socket's bounds, in-process: request caps per op, sessions per tenant,
connections that never present a nonce, accept errors, and a session's backpressure."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import (
    HEADER,
    MAX_CALLS_PER_HITS,
    MAX_FRAME_BYTES,
    REQUEST_TYPES,
    Op,
    frame,
    request_caps,
)
from kvtier.config import LimitsConfig
from kvtier.engine.afterwards import Afterwards
from kvtier.errors import ResourceExhausted
from kvtier.server import arena_socket
from kvtier.server.arena_socket import ATTACH_TTL_S, ArenaSocket, Session, SessionLimits

RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
SMALL = LimitsConfig(max_plan_blocks=64, max_key_bytes=32, session_buffer_bytes=256 << 10)


# ---- request caps --------------------------------------------------------------------------
def widest(op: Op, limits: LimitsConfig) -> bytes:
    """A well-formed request of `op` with every field at its widest under `limits`."""
    n, key, ns = limits.max_plan_blocks, b"k" * limits.max_key_bytes, "\U0001f600" * 256
    big = (1 << 64) - 1
    message: Any
    if op == Op.RESERVE:
        items = [pb.ReserveItem(key=key, size_bytes=big)] * n
        message = pb.ReserveRequest(session_id=big, namespace=ns, items=items, overwrite=True)
    elif op == Op.COMMIT:
        message = pb.CommitRequest(session_id=big, lease_id=big, xxh3_64=[big] * n, abort=True)
    elif op == Op.ACQUIRE:
        message = pb.AcquireRequest(session_id=big, namespace=ns, keys=[key] * n)
    elif op == Op.RELEASE:
        message = pb.ReleaseRequest(
            session_id=big,
            lease_ids=[big] * limits.max_leases_per_session,
            fetch_seconds=1e300,
            fetch_bytes=big,
        )
    elif op == Op.PLAN:
        message = pb.PlanRequest(
            namespace=ns,
            keys=[key] * n,
            tokens_per_block=(1 << 32) - 1,
            prompt_tokens=big,
            engine_cached_blocks=(1 << 32) - 1,
            overlap="bidirectional",
            kv_bytes_per_token=big,
        )
    elif op == Op.REPORT_PREFILL:
        message = pb.ReportPrefillRequest(
            namespace=ns, start_token=big, end_token=big, seconds=-1e300
        )
    elif op == Op.REGISTER_CUDA:
        message = pb.RegisterCudaRequest(
            session_id=big, device=-1, ipc_handle=b"\xff" * 64, offset_bytes=big, size_bytes=big
        )
    elif op in (Op.CUDA_PUT, Op.CUDA_GET):
        blocks = [pb.CudaBlock(key=key, offset_bytes=big, size_bytes=big)] * n
        if op == Op.CUDA_PUT:
            message = pb.CudaPutRequest(
                session_id=big, namespace=ns, buffer_id=big, blocks=blocks, overwrite=True
            )
        else:
            message = pb.CudaGetRequest(
                session_id=big,
                namespace=ns,
                buffer_id=big,
                blocks=blocks,
                group_sizes=[(1 << 32) - 1] * n,
            )
    elif op == Op.STAGE:
        message = pb.StageRequest(session_id=big, size_bytes=big)
    elif op == Op.PUT_STAGED:
        staged = [pb.StagedPutItem(key=key, size_bytes=big, offset=big, xxh3_64=big)] * n
        message = pb.StagedPutRequest(session_id=big, namespace=ns, items=staged, overwrite=True)
    elif op == Op.HITS:
        hit = pb.DirectHit(key=key, size_bytes=big, fetch_seconds=-1e300)
        call = pb.DirectCall(blocks=(1 << 32) - 1, bytes=big, seconds=-1e300)
        message = pb.HitsRequest(namespace=ns, hits=[hit] * n, calls=[call] * MAX_CALLS_PER_HITS)
    else:
        message = pb.CudaWaitRequest(session_id=big, request_id=big, group=(1 << 32) - 1)
    assert isinstance(message, REQUEST_TYPES[op])
    return bytes(message.SerializeToString())


@pytest.mark.parametrize("op", list(Op), ids=[op.name for op in Op])
def test_the_widest_legitimate_request_fits_its_cap(op: Op) -> None:
    limits = LimitsConfig(max_plan_blocks=4096)
    caps = request_caps(4096, limits.max_key_bytes, 256, limits.max_leases_per_session, 1 << 40)
    assert set(caps) == set(REQUEST_TYPES)
    size = len(widest(op, limits))
    assert size <= caps[op], (op.name, size, caps[op])
    assert caps[op] < 2 * size + 4096  # and the cap is not much wider than that


def test_caps_are_far_below_the_frame_bound_and_never_over_the_buffer() -> None:
    defaults = SessionLimits.of(LimitsConfig())
    assert max(defaults.caps.values()) <= defaults.buffer_bytes == 8 << 20 < MAX_FRAME_BYTES
    assert defaults.caps[Op.CUDA_WAIT] < 4096  # ops without a batch stay small
    small = SessionLimits.of(SMALL)
    assert max(small.caps.values()) < 16 << 10


# ---- sessions per tenant -------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_sessions_per_tenant_are_capped_and_freed_when_they_end(tmp_path: Path) -> None:
    ended: list[int] = []
    clock = Clock()
    arena = ArenaSocket(tmp_path / "a.sock", lambda t: (0, 0), ended.append, clock_s=clock)
    limits = LimitsConfig(max_sessions_per_tenant=3)
    held = [arena.new_session("mallory", limits) for _ in range(3)]
    with pytest.raises(ResourceExhausted, match=r"limits\.max_sessions_per_tenant \(3\)"):
        arena.new_session("mallory", limits)
    assert arena.counters.sessions_refused == 1
    arena.new_session("alice", limits)  # another tenant is not affected
    # A reload that raises the limit applies to the next Attach.
    held.append(arena.new_session("mallory", LimitsConfig(max_sessions_per_tenant=4)))
    assert arena.sessions_of("mallory") == 4
    # Attached but never connected: expire, and count no more.
    clock.now_s = ATTACH_TTL_S + 1
    arena.new_session("mallory", limits)
    assert sorted(ended) == sorted([s.session_id for s in held] + [4])  # alice's too
    assert arena.sessions_of("mallory") == 1 and arena.sessions_of("alice") == 0
    assert all(arena.tenant_of(s.session_id) is None for s in held)


# ---- the socket, in-process ----------------------------------------------------------------
class Side:
    """An ArenaSocket on a real socket with a recording handler."""

    def __init__(self, arena: ArenaSocket) -> None:
        self.arena = arena
        self.calls: list[tuple[int, bytes]] = []
        self.reply_bytes = 16
        self.ended: list[int] = []
        self.sockets: list[socket.socket] = []  # the clients', closed at teardown
        self.freed = asyncio.Event()  # a b"~w" request waits for a b"~r" Release

    def client_socket(self) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sockets.append(conn)
        return conn

    async def handler(self, session_id: int, op: int, payload: bytes) -> tuple[int, bytes]:
        self.calls.append((op, payload))
        # Payloads may ask the handler to wait as a real op can: for a future that another
        # callback completes (b"~f"), a bare loop turn (b"~t"), or a timer (b"~s").
        if op == Op.RELEASE and payload.startswith(b"~r"):
            self.freed.set()
        if payload.startswith(b"~w"):
            await self.freed.wait()
        if payload.startswith(b"~f"):
            future = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(future.set_result, payload[2:3])
            payload = await future + payload
        elif payload.startswith(b"~t"):
            await asyncio.sleep(0)
        elif payload.startswith(b"~s"):
            await asyncio.sleep(0.002)
        return 0, payload[:8].ljust(self.reply_bytes, b".")


@pytest.fixture
async def side(tmp_path: Path) -> AsyncIterator[Side]:
    fd = os.memfd_create("arena")
    os.ftruncate(fd, 4096)
    ended: list[int] = []
    arena = ArenaSocket(tmp_path / "a.sock", lambda t: (fd, 4096), ended.append)
    result = Side(arena)
    result.ended = ended
    arena.set_handler(result.handler)
    await arena.start()
    yield result
    for conn in result.sockets:
        conn.close()
    await arena.close()
    os.close(fd)


def connect(side: Side, limits: LimitsConfig = SMALL) -> tuple[socket.socket, Session]:
    """A client's side connection, handshake sent (read the reply with `handshake`)."""
    session = side.arena.new_session("alice", limits)
    conn = side.client_socket()
    conn.settimeout(10)
    conn.connect(str(side.arena.path))
    conn.sendall(session.nonce)
    return conn, session


def handshake(conn: socket.socket) -> int:
    msg, fds, _, _ = socket.recv_fds(conn, 16, 2)
    for fd in fds:
        os.close(fd)
    assert len(msg) == 16 and fds, "the daemon refused the nonce"
    return int(struct.unpack("<QQ", msg)[0])


async def attached(side: Side, limits: LimitsConfig = SMALL) -> socket.socket:
    conn, session = connect(side, limits)
    assert await asyncio.to_thread(handshake, conn) == session.session_id
    return conn


def recv_exact(conn: socket.socket, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        part = conn.recv(size - len(out))
        if not part:
            raise ConnectionError("closed")
        out += part
    return bytes(out)


def reply(conn: socket.socket) -> tuple[int, bytes]:
    length, code = HEADER.unpack(recv_exact(conn, HEADER.size))
    return code, recv_exact(conn, length)


async def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline_s, what
        await asyncio.sleep(0.01)


async def test_accept_errors_are_retried_not_fatal(
    side: Side, caplog: pytest.LogCaptureFixture
) -> None:
    await attached(side)  # the loop is waiting on the real socket: replaced after
    real = side.arena._sock
    assert real is not None

    class OutOfFds:
        """The listening socket, whose next accepts fail as they do at the fd limit."""

        failures = 3

        def fileno(self) -> int:
            return real.fileno()

        def gettimeout(self) -> float:
            return 0.0

        def accept(self) -> tuple[socket.socket, Any]:
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return real.accept()

    side.arena._sock = OutOfFds()  # type: ignore[assignment]
    try:
        with caplog.at_level(logging.WARNING, logger=arena_socket.__name__):
            await attached(side)  # first accept: still the real socket's
            await attached(side)  # waits out three EMFILEs, then gets in
    finally:
        side.arena._sock = real
    assert side.arena.counters.accept_errors == 3
    assert side.arena.counters.accepting
    warnings = [r for r in caplog.records if "cannot accept" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited


async def test_an_accept_loop_that_ends_says_so(
    side: Side, caplog: pytest.LogCaptureFixture
) -> None:
    await attached(side)
    real = side.arena._sock
    assert real is not None

    class Gone:
        def fileno(self) -> int:
            return real.fileno()

        def gettimeout(self) -> float:
            return 0.0

        def accept(self) -> tuple[socket.socket, Any]:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    side.arena._sock = Gone()  # type: ignore[assignment]
    try:
        with caplog.at_level(logging.ERROR, logger=arena_socket.__name__):
            side.client_socket().connect(str(real.getsockname()))
            await wait_until(lambda: not side.arena.counters.accepting, "still accepting")
    finally:
        side.arena._sock = real
    assert any("stopped accepting" in r.getMessage() for r in caplog.records)


async def test_connections_without_a_nonce_are_capped_oldest_shed_first(side: Side) -> None:
    side.arena.max_handshaking = 4
    silent = []
    for _ in range(10):
        s = side.client_socket()
        s.connect(str(side.arena.path))
        silent.append(s)
    await wait_until(lambda: side.arena.counters.handshakes_shed >= 6, "no connection shed")
    await attached(side)  # a real client still gets in, at once
    for s in silent[:6]:
        s.settimeout(5)
        assert await asyncio.to_thread(s.recv, 1) == b""  # the oldest were closed
    assert side.arena.counters.handshakes_shed == 7  # and one more for the client


async def test_an_oversize_request_is_answered_and_its_bytes_dropped(side: Side) -> None:
    conn = await attached(side)
    cap = SessionLimits.of(SMALL).caps[Op.PLAN]
    over = cap + 1
    # Over the cap: RESOURCE_EXHAUSTED naming the limit, before the rest of its bytes.
    conn.sendall(HEADER.pack(over, Op.PLAN) + b"x" * 100)
    code, message = await asyncio.to_thread(reply, conn)
    assert code == RESOURCE_EXHAUSTED and b"limits.max_plan_blocks" in message, message
    conn.sendall(b"x" * (over - 100) + frame(Op.PLAN, b"after"))
    assert await asyncio.to_thread(reply, conn) == (0, b"after".ljust(16, b"."))
    # An oversize Release gets no reply (none is awaited); the next request is answered.
    release_cap = SessionLimits.of(SMALL).caps[Op.RELEASE]
    conn.sendall(HEADER.pack(2 * release_cap, Op.RELEASE) + b"y" * (2 * release_cap))
    conn.sendall(frame(Op.PLAN, b"next"))
    assert await asyncio.to_thread(reply, conn) == (0, b"next".ljust(16, b"."))
    assert side.calls == [(Op.PLAN, b"after"), (Op.PLAN, b"next")]  # no oversize one ran
    assert side.arena.counters.oversize_requests == 2
    # A header no client sends ends the session.
    conn.sendall(HEADER.pack(MAX_FRAME_BYTES + 1, Op.ACQUIRE))
    assert await asyncio.to_thread(conn.recv, 1) == b""
    await wait_until(lambda: len(side.ended) == 1, "the session did not end")


async def test_a_client_that_never_reads_stalls_only_its_own_session(side: Side) -> None:
    side.reply_bytes = 64 << 10
    hog = await attached(side)  # 256 KiB buffer (SMALL)
    sent = 2000  # 26 KB of requests (in one send: small ones fill a UNIX socket's
    # buffer with per-message overhead), 128 MB of replies if all were run at once
    hog.sendall(b"".join(frame(Op.PLAN, i.to_bytes(8, "little")) for i in range(sent)))
    await wait_until(lambda: side.arena.counters.sessions_paused == 1, "reading never paused")
    await asyncio.sleep(0.3)
    ran = len(side.calls)
    # Replies in the kernel's socket buffers and the transport's (half the session's
    # buffer), nothing more: the rest waits, unread and unrun.
    assert ran < 40, f"{ran} of {sent} requests ran with nobody reading their replies"
    other = await attached(side)  # another session is served meanwhile
    other.sendall(frame(Op.PLAN, b"other"))
    assert (await asyncio.to_thread(reply, other))[0] == 0
    # Once its client reads, the session catches up, every reply in order.
    for i in range(sent):
        code, body = await asyncio.to_thread(reply, hog)
        assert (code, body[:8]) == (0, i.to_bytes(8, "little"))
    assert side.arena.counters.sessions_paused == 0
    assert side.arena.counters.read_pauses >= 1


async def test_a_reply_less_request_runs_beside_a_request_that_waits_for_it(side: Side) -> None:
    """A request that waits for what a later reply-less one frees (a put waiting for DRAM
    its own client's lease pins, the lease's Release sent after it) is answered at once:
    the Release runs as it arrives, not behind the request it would unblock (it has no
    reply whose order to keep); the requests after are answered in order as before."""
    conn = await attached(side)
    conn.settimeout(5)  # queued behind the wait, the Release would never run
    conn.sendall(frame(Op.PLAN, b"~wait") + frame(Op.RELEASE, b"~r") + frame(Op.PLAN, b"after"))
    assert await asyncio.to_thread(reply, conn) == (0, b"~wait".ljust(16, b"."))
    assert await asyncio.to_thread(reply, conn) == (0, b"after".ljust(16, b"."))
    assert side.calls == [(Op.PLAN, b"~wait"), (Op.RELEASE, b"~r"), (Op.PLAN, b"after")]
    # Alone (nothing ahead of it), a Release runs in order as before.
    side.freed.clear()
    conn.sendall(frame(Op.RELEASE, b"~r") + frame(Op.PLAN, b"~wait"))
    assert await asyncio.to_thread(reply, conn) == (0, b"~wait".ljust(16, b"."))


def answered(payload: bytes) -> bytes:
    """What Side.handler replies to `payload`, first 8 bytes."""
    if payload.startswith(b"~f"):
        payload = payload[2:3] + payload
    return payload[:8].ljust(8, b".")


async def test_work_deferred_past_a_reply_runs_once_it_is_sent_before_anything_else(
    side: Side,
) -> None:
    """A handler run in the read callback may defer work past its reply (a put's
    cataloguing): the reply is on the client's socket when the work runs, and the work
    is done before the next request's handler; work due when a handler first waits is
    done then, and once it has waited nothing is deferred (its reply comes from a task,
    with other callbacks run between)."""
    afterwards = Afterwards()
    seen: list[tuple[str, bytes, object]] = []
    peek: socket.socket | None = None  # the client's socket, not waiting on a read

    def readable_bytes() -> int:
        assert peek is not None
        try:
            return len(peek.recv(1 << 16, socket.MSG_PEEK))
        except BlockingIOError:
            return 0

    async def handler(session_id: int, op: int, payload: bytes) -> tuple[int, bytes]:
        seen.append(("handler", payload, afterwards.armed))

        def work() -> None:
            seen.append(("work", payload, readable_bytes()))

        if payload.startswith(b"~d"):  # defers, then waits
            afterwards.later(("ns", payload), work)
            await asyncio.sleep(0)
            seen.append(("resumed", payload, afterwards.armed))
            return 0, payload
        if payload.startswith(b"~t"):  # waits, then would defer
            await asyncio.sleep(0)
            seen.append(("resumed", payload, afterwards.armed))
        if afterwards.armed:
            afterwards.later(("ns", payload), work)
        else:
            work()
        return 0, payload

    side.arena.set_handler(handler, afterwards)
    conn = await attached(side)
    peek = conn.dup()
    side.sockets.append(peek)
    peek.setblocking(False)

    async def exchange(first: bytes, second: bytes, steps: int) -> None:
        """Both requests sent at once; their replies read once `steps` are seen."""
        seen.clear()
        conn.sendall(frame(Op.PLAN, first) + frame(Op.PLAN, second))
        await wait_until(lambda: len(seen) == steps, "the requests were not all handled")
        for p in (first, second):
            assert await asyncio.to_thread(reply, conn) == (0, p)

    await exchange(b"a", b"b", 4)
    one_reply = HEADER.size + 1
    assert seen == [
        ("handler", b"a", True),
        ("work", b"a", one_reply),  # a's reply sent before a's work
        ("handler", b"b", True),
        ("work", b"b", 2 * one_reply),
    ]
    await exchange(b"~t", b"c", 5)
    assert seen == [
        ("handler", b"~t", True),
        ("resumed", b"~t", False),
        ("work", b"~t", 0),  # done at once, before its reply
        ("handler", b"c", False),  # the worker task runs what follows: not armed
        ("work", b"c", HEADER.size + 2),  # done at once: only ~t's reply is out
    ]
    await exchange(b"~d", b"e", 5)
    assert seen == [
        ("handler", b"~d", True),
        ("work", b"~d", 0),  # run as the handler first waited, before the loop went on
        ("resumed", b"~d", False),
        ("handler", b"e", False),
        ("work", b"e", HEADER.size + 2),
    ]
    assert not afterwards


async def test_pipelined_requests_that_wait_or_not_are_answered_in_order(side: Side) -> None:
    """Requests whose handlers finish at once are answered in the read callback itself;
    one that waits is carried on by the session's task, and none after it overtakes it."""
    conn = await attached(side)
    kinds = [b"~n", b"~f", b"~t", b"~s"]
    payloads = [kinds[(i * 7 + i // 5) % 4] + b"%06d" % i for i in range(400)]
    conn.sendall(b"".join(frame(Op.PLAN, p) for p in payloads))
    for p in payloads:
        code, body = await asyncio.to_thread(reply, conn)
        assert (code, body[:8]) == (0, answered(p))
    assert side.calls == [(Op.PLAN, p) for p in payloads]
    # One at a time too: each kind is answered with nothing more sent after it.
    for kind in kinds:
        conn.sendall(frame(Op.PLAN, kind + b"alone"))
        code, body = await asyncio.to_thread(reply, conn)
        assert (code, body[:8]) == (0, answered(kind + b"alone"))
