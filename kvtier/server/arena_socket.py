"""The side UNIX socket that hands the shared arena to local clients (SCM_RIGHTS).

gRPC cannot carry file descriptors, so a client first calls `Attach` (over gRPC, on the
same socket permissions), gets a session id and a one-time nonce, then connects here and
presents the nonce; the daemon answers with the arena's memfd. The connection then stays
open for the client's lifetime: when it closes (the client exited or died), every lease
of the session is released at once instead of waiting for the lease TTL.

Protocol: client sends 16 bytes (nonce); daemon sends 16 bytes (session id u64, arena
size u64, little-endian) with the fds attached — the arena's (sealed: it maps read-only),
then, where the daemon has one for the session, its write area's (the only memory the
client may write: a zero-copy put's slots) — or closes the connection on a bad nonce.
Each tenant has its own arena; a session only ever receives its own tenant's.

What one local user can hold here is bounded, so that nobody else loses the path:
sessions per tenant (`limits.max_sessions_per_tenant`, counted from Attach; one attached
but never connected expires after ATTACH_TTL_S); connections that have not presented a
nonce (at most MAX_HANDSHAKING, fewer under a low fd limit: past it the oldest is shed,
each also ends after HANDSHAKE_TIMEOUT_S); and a session's memory (`SessionLimits`: a
cap per request, and reading stops while its queued requests and unsent replies exceed
`limits.session_buffer_bytes`, so a client that never reads its replies stalls only
itself). An accept that fails for want of fds or memory is retried after a pause, never
the end of the socket.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import os
import resource
import secrets
import socket
import struct
import time
import types
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier._session import (
    HEADER,
    MAX_FRAME_BYTES,
    NO_REPLY_OPS,
    Op,
    frame,
    request_cap,
    request_caps,
)
from kvtier.config import Config, LimitsConfig
from kvtier.engine.afterwards import Afterwards
from kvtier.errors import InvalidArgument, ResourceExhausted, Unimplemented, to_status
from kvtier.server.awake import LoopAwake

logger = logging.getLogger(__name__)

NONCE_BYTES = 16
REPLY = struct.Struct("<QQ")
HANDSHAKE_TIMEOUT_S = 5.0
# A client connects as soon as Attach answers; a session attached and never connected
# still counts against its tenant until this passes.
ATTACH_TTL_S = 30.0
MAX_PENDING_SESSIONS = 4096  # attached, not connected, all tenants: the oldest goes first
# Connections that have not presented a nonce, at most; and at most this share of the fd
# limit, so that nobody can fill the daemon's fds through this socket before the timeout.
MAX_HANDSHAKING = 256
HANDSHAKING_FD_SHARE = 4
ACCEPT_BACKOFF_MIN_S = 0.05
ACCEPT_BACKOFF_MAX_S = 1.0
# accept() failures that say the peer gave up before it was accepted: try the next at once.
_PEER_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO})
# ... and those that say the listening socket itself is gone: retrying cannot help.
_SOCKET_GONE = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})
# A queued request's Python objects beyond its payload (measured ~200 bytes): counted
# against the session's buffer, so that tiny frames cannot pile up for free.
REQUEST_OVERHEAD_BYTES = 256
LOG_EVERY_S = 10.0

SessionHandler = Callable[[int, int, bytes], Coroutine[Any, Any, tuple[int, bytes]]]


async def _no_handler(session_id: int, op: int, payload: bytes) -> tuple[int, bytes]:
    status = to_status(Unimplemented("no request handler"))
    return status.value, status.message.encode()


@dataclass(slots=True)
class SideSocketCounters:
    """What the side socket refused or waited for, read by the metrics endpoint."""

    accepting: bool = True  # False only if the accept loop ended (a bug: logged at ERROR)
    accept_errors: int = 0  # accept() failures (EMFILE, ENFILE, ENOBUFS, ENOMEM...)
    handshakes_shed: int = 0  # connections closed before their nonce: over MAX_HANDSHAKING
    sessions_refused: int = 0  # Attach calls over limits.max_sessions_per_tenant
    sessions: int = 0  # attached now (connected or not)
    sessions_paused: int = 0  # sessions not being read now: their buffer is full
    read_pauses: int = 0  # times a session's reading was paused
    oversize_requests: int = 0  # requests over their op's cap (answered, bytes dropped)
    poll_s: float = 0.0  # windows the loop polled after replies (server/awake.py)


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """A session's bounds, fixed when it attaches (a reload applies to later sessions)."""

    buffer_bytes: int
    caps: dict[Op, int]
    cap_of_byte: tuple[int, ...]  # the cap for each value of a frame's op byte

    @classmethod
    def of(cls, limits: LimitsConfig) -> SessionLimits:
        buffer_bytes = int(limits.session_buffer_bytes)
        caps = request_caps(
            limits.max_plan_blocks,
            limits.max_key_bytes,
            limits.max_namespace_chars,
            limits.max_leases_per_session,
            buffer_bytes,
        )
        return cls(buffer_bytes, caps, tuple(request_cap(caps, op) for op in range(256)))


@dataclass(slots=True)
class Session:
    session_id: int
    nonce: bytes
    tenant: str
    limits: SessionLimits
    attached_s: float = 0.0
    ended: bool = False


class _Throttle:
    """At most one log line per `every_s` for a repeated event, saying how many were not."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self._every_s = every_s
        self._next_s = 0.0
        self._skipped = 0

    def due(self) -> int | None:
        """None: stay quiet; else log now, and this many were skipped since the last."""
        now = time.monotonic()
        if now < self._next_s:
            self._skipped += 1
            return None
        self._next_s = now + self._every_s
        skipped, self._skipped = self._skipped, 0
        return skipped


class ArenaSocket:
    """Sessions and the side socket. Lifecycle: `start()`, `new_session()`..., `close()`."""

    def __init__(
        self,
        path: Path,
        arena_for: Callable[[str], tuple[int, int]],
        on_session_end: Callable[[int], object],
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._arena_for = arena_for  # tenant -> (memfd, size) of its own arena
        self._on_session_end = on_session_end
        self._clock_s = clock_s
        self._handler: SessionHandler = _no_handler
        self._afterwards = Afterwards()
        self._write_area_for: Callable[[int], int] | None = None
        self._directory_for: Callable[[str], int | None] | None = None
        self._by_nonce: dict[bytes, Session] = {}  # attached, not yet connected; oldest first
        self._sessions: dict[int, Session] = {}
        self._per_tenant: collections.Counter[str] = collections.Counter()
        self._next_id = 1
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._handshaking: dict[socket.socket, asyncio.Task[None]] = {}  # oldest first
        self.max_handshaking = MAX_HANDSHAKING
        self.counters = SideSocketCounters()
        self._accept_log = _Throttle()
        self._refusal_log = _Throttle()
        # After a reply the loop polls for `server.poll_after_reply_s` (set by the daemon).
        self.awake = LoopAwake()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o007)  # same access rule as the gRPC socket: owner and group
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        soft_fds, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft_fds != resource.RLIM_INFINITY:
            self.max_handshaking = max(1, min(MAX_HANDSHAKING, soft_fds // HANDSHAKING_FD_SHARE))
        task = self._spawn(self._accept_forever())
        task.add_done_callback(self._accept_ended)

    def reconfigure(self, config: Config) -> None:
        """What a reload may change here: the loop's poll after a reply."""
        self.awake.window_s = config.server.poll_after_reply_s

    def set_handler(self, handler: SessionHandler, afterwards: Afterwards | None = None) -> None:
        """Who answers framed requests: (session id, op, payload) -> (status code, reply);
        `afterwards`: where the handler defers work past its reply (armed while it runs
        in the read callback, run once it returns or waits)."""
        self._handler = handler
        if afterwards is not None:
            self._afterwards = afterwards

    def set_write_areas(self, write_area_for: Callable[[int], int]) -> None:
        """Who makes a session's write area: session id -> the memfd to pass its client."""
        self._write_area_for = write_area_for

    def set_directories(self, directory_for: Callable[[str], int | None]) -> None:
        """Who holds a tenant's directory (direct reads): tenant -> the sealed memfd to
        pass its sessions' clients, or None where there is none. Passed third, after the
        write area; a session never gets another tenant's."""
        self._directory_for = directory_for

    def new_session(self, tenant: str, limits: LimitsConfig) -> Session:
        """A session for `tenant` under `limits` (the running configuration's: a reload
        applies to the sessions attached after it); ResourceExhausted when the tenant
        already has limits.max_sessions_per_tenant."""
        now_s = self._clock_s()
        self._expire_unconnected(now_s)
        held = self._per_tenant[tenant]
        if held >= limits.max_sessions_per_tenant:
            self.counters.sessions_refused += 1
            raise ResourceExhausted(
                f"this tenant has {held} zero-copy sessions, the most "
                f"limits.max_sessions_per_tenant ({limits.max_sessions_per_tenant}) allows: "
                "close clients it no longer uses (each attached client holds one), or raise "
                "the limit"
            )
        while len(self._by_nonce) >= MAX_PENDING_SESSIONS:
            self._end(self._by_nonce.pop(next(iter(self._by_nonce))))
        session = Session(
            self._next_id, secrets.token_bytes(NONCE_BYTES), tenant, SessionLimits.of(limits)
        )
        session.attached_s = now_s
        self._next_id += 1
        self._by_nonce[session.nonce] = session
        self._sessions[session.session_id] = session
        self._per_tenant[tenant] += 1
        self.counters.sessions += 1
        return session

    def tenant_of(self, session_id: int) -> str | None:
        """The tenant a live session was opened for; None if unknown or ended."""
        session = self._sessions.get(session_id)
        return session.tenant if session is not None and not session.ended else None

    def sessions_of(self, tenant: str) -> int:
        """Sessions the tenant holds now (attached, connected or not yet)."""
        return self._per_tenant[tenant]

    def _expire_unconnected(self, now_s: float) -> None:
        while self._by_nonce:
            oldest = next(iter(self._by_nonce.values()))
            if now_s - oldest.attached_s < ATTACH_TTL_S:
                return
            del self._by_nonce[oldest.nonce]
            self._end(oldest)

    def _end(self, session: Session) -> None:
        if session.ended:
            return
        session.ended = True
        self._sessions.pop(session.session_id, None)
        self._per_tenant[session.tenant] -= 1
        if self._per_tenant[session.tenant] <= 0:
            del self._per_tenant[session.tenant]
        self.counters.sessions -= 1
        self._on_session_end(session.session_id)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _accept_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return  # close()
        self.counters.accepting = False
        logger.error(
            "arena socket: stopped accepting connections; zero-copy attaches fail until "
            "kvtier restarts (clients use the gRPC byte path)",
            exc_info=task.exception(),
        )

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        backoff_s = ACCEPT_BACKOFF_MIN_S
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as err:
                if err.errno in _PEER_GONE:
                    continue
                if err.errno in _SOCKET_GONE:
                    raise
                # Out of fds or memory: the connection waits in the backlog, and existing
                # sessions go on; try again once something was freed.
                self.counters.accept_errors += 1
                skipped = self._accept_log.due()
                if skipped is not None:
                    logger.warning(
                        "arena socket: cannot accept a connection (%s); retrying every "
                        "%.2f s at most (%d more failures since the last report)",
                        err.strerror or err,
                        ACCEPT_BACKOFF_MAX_S,
                        skipped,
                    )
                await asyncio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, ACCEPT_BACKOFF_MAX_S)
                continue
            backoff_s = ACCEPT_BACKOFF_MIN_S
            if len(self._handshaking) >= self.max_handshaking:
                # The oldest one has had the longest to send its 16 bytes: a client sends
                # them right after connecting, so it is most likely one that never will.
                oldest = next(iter(self._handshaking))
                self._handshaking.pop(oldest).cancel()
                self.counters.handshakes_shed += 1
                skipped = self._refusal_log.due()
                if skipped is not None:
                    logger.warning(
                        "arena socket: %d connections have not presented a nonce; closing "
                        "the oldest (%d more since the last report)",
                        self.max_handshaking,
                        skipped,
                    )
            task = self._spawn(self._serve(conn))
            # Also when it is shed before it ever ran (its own `finally` never would).
            task.add_done_callback(lambda _, conn=conn: conn.close())  # type: ignore[misc]
            self._handshaking[conn] = task
            # sock_accept does not yield while the backlog is full: let the handshakes
            # just accepted read their nonces before more arrive (and shed them).
            await asyncio.sleep(0)

    async def _serve_requests(self, conn: socket.socket, session: Session) -> None:
        """Answer framed requests (see kvtier._session) until the client closes."""
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()
        transport, _ = await loop.connect_accepted_socket(
            lambda: _SessionProtocol(
                session.session_id,
                self._handler,
                self._afterwards,
                closed,
                session.limits,
                self.counters,
                self.awake,
            ),
            sock=conn,
        )
        try:
            await closed
        finally:
            transport.close()

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        session: Session | None = None
        try:
            nonce = b""
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                while len(nonce) < NONCE_BYTES:
                    part = await loop.sock_recv(conn, NONCE_BYTES - len(nonce))
                    if not part:
                        return
                    nonce += part
            self._handshaking.pop(conn, None)
            session = self._by_nonce.pop(nonce, None)
            if session is None:
                skipped = self._refusal_log.due()
                if skipped is not None:
                    logger.warning(
                        "arena socket: refused a connection with an unknown nonce (%d more "
                        "refusals since the last report)",
                        skipped,
                    )
                return
            arena_fd, arena_bytes = self._arena_for(session.tenant)
            fds = [arena_fd]
            if self._write_area_for is not None:
                fds.append(self._write_area_for(session.session_id))
                directory_fd = self._directory_for(session.tenant) if self._directory_for else None
                if directory_fd is not None:
                    fds.append(directory_fd)
            socket.send_fds(conn, [REPLY.pack(session.session_id, arena_bytes)], fds)
            await self._serve_requests(conn, session)
        except TimeoutError:
            pass
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS):
                skipped = self._accept_log.due()
                if skipped is not None:
                    logger.warning(
                        "arena socket: a session ended for want of resources (%s; %d more "
                        "since the last report)",
                        err.strerror or err,
                        skipped,
                    )
        finally:
            self._handshaking.pop(conn, None)
            conn.close()
            if session is not None:
                self._end(session)


@dataclass(slots=True)
class _Request:
    op: int
    payload: bytes
    cost_bytes: int  # what it holds of the session's buffer
    refusal: tuple[int, bytes] | None = None  # answer this instead of running it


@dataclass(slots=True)
class _Suspended:
    """A request whose handler, run inline, waits for something: its coroutine and what
    it awaits, for the session's worker task to carry on."""

    op: int
    call: Coroutine[Any, Any, tuple[int, bytes]]
    awaited: Any


async def _finish_aside(call: Coroutine[Any, Any, Any], awaited: Any) -> None:
    await _resume(call, awaited)


@types.coroutine
def _resume(call: Coroutine[Any, Any, Any], awaited: Any) -> Generator[Any, Any, Any]:
    """Carry on a coroutine that was started outside any task and suspended on `awaited`:
    what it awaits goes up to the task awaiting this, what that task sends or throws
    (a result, a cancellation) goes down to it."""
    while True:
        try:
            sent = yield awaited
        except BaseException as err:
            try:
                awaited = call.throw(err)
            except StopIteration as done:
                return done.value
            continue
        try:
            awaited = call.send(sent)
        except StopIteration as done:
            return done.value


class _SessionProtocol(asyncio.Protocol):
    """Frames in, replies out, in order. A transport callback rather than sock_recv: no
    selector re-registration per request (tens of microseconds on a 256 KiB get).

    Backpressure: the worker runs the next request only while the transport can take its
    reply (pause_writing/resume_writing, at half the session's buffer), and reading stops
    while queued requests, a partial frame and unsent replies together exceed the buffer
    (resumes under half of it, or once nothing is queued: a lone partial frame is bounded
    by its op's cap), so a session holds about twice its buffer at most."""

    def __init__(
        self,
        session_id: int,
        handler: SessionHandler,
        afterwards: Afterwards,
        closed: asyncio.Future[None],
        limits: SessionLimits,
        counters: SideSocketCounters,
        awake: LoopAwake,
    ) -> None:
        self._session_id = session_id
        self._awake = awake
        self._handler = handler
        self._afterwards = afterwards
        self._closed = closed
        self._limits = limits
        self._counters = counters
        self._buf = bytearray()
        self._pending: collections.deque[_Request] = collections.deque()
        self._queued_bytes = 0
        self._discard_bytes = 0  # what is left of a refused frame: dropped as it arrives
        self._reading_paused = False
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._worker: asyncio.Task[None] | None = None
        self._aside: set[asyncio.Task[None]] = set()  # reply-less requests that waited
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        buffer_bytes = self._limits.buffer_bytes
        transport.set_write_buffer_limits(high=buffer_bytes // 2, low=buffer_bytes // 8)

    def data_received(self, data: bytes) -> None:
        if self._discard_bytes:
            dropped = min(len(data), self._discard_bytes)
            self._discard_bytes -= dropped
            if dropped == len(data):
                return
            data = data[dropped:]
        buf = self._buf
        buf += data
        while len(buf) >= HEADER.size:
            length, op = HEADER.unpack_from(buf)
            cap = self._limits.cap_of_byte[op]
            if length > cap:
                if not self._refuse(op, length, cap):
                    return
                continue
            end = HEADER.size + length
            if len(buf) < end:
                break
            payload = bytes(buf[HEADER.size : end])
            del buf[:end]
            self._queue(_Request(op, payload, length + REQUEST_OVERHEAD_BYTES))
        self._update_reading()

    def _refuse(self, op: int, length: int, cap: int) -> bool:
        """A frame over its op's cap: answered (in order) and its bytes dropped unread;
        False when the session was closed instead (a header no client would send)."""
        self._counters.oversize_requests += 1
        if length > MAX_FRAME_BYTES:
            logger.warning(
                "session %d declared a %d-byte frame; closing it", self._session_id, length
            )
            assert self._transport is not None
            self._transport.close()
            return False
        buf = self._buf
        dropped = min(len(buf), HEADER.size + length)
        del buf[:dropped]
        self._discard_bytes = HEADER.size + length - dropped
        if op in NO_REPLY_OPS:
            return True  # gets no reply: the session's end releases what it named
        try:
            name = Op(op).name
        except ValueError:
            err: Exception = InvalidArgument(f"malformed session request: unknown op {op}")
        else:
            err = ResourceExhausted(
                f"a {name} request of {length} bytes is over the session's limit of {cap} "
                "bytes (limits.max_plan_blocks keys of limits.max_key_bytes, at most "
                "limits.session_buffer_bytes): split the batch"
            )
        status = to_status(err)
        self._queue(
            _Request(op, b"", REQUEST_OVERHEAD_BYTES, (status.value, status.message.encode()))
        )
        return True

    def _queue(self, request: _Request) -> None:
        if request.op in NO_REPLY_OPS and (self._worker is not None or self._pending):
            # No reply to keep in order, and what it frees may be what a request ahead
            # waits for (a put waiting for DRAM its own client's lease pins, the lease's
            # Release sent after it, waited limits.reserve_wait_s and failed): run now.
            self._run_aside(request)
            return
        self._pending.append(request)
        self._queued_bytes += request.cost_bytes
        if self._worker is None:
            suspended = self._run_inline()
            if suspended is not None or self._pending:
                self._worker = asyncio.ensure_future(self._work(suspended))

    def _run_aside(self, request: _Request) -> None:
        """A reply-less request, run beside the session's queue: here, or (if its
        handler waits) in a task of its own."""
        call = self._handler(self._session_id, request.op, request.payload)
        try:
            awaited = call.send(None)
        except StopIteration:
            return
        task = asyncio.ensure_future(_finish_aside(call, awaited))
        self._aside.add(task)
        task.add_done_callback(self._aside.discard)

    def _run_inline(self) -> _Suspended | None:
        """Run queued requests here, in the read callback, while their handlers finish
        without waiting (most do: a put with room, a lookup, a plan) and the transport
        takes replies: no task and no loop turn per request. The first handler that
        waits is returned, suspended, for the worker task to finish. Work a handler
        deferred past its reply (`Afterwards`) runs right after the reply is written, or
        when the handler first waits: before the loop runs anything else."""
        afterwards = self._afterwards
        while self._pending and self._can_write.is_set():
            request = self._pending.popleft()
            self._queued_bytes -= request.cost_bytes
            if request.refusal is not None:
                code, reply = request.refusal
            else:
                call = self._handler(self._session_id, request.op, request.payload)
                afterwards.armed = True
                try:
                    awaited = call.send(None)
                except StopIteration as done:
                    code, reply = done.value
                else:
                    afterwards.run()
                    return _Suspended(request.op, call, awaited)
                finally:
                    afterwards.armed = False
            self._answer(request.op, code, reply)
            afterwards.run()
        return None

    def _answer(self, op: int, code: int, reply: bytes) -> None:
        if op not in NO_REPLY_OPS and self._transport is not None:
            self._transport.write(frame(code, reply))
            if code == 0:
                # The client's next request comes soon after this (a refusal is not
                # polled after: a client must not keep a CPU busy by being refused).
                self._counters.poll_s += self._awake.kick()
        self._update_reading()

    async def _work(self, suspended: _Suspended | None = None) -> None:
        try:
            if suspended is not None:
                code, reply = await _resume(suspended.call, suspended.awaited)
                self._answer(suspended.op, code, reply)
            while self._pending:
                if not self._can_write.is_set():
                    # A client that does not read its replies: no more work done for it.
                    await self._can_write.wait()
                    if not self._pending:
                        break
                request = self._pending.popleft()
                self._queued_bytes -= request.cost_bytes
                if request.refusal is not None:
                    code, reply = request.refusal
                else:
                    code, reply = await self._handler(self._session_id, request.op, request.payload)
                self._answer(request.op, code, reply)
        finally:
            self._worker = None
            self._update_reading()

    def _update_reading(self) -> None:
        transport = self._transport
        if transport is None:
            return
        held_bytes = self._queued_bytes + len(self._buf) + transport.get_write_buffer_size()
        limit_bytes = self._limits.buffer_bytes
        if not self._reading_paused:
            if self._pending and held_bytes > limit_bytes:
                transport.pause_reading()
                self._reading_paused = True
                self._counters.read_pauses += 1
                self._counters.sessions_paused += 1
        elif not self._pending or held_bytes <= limit_bytes // 2:
            transport.resume_reading()
            self._reading_paused = False
            self._counters.sessions_paused -= 1

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()
        self._update_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._reading_paused:
            self._reading_paused = False
            self._counters.sessions_paused -= 1
        # Nobody is left to answer: the session's end releases whatever these would have.
        self._pending.clear()
        self._queued_bytes = 0
        self._can_write.set()
        if not self._closed.done():
            self._closed.set_result(None)
