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
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier._session import HEADER, MAX_FRAME_BYTES, Op, frame
from kvtier.errors import Unimplemented, to_status

logger = logging.getLogger(__name__)

NONCE_BYTES = 16
REPLY = struct.Struct("<QQ")
HANDSHAKE_TIMEOUT_S = 5.0


MAX_PENDING_SESSIONS = 4096
SessionHandler = Callable[[int, int, bytes], Awaitable[tuple[int, bytes]]]


async def _no_handler(session_id: int, op: int, payload: bytes) -> tuple[int, bytes]:
    status = to_status(Unimplemented("no request handler"))
    return status.value, status.message.encode()


@dataclass(slots=True)
class Session:
    session_id: int
    nonce: bytes
    tenant: str
    ended: bool = False


class ArenaSocket:
    """Sessions and the side socket. Lifecycle: `start()`, `new_session()`..., `close()`."""

    def __init__(
        self,
        path: Path,
        arena_for: Callable[[str], tuple[int, int]],
        on_session_end: Callable[[int], object],
    ) -> None:
        self.path = path
        self._arena_for = arena_for  # tenant -> (memfd, size) of its own arena
        self._on_session_end = on_session_end
        self._handler: SessionHandler = _no_handler
        self._write_area_for: Callable[[int], int] | None = None
        self._by_nonce: dict[bytes, Session] = {}  # attached, not yet connected
        self._sessions: dict[int, Session] = {}
        self._next_id = 1
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

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
        self._spawn(self._accept_forever())

    def set_handler(self, handler: SessionHandler) -> None:
        """Who answers framed requests: (session id, op, payload) -> (status code, reply)."""
        self._handler = handler

    def set_write_areas(self, write_area_for: Callable[[int], int]) -> None:
        """Who makes a session's write area: session id -> the memfd to pass its client."""
        self._write_area_for = write_area_for

    def new_session(self, tenant: str) -> Session:
        while len(self._by_nonce) >= MAX_PENDING_SESSIONS:  # attached but never connected
            stale = self._by_nonce.pop(next(iter(self._by_nonce)))
            self._end(stale)
        session = Session(self._next_id, secrets.token_bytes(NONCE_BYTES), tenant)
        self._next_id += 1
        self._by_nonce[session.nonce] = session
        self._sessions[session.session_id] = session
        return session

    def tenant_of(self, session_id: int) -> str | None:
        """The tenant a live session was opened for; None if unknown or ended."""
        session = self._sessions.get(session_id)
        return session.tenant if session is not None and not session.ended else None

    def _end(self, session: Session) -> None:
        session.ended = True
        self._sessions.pop(session.session_id, None)
        self._on_session_end(session.session_id)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            self._spawn(self._serve(conn))

    async def _serve_requests(self, conn: socket.socket, session_id: int) -> None:
        """Answer framed requests (see kvtier._session) until the client closes."""
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()
        transport, _ = await loop.connect_accepted_socket(
            lambda: _SessionProtocol(session_id, self._handler, closed), sock=conn
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
            session = self._by_nonce.pop(nonce, None)
            if session is None:
                logger.warning("arena socket: refused a connection with an unknown nonce")
                return
            arena_fd, arena_bytes = self._arena_for(session.tenant)
            fds = [arena_fd]
            if self._write_area_for is not None:
                fds.append(self._write_area_for(session.session_id))
            socket.send_fds(conn, [REPLY.pack(session.session_id, arena_bytes)], fds)
            await self._serve_requests(conn, session.session_id)
        except (TimeoutError, OSError):
            pass
        finally:
            conn.close()
            if session is not None:
                self._end(session)


class _SessionProtocol(asyncio.Protocol):
    """Frames in, replies out, in order. A transport callback rather than sock_recv: no
    selector re-registration per request (tens of microseconds on a 256 KiB get)."""

    def __init__(
        self, session_id: int, handler: SessionHandler, closed: asyncio.Future[None]
    ) -> None:
        self._session_id = session_id
        self._handler = handler
        self._closed = closed
        self._buf = bytearray()
        self._pending: collections.deque[tuple[int, bytes]] = collections.deque()
        self._worker: asyncio.Task[None] | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while len(buf) >= HEADER.size:
            length, op = HEADER.unpack_from(buf)
            if length > MAX_FRAME_BYTES:
                logger.warning(
                    "session %d sent a %d-byte frame; closing it", self._session_id, length
                )
                assert self._transport is not None
                self._transport.close()
                return
            if len(buf) < HEADER.size + length:
                break
            self._pending.append((op, bytes(buf[HEADER.size : HEADER.size + length])))
            del buf[: HEADER.size + length]
        if self._pending and self._worker is None:
            self._worker = asyncio.ensure_future(self._work())

    async def _work(self) -> None:
        try:
            while self._pending:
                op, payload = self._pending.popleft()
                code, reply = await self._handler(self._session_id, op, payload)
                if op != Op.RELEASE and self._transport is not None:
                    self._transport.write(frame(code, reply))
        finally:
            self._worker = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if not self._closed.done():
            self._closed.set_result(None)
