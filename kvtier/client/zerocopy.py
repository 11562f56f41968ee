"""The client's side of the zero-copy path: mapping the daemon's shared arena.

`Attach` (gRPC) gives a session id, a nonce and the side socket's path; presenting the
nonce there returns the arena's file descriptor (SCM_RIGHTS), which the client maps. The
side connection stays open: the daemon releases the session's leases when it closes.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, TypeVar

import xxhash
from google.protobuf.message import Message

from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import HEADER, Op, frame
from kvtier.errors import DataLoss, InvalidArgument, Unavailable, from_status_value

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


class AsyncSharedArena:
    """The same session for asyncio code: requests go through the event loop."""

    def __init__(self, arena: SharedArena) -> None:
        self._arena = arena
        self.session_id = arena.session_id
        self.view = arena.view
        self._conn = arena._conn
        self._conn.setblocking(False)
        self._lock = asyncio.Lock()

    @classmethod
    async def attach(cls, resp: pb.AttachResponse) -> AsyncSharedArena:
        return cls(await asyncio.to_thread(SharedArena.attach, resp))

    async def call(self, op: Op, request: Message, response_type: type[M]) -> M:
        loop = asyncio.get_running_loop()
        async with self._lock:
            await loop.sock_sendall(self._conn, frame(op, request.SerializeToString()))
            header = await self._recv_exact(HEADER.size)
            length, code = HEADER.unpack(header)
            reply = await self._recv_exact(length)
        if code:
            raise from_status_value(code, reply.decode(errors="replace"))
        return response_type.FromString(reply)

    async def send(self, op: Op, request: Message) -> None:
        async with self._lock:
            await asyncio.get_running_loop().sock_sendall(
                self._conn, frame(op, request.SerializeToString())
            )

    async def _recv_exact(self, size: int) -> bytes:
        loop = asyncio.get_running_loop()
        out = bytearray()
        while len(out) < size:
            part = await loop.sock_recv(self._conn, size - len(out))
            if not part:
                raise Unavailable("the daemon closed the session")
            out += part
        return bytes(out)

    def close(self) -> None:
        self._arena.close()


AnyArena = SharedArena | AsyncSharedArena


def reserve_request(
    namespace: str, keys: list[bytes], views: list[memoryview], overwrite: bool
) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        namespace=namespace,
        items=[
            pb.ReserveItem(key=k, size_bytes=v.nbytes) for k, v in zip(keys, views, strict=True)
        ],
        overwrite=overwrite,
    )


def fill_slots(arena: AnyArena, slots: Iterable[pb.Slot], views: list[memoryview]) -> list[int]:
    """Copy each buffer into its reserved slot; returns their checksums for the commit."""
    checksums = []
    for slot, view in zip(slots, views, strict=True):
        arena.view[slot.offset : slot.offset + slot.size_bytes] = view
        checksums.append(xxhash.xxh3_64_intdigest(view))
    return checksums


def commit_results(done: pb.CommitResponse) -> list[bool]:
    """Per block: stored now (True) or already there (False); raises the first failure."""
    for result in done.results:
        if result.code:
            raise from_status_value(result.code, result.message)
    return [r.stored for r in done.results]


def copy_out(
    arena: AnyArena, blocks: Iterable[pb.LeasedBlock], views: list[memoryview], verify: bool
) -> list[int | None]:
    """Copy leased blocks out of the arena into their buffers; None for each miss."""
    out: list[int | None] = []
    for block, view in zip(blocks, views, strict=True):
        if not block.found:
            out.append(None)
            continue
        size = block.size_bytes
        check_fits(size, view)
        view[:size] = arena.view[block.offset : block.offset + size]
        if verify and xxhash.xxh3_64_intdigest(view[:size]) != block.xxh3_64:
            raise DataLoss("block bytes changed in the shared arena; retry the get")
        out.append(size)
    return out


def release_request(lease_id: int, started_s: float, copied: list[int | None]) -> pb.ReleaseRequest:
    """Release a lease, reporting how long the fetch took as the caller saw it (from
    sending Acquire to the last byte copied): the daemon's DRAM path estimate learns from it.
    Nothing is reported when the copy did not finish."""
    fetch_bytes = sum(size for size in copied if size)
    if not fetch_bytes:
        return pb.ReleaseRequest(lease_ids=[lease_id])
    return pb.ReleaseRequest(
        lease_ids=[lease_id],
        fetch_seconds=time.perf_counter() - started_s,
        fetch_bytes=fetch_bytes,
    )


def copy_bytes(data: bytes | None, view: memoryview) -> int | None:
    """The byte-path fallback of get_into: copy what get() returned."""
    if data is None:
        return None
    check_fits(len(data), view)
    view[: len(data)] = data
    return len(data)


def check_fits(size: int, view: memoryview) -> None:
    if size > view.nbytes:
        raise InvalidArgument(f"buffer of {view.nbytes} bytes is too small for a {size}-byte block")


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
