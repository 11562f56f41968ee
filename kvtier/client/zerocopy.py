"""The client's side of the zero-copy path: mapping the daemon's shared arena.

`Attach` (gRPC) gives a session id, a nonce and the side socket's path; presenting the
nonce there returns the arena's file descriptor (SCM_RIGHTS), which the client maps. The
side connection stays open: the daemon releases the session's leases when it closes.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import sys
import threading
from typing import Any, TypeVar

from google.protobuf.message import Message

from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import HEADER, Op, frame
from kvtier.errors import InvalidArgument, Unavailable, from_status_value

M = TypeVar("M", bound=Message)

_REPLY = struct.Struct("<QQ")


class SharedArena:
    """A read-write mapping of the daemon's arena, valid while this object is open."""

    def __init__(self, session_id: int, mapping: mmap.mmap, conn: socket.socket) -> None:
        self.session_id = session_id
        self._mapping = mapping
        self._conn = conn
        self._lock = threading.Lock()
        self._inbox = bytearray(64 << 10)
        self.view = memoryview(mapping)

    def call(self, op: Op, request: Message, response_type: type[M]) -> M:
        """One request on the session socket, waiting for its response."""
        payload = request.SerializeToString()
        with self._lock:
            self._conn.sendall(frame(op, payload))
            # One recv usually brings the whole reply; read more only for a long one.
            got = self._conn.recv_into(self._inbox)
            while got < HEADER.size:
                got += self._recv_more(got)
            length, code = HEADER.unpack_from(self._inbox)
            end = HEADER.size + length
            if end > len(self._inbox):
                self._inbox.extend(bytes(end - len(self._inbox)))
            while got < end:
                got += self._recv_more(got)
            reply = bytes(memoryview(self._inbox)[HEADER.size : end])
        if code:
            raise from_status_value(code, reply.decode(errors="replace"))
        return response_type.FromString(reply)

    def send(self, op: Op, request: Message) -> None:
        """A request that gets no response (Release): the caller does not wait."""
        with self._lock:
            self._conn.sendall(frame(op, request.SerializeToString()))

    def _recv_more(self, offset: int) -> int:
        with memoryview(self._inbox) as view:
            got = self._conn.recv_into(view[offset:])
        if not got:
            raise Unavailable("the daemon closed the session")
        return got

    @classmethod
    def attach(cls, resp: pb.AttachResponse) -> SharedArena:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(10)
            conn.connect(resp.arena_socket)
            conn.sendall(resp.nonce)
            msg, fds, _flags, _addr = socket.recv_fds(conn, _REPLY.size, 1)
            if len(msg) != _REPLY.size or not fds:
                raise Unavailable("the daemon refused to share its arena")
            session_id, size = _REPLY.unpack(msg)
            try:
                mapping = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            conn.close()
            raise
        conn.settimeout(None)
        return cls(session_id, mapping, conn)

    def close(self) -> None:
        self.view.release()
        self._mapping.close()
        self._conn.close()


def byte_view(obj: Any, writable: bool) -> memoryview:
    """A flat byte view of a buffer-protocol object or a CPU torch tensor, without copying."""
    try:
        view = memoryview(obj)
    except TypeError:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor):
            raise InvalidArgument(
                f"{type(obj).__name__} does not expose its memory: pass bytes, bytearray, "
                "memoryview, a numpy array or a contiguous CPU torch tensor"
            ) from None
        if obj.device.type != "cpu" or not obj.is_contiguous():
            raise InvalidArgument("a torch tensor must be contiguous and on the CPU") from None
        view = memoryview(obj.reshape(-1).view(torch.uint8).numpy())
    if not view.c_contiguous:
        raise InvalidArgument("the buffer must be C-contiguous")
    if writable and view.readonly:
        raise InvalidArgument("get_into needs a writable buffer (bytearray, memoryview, ...)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
