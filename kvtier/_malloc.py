"""glibc malloc thresholds for processes that move multi-MiB buffers through gRPC.

gRPC Python builds each received message in fresh buffers (the message, then the bytes a
caller gets), and a block of a few MiB is above glibc's default mmap threshold: each such
buffer is a new mmap whose pages fault in on first touch and are unmapped on free.
Measured on the 2-vCPU VM: a 4 MiB gRPC Get spent more time in those page faults than in
copying (client CPU 7.4 ms per get before, about 2 ms after). Raising the mmap and trim
thresholds lets malloc hand back warm pages instead. Setting them also turns off glibc's
own adaptive threshold, so both are set together. No effect (and no error) on a libc
without mallopt.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def raise_thresholds(mmap_threshold_bytes: int, trim_threshold_bytes: int) -> bool:
    """Serve allocations below `mmap_threshold_bytes` from the heap, and keep up to
    `trim_threshold_bytes` of free heap before returning it to the kernel. True if set."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes)
        and mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes)
    )


def trim_heap() -> bool:
    """Return the free heap glibc keeps to the kernel (malloc_trim(0)): after a burst of
    short-lived allocations that will not recur, such as the NVMe recovery's scan, which
    the trim threshold set above would otherwise keep for the rest of the run. True if
    memory was released; False on a libc without it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(malloc_trim(0))
