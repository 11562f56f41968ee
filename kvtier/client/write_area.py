"""A session's write area on the client's side: the memory a put's blocks are written to
for the daemon to copy (zerocopy.py has the session), its staging range, and whether a
large put streams."""

from __future__ import annotations

import mmap
import os
import platform
import threading

from kvtier.client.ways import TwoWays
from kvtier.errors import InvalidArgument

# Puts of at least this many bytes may stream: the daemon copies behind the client's
# copy (kvtier.proto, StagedPutRequest.ticket), so the two copies overlap instead of
# adding up. Only where stores become visible to another core in program order (x86-64's
# TSO): elsewhere the daemon could see the byte count before the bytes; its hash would
# then refuse the put (never wrong bytes), so the plain one-exchange put is used there.
# And only where it is faster: it needs a CPU for each copy at once (on the 2-vCPU VM
# measured here, 1.6x faster idle, even with two CPU-bound processes beside it, 3.9x
# slower loaded 12-fold), so each size class of put streams or not by what each way took
# on this host (ways.py). From 256 KiB: with the daemon's loop kept awake after a reply
# (server/awake.py) a streamed 256 KiB put took 124-126 µs p50 here against 148 µs
# whole; at 4-128 KiB neither way was ahead beyond the noise.
STREAM_MIN_BYTES = 256 << 10
STREAMS: bool | None = None if platform.machine() in {"x86_64", "AMD64"} else False


class WriteArea:
    """This session's write area: the memory a put's reserved slots are in. The daemon
    grows it as reservations need; the mapping follows (older mappings are left to the
    garbage collector: another thread may still be copying through one)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._mapping: mmap.mmap | None = None
        self.staging: tuple[int, int] | None = None  # (offset, size): Stage's reply
        self.one_exchange = True  # False: every put reserves and commits (tests run both)
        # None: each size class streams or not by what each way took (`stream_ways`);
        # True: always (tests), False: never (puts written whole before they are sent).
        self.streams = STREAMS
        self.stream_ways = TwoWays()
        self._ticket = 0
        self._staging_held = threading.Lock()
        self._staging_holder: object = None

    def hold_staging(self, wait_s: float | None = 0.0, holder: object = None) -> bool:
        """Take the staging range for one put, waiting up to `wait_s` (None: as long as it
        takes) while another put has it; False if it did not come. Only a thread of the
        sync client waits here: an event loop's must not block (the async client polls
        with 0). `holder`: see `drop_staging_of`."""
        if wait_s is None:
            held = self._staging_held.acquire()
        elif wait_s > 0:
            held = self._staging_held.acquire(timeout=wait_s)
        else:
            held = self._staging_held.acquire(blocking=False)
        if held:
            self._staging_holder = holder
        return held

    def drop_staging(self) -> None:
        self._staging_holder = None
        self._staging_held.release()

    def drop_staging_of(self, holder: object) -> None:
        """Let the range go if `holder` took it: a put interrupted while the client took it
        for that put, before the put could know (Ctrl-C then), must not keep it."""
        if holder is not None and self._staging_holder is holder:
            self.drop_staging()

    def streams_put(self, total_bytes: int) -> bool:
        """Whether a put of `total_bytes` streams (see STREAM_MIN_BYTES)."""
        if self.streams is False or total_bytes < STREAM_MIN_BYTES:
            return False
        return self.streams or self.stream_ways.dear(stream_class(total_bytes))

    def put_took(self, total_bytes: int, streamed: bool, seconds: float) -> None:
        """What a put took, for the choice of way where it could have streamed."""
        if self.streams is None and total_bytes >= STREAM_MIN_BYTES:
            self.stream_ways.took(stream_class(total_bytes), streamed, seconds)

    def next_ticket(self) -> int:
        self._ticket += 1
        return self._ticket

    def slot(self, offset: int, size_bytes: int) -> memoryview:
        """A writable view of the slot at `offset` (from a Reserve reply)."""
        end = offset + size_bytes
        with self._lock:
            mapping = self._mapping
            if mapping is None or len(mapping) < end:
                size = os.fstat(self._fd).st_size
                if size < end:
                    raise InvalidArgument("the reserved slot lies outside the write area")
                mapping = self._mapping = mmap.mmap(self._fd, size, mmap.MAP_SHARED)
        return memoryview(mapping)[offset:end]

    def close(self) -> None:
        self._mapping = None
        os.close(self._fd)


def stream_class(total_bytes: int) -> int:
    """The size class a put's way is measured in: puts within a power of two."""
    return total_bytes.bit_length()
