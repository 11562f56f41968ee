"""POSIX helpers both NVMe layouts share (record files, kvtier/tiers/nvme.py; segments,
kvtier/tiers/segments.py): the tier's lock file, the O_DIRECT probe, syncfs, preallocation
and positioned writes that continue after a partial transfer. Blocking calls on
descriptors and directories the tier owns; no tier state.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import mmap
import os
import uuid
from pathlib import Path

from kvtier import failpoints
from kvtier.buffers import aligned_buffer
from kvtier.errors import ConfigError, NotRegularFile
from kvtier.tiers.record import ALIGN_BYTES
from kvtier.tiers.safe_open import open_regular

__all__ = [
    "advance",
    "lock_tier",
    "preallocate",
    "pwrite_exact",
    "pwritev_all",
    "supports_o_direct",
    "sync_filesystem",
]


def lock_tier(root: Path) -> int:
    """flock `<root>/.lock` for this process (BlockingIOError: someone holds it)."""
    try:
        opened = open_regular(root / ".lock", os.O_RDWR | os.O_CREAT)
    except NotRegularFile as err:
        raise ConfigError(
            f"nvme.path: {root}/.lock is a {err.kind}, not the tier's lock file; remove it"
        ) from None
    fd = opened.fd  # 0600 now, if an older version made it 0640 (O_CREAT: see open_regular)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    return fd


def sync_filesystem(root: Path) -> None:
    """syncfs(2) on the file system `root` is on (only that one), or sync(2) where libc
    has no syncfs."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        syncfs = getattr(_libc(), "syncfs", None)
        if syncfs is None or syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def supports_o_direct(directory: Path) -> bool:
    """Whether files in `directory` accept an aligned O_DIRECT write (probed, then removed)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / f".kvtier-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [aligned_buffer(ALIGN_BYTES)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def preallocate(fd: int, size_bytes: int) -> None:
    """Reserve the file's blocks now (ENOSPC here, not mid-record); where the file
    system cannot, a sparse file of that size."""
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size_bytes)


def pwrite_exact(fd: int, buf: mmap.mmap, offset: int) -> None:
    """Write all of `buf` at `offset`, continuing after short writes."""
    view = memoryview(buf)
    done = 0
    while done < len(view):
        written = os.pwritev(fd, [view[done:]], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += written


def pwritev_all(fd: int, iov: list[memoryview | mmap.mmap], total: int, offset: int) -> None:
    """Write `iov` (`total` bytes) at `offset`, continuing after short writes (still
    aligned under O_DIRECT, or the kernel refuses and this raises). The nvme.pwrite
    failpoint acts one out: an aligned part transferred, as a kernel may."""
    done = 0
    # Views of the buffers only once a write came up short: a demotion batch writes
    # hundreds of them at once, and this runs on an I/O thread whose Python a record
    # costs the stream wall time (the GIL).
    views: list[memoryview] | None = None
    while done < total:
        if failpoints.ACTIVE and failpoints.fire("nvme.pwrite") == "short":
            views = views or [memoryview(b) for b in iov]
            part = max(ALIGN_BYTES, (len(views[0]) // 2) & ~(ALIGN_BYTES - 1))
            written = os.pwritev(fd, [views[0][:part]], offset + done)
        else:
            written = os.pwritev(fd, iov if views is None else views, offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        done += written
        if done < total:
            views = views or [memoryview(b) for b in iov]
            advance(views, written)


def advance(iov: list[memoryview], done_bytes: int) -> None:
    """Drop the first `done_bytes` of an iovec list in place (after a partial transfer)."""
    while iov and done_bytes >= len(iov[0]):
        done_bytes -= len(iov[0])
        iov.pop(0)
    if done_bytes:
        iov[0] = iov[0][done_bytes:]
