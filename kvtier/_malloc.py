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

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


_set_trim_threshold_bytes: int | None = None  # what raise_thresholds set (None: never)
_LOW_TRIM_THRESHOLD_BYTES = 128 << 10  # glibc's default


def raise_thresholds(mmap_threshold_bytes: int, trim_threshold_bytes: int) -> bool:
    """Serve allocations below `mmap_threshold_bytes` from the heap, and keep up to
    `trim_threshold_bytes` of free heap before returning it to the kernel. True if set."""
    global _set_trim_threshold_bytes
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    done = bool(
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes)
        and mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes)
    )
    if done:
        _set_trim_threshold_bytes = trim_threshold_bytes
    return done


def limit_arenas(arenas: int) -> bool:
    """At most `arenas` malloc arenas for the process's threads, unless MALLOC_ARENA_MAX
    already says (the operator's choice wins). glibc gives each new thread that meets
    contention an arena of its own, up to 8 a core, and frees into it stay there: after a
    1 M-record segment restart, ~23 MiB sat free in the recovery threads' arenas, of which
    malloc_trim returned 4 (rss22's account; the top of a thread's arena is never
    trimmed). The daemon's threads mostly run holding the GIL, so they rarely contend for
    an arena anyway. Call before the threads start: arenas already made stay. True if set."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_ARENA_MAX, arenas))


@contextlib.contextmanager
def trimming_as_freed() -> Iterator[None]:
    """While inside: the trim threshold back at glibc's default, so that a burst of
    allocations made and freed on other threads (the NVMe recovery's) is handed back as
    it is freed. malloc_trim cannot do it afterwards: it does not shrink the top of a
    thread's arena, and with the 1 GiB threshold `raise_thresholds` sets those tops stay
    resident (~120 MiB after a 1 M-record segment recovery, measured). The raised
    threshold is restored on the way out. A no-op unless `raise_thresholds` ran."""
    if _set_trim_threshold_bytes is None:
        yield
        return
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        yield
        return
    mallopt(_M_TRIM_THRESHOLD, _LOW_TRIM_THRESHOLD_BYTES)
    try:
        yield
    finally:
        mallopt(_M_TRIM_THRESHOLD, _set_trim_threshold_bytes)


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
