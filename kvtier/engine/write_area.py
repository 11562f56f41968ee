"""WriteArea: the one memory a zero-copy client may write, one per session.

The tenant's arena is sealed (kvtier/tiers/dram.py): clients map it read-only, so no
client can change a committed block. A zero-copy put therefore writes its reserved slots
here, a small memfd of the session's own; at commit the daemon copies each slot into its
arena extent and hashes the copy it made (`PutWriter.copy_in`), so what becomes visible is
exactly what the checksum covers, whatever the client writes into this area before,
during or after the commit.

Lifecycle: `WriteArea()` at the session's handshake (its fd is passed to the client) ->
`reserve(size)` per reserved slot (the area grows as needed; the client maps more of it
when a slot ends past its mapping) -> `view` at commit -> `free` -> `close()` when the
session ends. A one-exchange put (issue 25) instead names bytes in the session's one
*staging range* (`stage(size)`, which frees the previous range; `staged_view` checks that
what a request names lies inside it): the client lays a put's blocks out there itself.
The area never shrinks (it is sealed against shrinking, so a client cannot truncate it
under the daemon's copy: that would be SIGBUS in the daemon); it is as large as the
session's largest set of reservations at once (and its staging range), at most the
tenant's arena.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
import struct

from kvtier.errors import InvalidArgument
from kvtier.tiers.allocator import round_up
from kvtier.tiers.dram import ALIGN_BYTES

# Growth by the daemon stays possible; a client's ftruncate can only make it larger.
WRITE_AREA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


class WriteArea:
    """Slots of one session's reservations, first fit over a growing memfd."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("kvtier-write", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, WRITE_AREA_SEALS)
        self.size_bytes = 0
        self._map: mmap.mmap | None = None
        self._starts: list[int] = []  # live slots, sorted by offset
        self._ends: dict[int, int] = {}
        self._retired: list[mmap.mmap] = []  # smaller mappings a view may still hold
        self.staging: tuple[int, int] | None = None  # (offset, size) of the staging range

    def reserve(self, size_bytes: int) -> int:
        """The offset of a new slot of `size_bytes` (page-aligned), growing the area if no
        gap between live slots holds it."""
        need = round_up(max(size_bytes, 1), ALIGN_BYTES)
        offset = 0
        for start in self._starts:
            if start - offset >= need:
                break
            offset = max(offset, self._ends[start])
        if offset + need > self.size_bytes:
            self._grow(offset + need)
        bisect.insort(self._starts, offset)
        self._ends[offset] = offset + need
        return offset

    def free(self, offset: int) -> None:
        if self._ends.pop(offset, None) is not None:
            self._starts.remove(offset)

    def stage(self, size_bytes: int) -> tuple[int, int]:
        """A staging range of at least `size_bytes` (page-aligned) in place of the
        previous one: (offset, size); the current one when it is as large already (so
        a repeated Stage costs nothing: it is not rate-limited)."""
        if self.staging is not None and self.staging[1] >= size_bytes:
            return self.staging
        if self.staging is not None:
            self.free(self.staging[0])
            self.staging = None
        size_bytes = round_up(max(size_bytes, 1), ALIGN_BYTES)
        self.staging = (self.reserve(size_bytes), size_bytes)
        return self.staging

    def staged(self, offset: int, size_bytes: int) -> bool:
        """Whether the bytes a one-exchange put names all lie inside the staging range."""
        if self.staging is None or offset < 0 or size_bytes < 0:
            return False
        start, length = self.staging
        return start <= offset and offset + size_bytes <= start + length

    def staged_view(self, offset: int, size_bytes: int) -> memoryview | None:
        """The bytes a one-exchange put names, or None when they are not all inside the
        staging range (a client's mistake, or a hostile one's: never read elsewhere)."""
        return self.view(offset, size_bytes) if self.staged(offset, size_bytes) else None

    def words(self, offset: int, count: int) -> tuple[int, ...]:
        """`count` little-endian u64s at `offset` inside the staging range (a streamed
        put's progress words), as the client last wrote them."""
        staging, mapping = self.staging, self._map
        if staging is None or mapping is None:
            raise InvalidArgument("the session ended during its streamed put")
        start, length = staging
        if offset < start or offset + 8 * count > start + length:
            raise InvalidArgument("a streamed put's header lies outside its staging range")
        return struct.unpack_from(f"<{count}Q", mapping, offset)

    def view(self, offset: int, size_bytes: int) -> memoryview:
        """The slot's bytes as the client left them (release the view after use)."""
        assert self._map is not None and offset + size_bytes <= self.size_bytes
        return memoryview(self._map)[offset : offset + size_bytes]

    def _grow(self, size_bytes: int) -> None:
        # A client may have grown the file itself; never ask for less than it is.
        size_bytes = max(size_bytes, os.fstat(self.fd).st_size)
        os.ftruncate(self.fd, size_bytes)
        if self._map is not None:
            self._retire(self._map)
        self._map = mmap.mmap(self.fd, size_bytes, mmap.MAP_SHARED)
        self.size_bytes = size_bytes

    def _retire(self, mapping: mmap.mmap) -> None:
        try:
            mapping.close()
        except BufferError:  # a view is still out: close it with the area
            self._retired.append(mapping)

    def close(self) -> None:
        for mapping in [*self._retired, *([self._map] if self._map is not None else [])]:
            with contextlib.suppress(BufferError):
                mapping.close()
        self._map = None
        self._retired.clear()
        self._starts.clear()
        self._ends.clear()
        self.staging = None
        with contextlib.suppress(OSError):
            os.close(self.fd)
