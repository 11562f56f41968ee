"""DRAM tier: one fixed-capacity arena mapped at start; blocks are extents inside it.

The arena is a memfd that the zero-copy path hands to local clients, sealed so that only
this process's own mapping can write it (`F_SEAL_FUTURE_WRITE`): a client can map it for
reading only, and nothing it does can change a committed block. No memory is allocated
per block on the hot path. Extents are page-aligned and a block's
padding up to its extent end is zeroed, so an extent can be written to disk with
O_DIRECT straight from the arena.

Lifecycle: `DramTier(capacity)` maps the arena -> `allocate` an extent -> write into
`view(extent)` -> the store catalogues it -> `free(extent)` once nothing reads it ->
`close()` after every view has been released.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import time

from kvtier.tiers.allocator import Extent, extent_allocator

ALIGN_BYTES = 4096
# Linux 5.1+: no new writable mapping and no write(2) from anyone; mappings that already
# exist (the daemon's own) keep writing. Python 3.11's fcntl does not name it.
F_SEAL_FUTURE_WRITE = 0x0010
ARENA_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Linux 5.14+: fault a range in as if it were written. MAP_POPULATE faults a shared
# mapping in for reading: each page present but clean, so its first write made the CPU
# set the page-table entry's dirty bit (user time, no fault): a 256 KiB put's copy into
# an extent not yet written took 65 µs against 26-31 µs, until the puts had gone once
# round the whole arena.
MADV_POPULATE_WRITE = 23


class DramTier:
    name = "dram"

    def __init__(self, capacity_bytes: int, prefault: bool = True) -> None:
        self.capacity_bytes = capacity_bytes - capacity_bytes % ALIGN_BYTES
        self._fd = os.memfd_create("kvtier-dram", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, self.capacity_bytes)
        started_s = time.perf_counter()
        self._map = mmap.mmap(self._fd, self.capacity_bytes, flags=mmap.MAP_SHARED)
        if prefault:  # page faults off the hot path: they were a third of a put's time
            populate_for_writing(self.address, self.capacity_bytes)
        self.startup_s = time.perf_counter() - started_s
        # Sealed after the daemon's one writable mapping exists: every other mapping, in
        # any process, is read-only (PROT_WRITE on a shared mapping, mprotect, pwrite,
        # reopening /proc/PID/fd/N read-write, ftruncate and hole punching all fail with
        # EPERM/EACCES), and the seals themselves cannot be removed (F_SEAL_SEAL).
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
        self._view = memoryview(self._map)
        self._allocator = extent_allocator(self.capacity_bytes, ALIGN_BYTES)

    @property
    def address(self) -> int:
        """Where the arena is mapped in this process (for cudaHostRegister)."""
        anchor = ctypes.c_char.from_buffer(self._map)
        try:
            return ctypes.addressof(anchor)
        finally:
            del anchor  # the export would keep the mapping from being closed

    @property
    def whole(self) -> memoryview:
        """The whole arena (for the GPU path's copies, which address it by offset)."""
        return self._view

    @property
    def fd(self) -> int:
        """The arena's memfd, handed to local clients for the zero-copy path: sealed, so a
        client can map it read-only and nothing more."""
        return self._fd

    @property
    def used_bytes(self) -> int:
        return self._allocator.used_bytes

    def allocate(self, size_bytes: int) -> Extent | None:
        return self._allocator.allocate(size_bytes)

    def free(self, extent: Extent) -> None:
        self._allocator.free(extent)

    def view(self, extent: Extent) -> memoryview:
        """The whole extent (block bytes, then zero padding to the extent end)."""
        return self._view[extent.offset : extent.offset + extent.size_bytes]

    def zero_tail(self, extent: Extent, size_bytes: int) -> None:
        tail = extent.size_bytes - size_bytes
        if tail:
            start = extent.offset + size_bytes
            self._view[start : start + tail] = bytes(tail)

    def largest_free_bytes(self) -> int:
        return self._allocator.largest_free_bytes()

    def close(self) -> None:
        self._view.release()
        self._map.close()
        os.close(self._fd)


def populate_for_writing(address: int, size_bytes: int) -> None:
    """Fault [address, address + size) in, each page mapped dirty (the GIL released
    meanwhile): by MADV_POPULATE_WRITE, else, on a kernel without it, by writing zeros
    over it (the range must be fresh)."""
    libc = ctypes.CDLL(None, use_errno=True)
    done = libc.madvise(
        ctypes.c_void_p(address), ctypes.c_size_t(size_bytes), ctypes.c_int(MADV_POPULATE_WRITE)
    )
    if done != 0:
        ctypes.memset(address, 0, size_bytes)
