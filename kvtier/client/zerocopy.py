"""The client's side of the zero-copy path: mapping the daemon's shared arena.

`Attach` (gRPC) gives a session id, a nonce and the side socket's path; presenting the
nonce there returns two file descriptors (SCM_RIGHTS): the arena's, which the daemon has
sealed so that it can only be mapped read-only (gets copy straight out of it; nothing a
client does can change a committed block), and the session's write area, where a put's
reserved slots are (the daemon copies them into the arena at commit and hashes its copy).
The side connection stays open: the daemon releases the session's leases when it closes.

A get reads its tenant's *directory* first where the daemon passed one (a third fd at the
handshake, mapped read-only): a seqlock-validated copy straight out of the arena with no
round trip (kvtier/engine/directory.py); a miss, or a copy the daemon changed under it,
takes the Acquire path. The hits are reported afterwards, batched (`DirectoryReader`).

A put takes one exchange where the daemon offers it (issue 25): the client keeps a
*staging range* of its write area (Stage), lays the put's blocks out there, hashing each
piece as it copies it, and sends StagedPut; else it reserves slots and commits them (two
exchanges).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import platform
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import xxhash
from google.protobuf.message import Message

from kvtier._directory import (
    DIGEST_HI,
    DIGEST_LO,
    ENTRY_BYTES,
    ENTRY_WORDS,
    OFFSET,
    PROBE_SLOTS,
    SEQ,
    SIZE,
    XXH3,
    key_digest,
)
from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import HEADER, MAX_CALLS_PER_HITS, Op, frame
from kvtier.client.ways import ReplyWait
from kvtier.client.write_area import WriteArea
from kvtier.errors import InvalidArgument, Unavailable, from_status_value

M = TypeVar("M", bound=Message)

_REPLY = struct.Struct("<QQ")
# Copy and hash in cache-sized pieces: each piece is hashed while it is still in cache.
COPY_PIECE_BYTES = 256 << 10
STAGE_ALIGN_BYTES = 4096
_WORD = struct.Struct("<Q")
_TICKET = struct.Struct("<QQ")
STREAM_ABANDONED = (1 << 64) - 1
# A client's first read of each arena page faults its mapping in (~0.4 µs a page here:
# 40 % of a 4 MiB get's time, in the first pass over the arena). A background thread
# populates the mapping's page tables at attach instead (MADV_POPULATE_READ, Linux 5.14;
# ~0.3 s of that thread's CPU per GiB, 2 MiB of page tables per GiB), for arenas up to
# PREFAULT_MAX_BYTES; larger ones fault in as they are read.
MADV_POPULATE_READ = 22
# Populating page tables costs CPU beside the engine's first steps: on a host of fewer
# than 4 CPUs it made a real vLLM's first timed prefill take twice its forward pass
# (tests/integration/test_vllm.py), so there the pages fault in as they are read.
PREFAULT_MAX_BYTES = 16 << 30 if (os.cpu_count() or 1) >= 4 else 0
PREFAULT_CHUNK_BYTES = 2 << 20  # mmap.madvise holds the GIL: ~1 ms at most per chunk
# Direct reads validate a copy by reading the entry's sequence word after it: sound only
# where another core sees the daemon's stores in program order (x86-64's TSO; elsewhere a
# reader could see new bytes with the old sequence word), so elsewhere every get acquires.
DIRECT_READS = platform.machine() in {"x86_64", "AMD64"}
# Direct hits are reported to the daemon (HITS, no reply) once this many are pending, once
# the oldest has waited HITS_EVERY_S, or before the next request that goes to the daemon.
HITS_BATCH = 64
HITS_EVERY_S = 0.05


class DirectoryReader:
    """This session's read-only mapping of its tenant's directory: `read_into` copies a
    block out of the arena without asking the daemon, and keeps the hits to report."""

    def __init__(self, fd: int) -> None:
        try:
            size = os.fstat(fd).st_size
            entries = size // ENTRY_BYTES
            if entries <= 0 or entries & (entries - 1) or size % ENTRY_BYTES:
                raise Unavailable("the daemon's directory has an unexpected size")
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("Q")  # an item read is one 8-byte load
        self._mask = entries - 1
        self.enabled = DIRECT_READS  # False: every get acquires (tests run both)
        self._namespaces: dict[str, bytes] = {}
        self._pending: list[tuple[str, bytes, int, float]] = []
        self._calls: list[tuple[str, int, int, float]] = []  # (namespace, blocks, bytes, s)
        self._oldest_s = 0.0

    def read_into(
        self, namespace: str, key: bytes, arena: memoryview, parts: Parts, verify: bool
    ) -> int | None:
        """Copy the block of (namespace, key) into `parts` if the directory has it and it
        did not change during the copy: its size, else None (then `parts` may hold any
        bytes; the caller acquires). A block larger than `parts` is None too: the Acquire
        path says why."""
        encoded = self._namespaces.get(namespace)
        if encoded is None:
            encoded = self._namespaces[namespace] = namespace.encode()
        low, high = key_digest(encoded, key)
        words = self._words
        for i in range(PROBE_SLOTS):
            base = ((low + i) & self._mask) * ENTRY_WORDS
            seq = words[base + SEQ]  # first: every word read below is checked against it
            if words[base + DIGEST_LO] != low or words[base + DIGEST_HI] != high:
                continue
            if seq & 1 or not seq:
                return None  # being written
            offset = words[base + OFFSET]
            size = words[base + SIZE]
            xxh3_64 = words[base + XXH3]
            if offset + size > arena.nbytes or size > parts_bytes(parts):
                return None
            filled = scatter(arena[offset : offset + size], parts)
            # After the copy in program order: a block unpublished (then freed, rewritten)
            # while it was copied has a new sequence word by now.
            if words[base + SEQ] != seq:
                return None
            if verify and checksum(filled) != xxh3_64:
                return None
            return int(size)
        return None

    def hit(self, namespace: str, key: bytes, size_bytes: int, fetch_s: float) -> bool:
        """Keep a hit to report; True when the pending hits are due to be sent."""
        now_s = time.monotonic()
        pending = self._pending
        if not pending:
            self._oldest_s = now_s
        pending.append((namespace, key, size_bytes, fetch_s))  # messages made when sent
        return len(pending) >= HITS_BATCH or now_s - self._oldest_s >= HITS_EVERY_S

    def call(self, namespace: str, blocks: int, size_bytes: int, seconds: float) -> None:
        """Keep one call's direct reads as its caller waited for them (reported with its
        hits): the daemon prices a run from whole calls, which the copies alone undercount."""
        calls = self._calls
        if len(calls) >= MAX_CALLS_PER_HITS:  # a report's bound (its frame's cap): the newest
            del calls[0]
        calls.append((namespace, blocks, size_bytes, seconds))

    @property
    def pending(self) -> bool:
        """Whether hits wait to be reported."""
        return bool(self._pending)

    def take_hits(self) -> list[pb.HitsRequest]:
        """The pending hits as reports, one per namespace; they are no longer pending."""
        pending, self._pending = self._pending, []
        calls, self._calls = self._calls, []
        by_namespace: dict[str, list[pb.DirectHit]] = {}
        for namespace, key, size_bytes, fetch_s in pending:
            by_namespace.setdefault(namespace, []).append(
                pb.DirectHit(key=key, size_bytes=size_bytes, fetch_seconds=fetch_s)
            )
        calls_of: dict[str, list[pb.DirectCall]] = {}
        for namespace, blocks, size_bytes, seconds in calls:
            calls_of.setdefault(namespace, []).append(
                pb.DirectCall(blocks=blocks, bytes=size_bytes, seconds=seconds)
            )
        return [
            pb.HitsRequest(namespace=ns, hits=hits, calls=calls_of.get(ns, []))
            for ns, hits in by_namespace.items()
        ]

    def close(self) -> None:
        self._words.release()
        self._map.close()


class _ArenaMapping(mmap.mmap):
    """The read-only arena mapping, carrying the session's write area and directory: the
    client core sees the arena as a memoryview, whose `.obj` is this (`write_area_of`,
    `directory_of`)."""

    write_area: WriteArea | None = None
    directory: DirectoryReader | None = None


class SharedArena:
    """A read-only mapping of the daemon's arena and the session's write area, valid
    while this object is open."""

    def __init__(
        self,
        session_id: int,
        mapping: mmap.mmap,
        conn: socket.socket,
        write_area: WriteArea | None = None,
        directory: DirectoryReader | None = None,
    ) -> None:
        self.session_id = session_id
        self._mapping = mapping
        self._conn = conn
        self._lock = threading.Lock()  # one exchange (request, then its reply) at a time
        self._send_lock = threading.Lock()  # one frame at a time
        self._inbox = bytearray(64 << 10)
        self.reply_wait = ReplyWait()  # polling for a reply or asleep (ways.py)
        self.write_area = write_area
        self.directory = directory
        if isinstance(mapping, _ArenaMapping):
            mapping.write_area = write_area
            mapping.directory = directory
        self.view = memoryview(mapping)

    def slot(self, slot: pb.Slot) -> memoryview:
        """Where to write a reserved slot (Reserve's reply) before committing it."""
        if self.write_area is None:
            raise Unavailable("the daemon gave this session no write area")
        return self.write_area.slot(slot.offset, slot.size_bytes)

    def call(
        self,
        op: Op,
        request: Message,
        response_type: type[M],
        while_waiting: Callable[[], object] | None = None,
        size_class: int = 0,
    ) -> M:
        """One request on the session socket, waiting for its response; `while_waiting`
        runs once the request is sent (a streamed put's copy), its failure raised after
        the reply is read (the stream stays in step). `size_class`: the bytes it moves,
        as `stream_class` (0: none), for the choice of how to wait."""
        payload = request.SerializeToString()
        failure: BaseException | None = None
        with self._lock:
            with self._send_lock:
                self._conn.sendall(frame(op, payload))
            if while_waiting is not None:
                try:
                    while_waiting()
                except BaseException as err:
                    failure = err
            # One recv usually brings the whole reply; read more only for a long one.
            wait_key = (op, size_class)
            polls = self.reply_wait.polls(wait_key)
            began = time.perf_counter()
            got = (polls and self._poll_reply()) or self._conn.recv_into(self._inbox)
            self.reply_wait.took(wait_key, polls, time.perf_counter() - began)
            while got < HEADER.size:
                got += self._recv_more(got)
            length, code = HEADER.unpack_from(self._inbox)
            end = HEADER.size + length
            if end > len(self._inbox):
                self._inbox.extend(bytes(end - len(self._inbox)))
            while got < end:
                got += self._recv_more(got)
            reply = bytes(memoryview(self._inbox)[HEADER.size : end])
        if failure is not None:
            raise failure
        if code:
            raise from_status_value(code, reply.decode(errors="replace"))
        return response_type.FromString(reply)

    def send(self, op: Op, request: Message) -> None:
        """A request that gets no response (Release): the caller does not wait, not even
        for a call in progress on another thread (only for its frame to go out whole).
        The daemon runs it beside a request that waits (kvtier/server/arena_socket.py),
        so a put waiting for DRAM this client's lease pins is freed by that Release."""
        with self._send_lock:
            self._conn.sendall(frame(op, request.SerializeToString()))

    def _poll_reply(self) -> int:
        """The reply's first bytes if they come within `reply_wait.spin_s`, else 0: then
        the caller waits asleep (and on a closed socket, finds it closed there)."""
        conn, inbox = self._conn, self._inbox
        until = time.perf_counter() + self.reply_wait.spin_s
        while True:
            try:
                return conn.recv_into(inbox, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= until:
                    return 0

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
            msg, fds, _flags, _addr = socket.recv_fds(conn, _REPLY.size, 3)
            # The arena, the write area, then (where the daemon has direct reads on) the
            # tenant's directory.
            directory_fd = fds.pop(2) if len(fds) > 2 else None
            write_area = WriteArea(fds.pop(1)) if len(fds) > 1 else None
            directory: DirectoryReader | None = None
            try:
                if len(msg) != _REPLY.size or not fds:
                    raise Unavailable("the daemon refused to share its arena")
                session_id, size = _REPLY.unpack(msg)
                if directory_fd is not None:
                    handed, directory_fd = directory_fd, None  # the reader closes it
                    directory = DirectoryReader(handed)
                # Read-only: the daemon sealed the arena, a writable mapping is refused.
                mapping = _ArenaMapping(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ)
            except BaseException:
                if directory_fd is not None:
                    os.close(directory_fd)
                if directory is not None:
                    directory.close()
                if write_area is not None:
                    write_area.close()
                raise
            finally:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            conn.close()
            raise
        conn.settimeout(None)
        if size <= PREFAULT_MAX_BYTES:
            threading.Thread(
                target=_prefault, args=(mapping,), name="kvtier-arena-prefault", daemon=True
            ).start()
        return cls(session_id, mapping, conn, write_area, directory)

    def close(self) -> None:
        self.view.release()
        self._mapping.close()
        if self.write_area is not None:
            self.write_area.close()
        if self.directory is not None:
            self.directory.close()
        self._conn.close()


def _prefault(mapping: mmap.mmap) -> None:
    """Populate the read-only arena mapping's page tables, a chunk at a time; stops at
    the first refusal (an older kernel) or once the mapping is closed."""
    try:
        for start in range(0, len(mapping), PREFAULT_CHUNK_BYTES):
            length = min(PREFAULT_CHUNK_BYTES, len(mapping) - start)
            mapping.madvise(MADV_POPULATE_READ, start, length)
            time.sleep(0)  # let the caller's threads have the GIL between chunks
    except (OSError, ValueError):
        return


class AsyncSharedArena:
    """The same session for asyncio code: requests go through the event loop."""

    def __init__(self, arena: SharedArena) -> None:
        self._arena = arena
        self.session_id = arena.session_id
        self.view = arena.view
        self.slot = arena.slot
        self.directory = arena.directory
        self._conn = arena._conn
        self._conn.setblocking(False)
        self._lock = asyncio.Lock()  # one exchange (request, then its reply) at a time
        self._send_lock = asyncio.Lock()  # one frame at a time

    @classmethod
    async def attach(cls, resp: pb.AttachResponse) -> AsyncSharedArena:
        return cls(await asyncio.to_thread(SharedArena.attach, resp))

    async def call(
        self,
        op: Op,
        request: Message,
        response_type: type[M],
        while_waiting: Callable[[], object] | None = None,
    ) -> M:
        loop = asyncio.get_running_loop()
        failure: BaseException | None = None
        async with self._lock:
            async with self._send_lock:
                await loop.sock_sendall(self._conn, frame(op, request.SerializeToString()))
            if while_waiting is not None:
                try:
                    while_waiting()  # a memory copy: what a put does on the loop anyway
                except BaseException as err:
                    failure = err
            header = await self._recv_exact(HEADER.size)
            length, code = HEADER.unpack(header)
            reply = await self._recv_exact(length)
        if failure is not None:
            raise failure
        if code:
            raise from_status_value(code, reply.decode(errors="replace"))
        return response_type.FromString(reply)

    async def send(self, op: Op, request: Message) -> None:
        """As `SharedArena.send`: waits for no call in progress, only for its frame."""
        async with self._send_lock:
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


Parts = list[memoryview]


def reserve_request(
    namespace: str, keys: list[bytes], blocks: list[Parts], overwrite: bool
) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        namespace=namespace,
        items=[
            pb.ReserveItem(key=k, size_bytes=parts_bytes(p))
            for k, p in zip(keys, blocks, strict=True)
        ],
        overwrite=overwrite,
    )


class _InPlace:
    """Slots in a writable session memory itself (a stand-in session, as in the core's
    unit tests; a daemon's arena is always read-only)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view

    def slot(self, offset: int, size_bytes: int) -> memoryview:
        return self._view[offset : offset + size_bytes]


def write_area_of(arena: memoryview) -> WriteArea | _InPlace | None:
    """Where a put's reserved slots are written for the session whose arena is mapped at
    `arena`: its write area; None if the daemon gave none (puts then take the gRPC byte
    path)."""
    mapping = arena.obj
    if isinstance(mapping, _ArenaMapping):
        return mapping.write_area
    return None if arena.readonly else _InPlace(arena)


def directory_of(arena: memoryview) -> DirectoryReader | None:
    """The directory of the session whose arena is mapped at `arena`, if it reads directly."""
    mapping = arena.obj
    if isinstance(mapping, _ArenaMapping) and mapping.directory is not None:
        return mapping.directory if mapping.directory.enabled else None
    return None


def fill_slots(
    area: WriteArea | _InPlace, slots: Iterable[pb.Slot], blocks: list[Parts]
) -> list[int]:
    """Copy each block's parts, back to back, into its reserved slot of the session's
    write area; returns their checksums for the commit."""
    checksums = []
    for slot, parts in zip(slots, blocks, strict=True):
        with area.slot(slot.offset, slot.size_bytes) as place:
            checksums.append(copy_hashed(place, parts))
    return checksums


def _aligned(size_bytes: int) -> int:
    return -(-max(size_bytes, 1) // STAGE_ALIGN_BYTES) * STAGE_ALIGN_BYTES


def staging_bytes(blocks: list[Parts], streamed: bool = False) -> int:
    """The staging range a put of `blocks` needs (each block page-aligned, after the
    progress words when streamed)."""
    header = _aligned(8 * (2 + len(blocks))) if streamed else 0
    return header + sum(_aligned(parts_bytes(p)) for p in blocks)


class StreamedPut:
    """A put whose request goes first: `request` names where each block will be, and
    `write()`, run once it is sent, copies the blocks there piece by piece, publishing
    each block's checksum and then the byte count after each piece (the daemon copies
    behind it). Needs the staging range held, and `staging_bytes(blocks, True)` of it."""

    def __init__(
        self,
        area: WriteArea,
        namespace: str,
        keys: list[bytes],
        blocks: list[Parts],
        overwrite: bool,
    ) -> None:
        assert area.staging is not None
        self._area = area
        self._blocks = blocks
        self._header = area.staging[0]
        self._ticket = area.next_ticket()
        offset = self._header + _aligned(8 * (2 + len(blocks)))
        items = []
        for key, parts in zip(keys, blocks, strict=True):
            size = parts_bytes(parts)
            items.append(pb.StagedPutItem(key=key, size_bytes=size, offset=offset))
            offset += _aligned(size)
        self.request = pb.StagedPutRequest(
            namespace=namespace, items=items, overwrite=overwrite, ticket=self._ticket
        )
        with area.slot(self._header, 8 * (2 + len(blocks))) as words:
            words[16:] = bytes(8 * len(blocks))  # no checksum left from an earlier put
            _TICKET.pack_into(words, 0, self._ticket, 0)  # before the request is sent

    def write(self) -> None:
        area = self._area
        with area.slot(self._header, 8 * (2 + len(self._blocks))) as words:
            try:
                written = 0
                for i, (item, parts) in enumerate(
                    zip(self.request.items, self._blocks, strict=True)
                ):
                    with area.slot(item.offset, item.size_bytes) as place:
                        hasher = xxhash.xxh3_64()
                        for start, end, piece in _pieces(place, parts):
                            hasher.update(piece)
                            if end == item.size_bytes:  # its checksum before its last bytes
                                _WORD.pack_into(words, 16 + 8 * i, hasher.intdigest())
                            written += end - start
                            _WORD.pack_into(words, 8, written)
            except BaseException:
                _WORD.pack_into(words, 8, STREAM_ABANDONED)  # the daemon stops waiting
                raise


def _pieces(place: memoryview, parts: Parts) -> Iterable[tuple[int, int, memoryview]]:
    """Copy the parts back to back into `place` a piece at a time, yielding each piece
    once copied: (start, end) in the block, and the copy."""
    offset = 0
    for part in parts:
        for start in range(0, part.nbytes, COPY_PIECE_BYTES):
            end = min(start + COPY_PIECE_BYTES, part.nbytes)
            piece = place[offset : offset + end - start]
            piece[:] = part[start:end]
            yield offset, offset + end - start, piece
            offset += end - start


def staged_put_request(
    area: WriteArea, namespace: str, keys: list[bytes], blocks: list[Parts], overwrite: bool
) -> pb.StagedPutRequest:
    """Copy the blocks back to back into the staging range (held, and large enough) and
    name them: one pass over each byte, hashed piece by piece right after its copy."""
    assert area.staging is not None
    offset = area.staging[0]
    items = []
    for key, parts in zip(keys, blocks, strict=True):
        block_bytes = parts_bytes(parts)
        with area.slot(offset, block_bytes) as place:
            items.append(
                pb.StagedPutItem(
                    key=key,
                    size_bytes=block_bytes,
                    offset=offset,
                    xxh3_64=copy_hashed(place, parts),
                )
            )
        offset += _aligned(block_bytes)
    return pb.StagedPutRequest(namespace=namespace, items=items, overwrite=overwrite)


def copy_hashed(place: memoryview, parts: Parts) -> int:
    """Copy the parts back to back into `place`; the xxh3-64 of what was written, each
    piece hashed from `place` right after it was copied (still in cache)."""
    hasher = xxhash.xxh3_64()
    for _, _, piece in _pieces(place, parts):
        hasher.update(piece)
    return hasher.intdigest()


def commit_results(done: pb.CommitResponse | pb.CudaPutResponse) -> list[bool]:
    """Per block: stored now (True) or already there (False); raises the first failure."""
    for result in done.results:
        if result.code:
            raise from_status_value(result.code, result.message)
    return [r.stored for r in done.results]


def copy_out(
    arena: memoryview, blocks: Iterable[pb.LeasedBlock], buffers: list[Parts], verify: bool
) -> list[int | None]:
    """Copy leased blocks out of the mapped `arena` into their buffers (each block's parts
    filled in order); None for each miss. `verify`: a block whose copy does not match its
    checksum is a miss too (None), never wrong bytes and never an error: nothing but the
    daemon can write the arena, so a retry would read the same bytes."""
    out: list[int | None] = []
    for block, parts in zip(blocks, buffers, strict=True):
        if not block.found:
            out.append(None)
            continue
        size = block.size_bytes
        check_fits(size, parts)
        filled = scatter(arena[block.offset : block.offset + size], parts)
        if verify and checksum(filled) != block.xxh3_64:
            out.append(None)
            continue
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


def copy_bytes(data: bytes | None, parts: Parts) -> int | None:
    """The byte-path fallback of get_into: copy what get() returned."""
    if data is None:
        return None
    check_fits(len(data), parts)
    scatter(memoryview(data), parts)
    return len(data)


def scatter(data: memoryview, parts: Parts) -> Parts:
    """Copy `data` into `parts` in order; the filled prefixes of the parts."""
    filled: Parts = []
    offset = 0
    for part in parts:
        if offset == data.nbytes:
            break
        n = min(part.nbytes, data.nbytes - offset)
        part[:n] = data[offset : offset + n]
        filled.append(part[:n])
        offset += n
    return filled


def checksum(parts: Parts) -> int:
    """xxh3-64 of the parts as one byte string."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


def parts_bytes(parts: Parts) -> int:
    return sum(part.nbytes for part in parts)


def check_fits(size: int, parts: Parts) -> None:
    room = parts_bytes(parts)
    if size > room:
        raise InvalidArgument(f"buffer of {room} bytes is too small for a {size}-byte block")


def block_parts(obj: Any, writable: bool) -> Parts:
    """A block's buffer as parts: one buffer, or a list/tuple of buffers that hold the
    block back to back (for example one slice per layer of an engine's KV cache)."""
    if isinstance(obj, list | tuple):
        return [byte_view(part, writable) for part in obj]
    return [byte_view(obj, writable)]


def joined(parts: Parts) -> memoryview:
    """One buffer with the parts' bytes (a copy only when there are several)."""
    return parts[0] if len(parts) == 1 else memoryview(b"".join(parts))


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
