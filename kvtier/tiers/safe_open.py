"""Opening the NVMe tier's files and directories so that a file planted in the tier can
neither redirect nor hang the daemon, and keeping what the tier creates private.

Every open adds O_NOFOLLOW (a symbolic link is refused, never followed: else a link
planted as a spare has the daemon overwrite its target), O_NONBLOCK (a FIFO opens at once
instead of waiting for a peer; open(2): the flag has no effect on regular files, so it is
never cleared) and O_NOCTTY, then judges the file it opened with fstat, never the name:
anything but a regular file raises `NotRegularFile` (a `CorruptRecord`: a record that is
one is a miss). Callers count it in `RefusedFiles` and remove the name (unlinking a link
or a FIFO touches neither its target nor its peers).

Modes: directories 0700, files 0600, whatever the umask. A umask only clears bits, so
nothing created this way is ever more open; what it leaves narrower (a umask of 0277) is
chmodded back, directories always, files when fstat shows it. `tighten` closes up what an
older version left group- or world-accessible, on a file already open.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import NotRegularFile

logger = logging.getLogger(__name__)

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "OpenedFile",
    "RefusedFiles",
    "file_kind",
    "is_loose",
    "open_regular",
    "open_subdir",
    "private_dir",
    "remove_entry",
    "same_file",
    "tighten",
]

DIR_MODE = 0o700
FILE_MODE = 0o600
_GROUP_OTHER = 0o077
_SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# What open(2) answers for a name that is not a regular file, under _SAFE_FLAGS.
_REFUSED_ERRNOS = {
    errno.ELOOP: "symbolic link",
    errno.ENXIO: "FIFO or socket",  # a FIFO opened to write with no reader, or a socket
    errno.EISDIR: "directory",
}
_KINDS = (
    (stat.S_ISLNK, "symbolic link"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISDIR, "directory"),
)


@dataclass(frozen=True, slots=True)
class OpenedFile:
    """A regular file open as `fd` (the caller closes it) and what fstat said of it."""

    fd: int
    info: os.stat_result


def file_kind(mode: int) -> str:
    """What a stat mode says a file is, in words ("regular file" if nothing else)."""
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "regular file"


def is_loose(mode: int) -> bool:
    """Whether group or others have any access at all."""
    return bool(mode & _GROUP_OTHER)


def open_regular(
    path: str | Path,
    flags: int,
    *,
    dir_fd: int | None = None,
    mode: int = FILE_MODE,
    sole: bool = False,
    own: bool = False,
) -> OpenedFile:
    """Open `path` (relative to `dir_fd` if given) with `flags`, never through a symbolic
    link and never blocking on a FIFO; NotRegularFile (fd closed) if it is not a regular
    file, with `sole` also if it has other hard links (a file about to be overwritten: a
    hard link planted in the tier would aim the bytes at another file), with `own` if it
    belongs to another user (the daemon made every file it writes over). Other OSErrors
    (ENOENT, EACCES, ...) propagate."""
    try:
        fd = os.open(path, flags | _SAFE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as err:
        kind = _REFUSED_ERRNOS.get(err.errno or 0)
        if kind is None and err.errno == errno.EINVAL:  # O_DIRECT on a FIFO or a device
            kind = _kind_unless_regular(path, dir_fd)
        if kind is None:
            raise
        raise _refused(kind) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refused(file_kind(info.st_mode))
        if sole and info.st_nlink != 1:
            raise _refused("file with other hard links")
        if own and info.st_uid != os.geteuid():
            raise _refused("file of another user")
        if flags & os.O_CREAT and stat.S_IMODE(info.st_mode) != mode:
            # A umask such as 0277 leaves a new file 0400: one the daemon could not write
            # over again (and an existing one may be an older version's 0640). Only then a
            # syscall more: fstat is done anyway. Not ours to chmod: left as it is.
            with contextlib.suppress(PermissionError):
                os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return OpenedFile(fd, info)


def _kind_unless_regular(path: str | Path, dir_fd: int | None) -> str | None:
    try:
        mode = os.lstat(path, dir_fd=dir_fd).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else file_kind(mode)


def _refused(kind: str) -> NotRegularFile:
    return NotRegularFile(f"refused a {kind} where a regular file of the tier belongs", kind)


def tighten(fd: int, info: os.stat_result, mode: int = FILE_MODE) -> None:
    """fchmod the open file `fd` to `mode` if group or others have access (a tier written
    by an older version); a file the daemon may not chmod (not its own) is left as it is."""
    if is_loose(info.st_mode):
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, mode)


def same_file(fd: int, info: os.stat_result, path: str) -> bool:
    """Whether the name `path` is still the regular file open as `fd` (stat `info`), so a
    rename of the name moves that file and not something swapped in since it was opened."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(now.st_mode) and now.st_ino == info.st_ino and now.st_dev == info.st_dev


def open_subdir(dir_fd: int, name: str) -> int | None:
    """A directory in the directory `dir_fd`, never through a symbolic link (one planted
    in the tier could point a walk at files elsewhere); None if it is not a directory."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise


def private_dir(
    path: str | Path, refused: RefusedFiles, place: str, *, follow: bool = False
) -> bool:
    """Make `path` a directory of mode 0700, creating it; returns whether it existed with
    group or other access (files in it may be open too: an older version's tier).
    Whatever is there that is not a directory (a planted link, a FIFO, a file) is refused,
    removed and replaced; a link is never followed, except with `follow` (the tier's root:
    the configured path, which may be a link the operator made). A directory the daemon
    may not chmod (not its own) is left as it is, with a warning."""
    flags = _DIR_FLAGS & ~os.O_NOFOLLOW if follow else _DIR_FLAGS
    for _ in range(3):  # a name that keeps changing under us is an error, not a loop
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, DIR_MODE)
        try:
            fd = os.open(path, flags)
        except OSError as err:
            if err.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            with contextlib.suppress(FileNotFoundError):
                refused.refuse(place, file_kind(os.lstat(path).st_mode))
            remove_entry(path)
            continue
        try:
            info = os.fstat(fd)
            if stat.S_IMODE(info.st_mode) != DIR_MODE:
                try:
                    os.fchmod(fd, DIR_MODE)
                except PermissionError:
                    logger.warning(
                        "cannot make %s private (mode %04o, owner uid %d, not this user): "
                        "chown it to the service user or chmod 700 it",
                        path,
                        stat.S_IMODE(info.st_mode),
                        info.st_uid,
                    )
        finally:
            os.close(fd)
        return is_loose(info.st_mode)
    raise OSError(errno.ELOOP, f"{path} keeps being replaced; cannot make it a directory")


def remove_entry(path: str | Path, dir_fd: int | None = None) -> None:
    """Remove a name, whatever it is: a link, FIFO or file is unlinked (never what it
    points at); a directory is removed with all it holds, links inside it not followed."""
    try:
        os.unlink(path, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        if dir_fd is not None:
            shutil.rmtree(path, ignore_errors=True, dir_fd=dir_fd)
        else:
            shutil.rmtree(path, ignore_errors=True)


class RefusedFiles:
    """How many files the tier refused because they were not regular (links, FIFOs,
    sockets, devices: planted, or left by something else) and removed. Thread-safe: I/O
    threads and recovery's threads count here. The first of each kind in each place is
    logged at WARNING; the rest only counted (kvtier_nvme_refused_files_total), so files
    planted by the thousand cannot flood the log."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._logged: set[tuple[str, str]] = set()

    @property
    def count(self) -> int:
        return self._count

    def refuse(self, place: str, kind: str) -> None:
        with self._lock:
            self._count += 1
            first = (place, kind) not in self._logged
            self._logged.add((place, kind))
        if first:
            logger.warning(
                "refused a %s in the NVMe tier's %s (not a regular file: never opened "
                "blocking, never written through) and removed it; further ones are only "
                "counted in kvtier_nvme_refused_files_total",
                kind,
                place,
            )
