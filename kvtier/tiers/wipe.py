"""`kvtier wipe`: securely remove a tenant's records from a stopped daemon's NVMe tier."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError, CorruptRecord, NotRegularFile
from kvtier.keys import tenant_of
from kvtier.tiers.nvme import RECORD_SUFFIX, TOMBSTONE_LOG, lock_tier, tombstone_entries
from kvtier.tiers.record import parse_header, read_header_region
from kvtier.tiers.safe_open import open_regular, open_subdir, remove_entry
from kvtier.tiers.segment_wipe import SEGMENTS_DIR, wipe_segments
from kvtier.tiers.startup import is_tombstone_log


@dataclass(frozen=True, slots=True)
class WipeReport:
    """What `wipe` overwrote and removed."""

    root: Path
    tenant: str | None  # None: every tenant
    records: int  # the tenant's records
    record_bytes: int
    unreadable_records: int  # records whose header names no tenant: anyone's bytes
    recyclable_files: int  # free/: removed records of any tenant, kept for reuse
    temporary_files: int  # tmp/: records being written when a daemon stopped
    overwritten_bytes: int  # every byte overwritten, all of the above together
    tombstones_dropped: int  # the tenant's entries taken out of the tombstone log
    segments_rewritten: int = 0  # segments (nvme.layout "segments") left without its records


_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC  # the path given: a link is fine
_ZEROS_BYTES = 1 << 20


def wipe(root: Path, tenant: str | None) -> WipeReport:
    """Overwrite with zeros, fdatasync and remove every record of `tenant` (None: every
    tenant's) under `root`, and with them every unreadable record and every recyclable and
    temporary file (they may hold anyone's old bytes); drop the tenant's tombstones.

    Offline: the tier's lock is taken for the whole wipe, so this refuses (ConfigError)
    while a daemon runs on `root`, and no daemon can start on it until it is done. On a
    file system that writes in place (ext4, XFS) the zeros replace the blocks; what the
    SSD's flash translation layer keeps of them is out of reach (docs/security.md).
    """
    if not (root / "v1").is_dir() and not (root / SEGMENTS_DIR).is_dir():
        raise ConfigError(
            f"nvme.path: {root} holds no NVMe tier (no v1/ or {SEGMENTS_DIR}/ directory there)"
        )
    try:
        lock_fd = lock_tier(root)
    except BlockingIOError:
        raise ConfigError(
            f"nvme.path: {root} is in use by a running kvtier daemon; stop it first "
            "(systemctl stop kvtier), run kvtier wipe, then start it again"
        ) from None
    zeros = bytes(_ZEROS_BYTES)
    root_fd = os.open(root, _ROOT_FLAGS)
    try:
        records = record_bytes = unreadable = overwritten = 0
        for subdir in ("v1", SEGMENTS_DIR):
            path = root / subdir
            if path.is_symlink() or (path.exists() and not path.is_dir()):
                raise ConfigError(
                    f"nvme.path: {root}/{subdir} is not a directory (a link?): not wiped"
                )
        v1_fd = open_subdir(root_fd, "v1")
        if v1_fd is not None:
            try:
                for fan in sorted(os.listdir(v1_fd)):
                    fan_fd = open_subdir(v1_fd, fan)
                    if fan_fd is None:
                        continue
                    try:
                        for name in sorted(os.listdir(fan_fd)):
                            if not name.endswith(RECORD_SUFFIX):
                                continue
                            owner = _record_tenant(fan_fd, name)
                            if owner is not None and tenant is not None and owner != tenant:
                                continue
                            size = _shred(fan_fd, name, zeros)
                            overwritten += size
                            if owner is None:
                                unreadable += 1
                            else:
                                records += 1
                                record_bytes += size
                        os.fsync(fan_fd)
                    finally:
                        os.close(fan_fd)
            finally:
                os.close(v1_fd)
        segments = wipe_segments(root_fd, tenant, zeros, _shred)
        records += segments.records
        record_bytes += segments.record_bytes
        unreadable += segments.unreadable
        overwritten += segments.overwritten_bytes
        spare_counts = []
        for name in ("free", "tmp"):
            count = 0
            dir_fd = open_subdir(root_fd, name)
            if dir_fd is not None:
                try:
                    for entry in sorted(os.listdir(dir_fd)):
                        overwritten += _shred(dir_fd, entry, zeros)
                        count += 1
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            spare_counts.append(count)
        for name in os.listdir(root_fd):  # copies of the log a stopped compaction left
            if name.startswith("tombstones.") and not is_tombstone_log(name):
                overwritten += _shred(root_fd, name, zeros)
        # The live log and those a start set aside until its recovery completes.
        logs = sorted(name for name in os.listdir(root_fd) if is_tombstone_log(name))
        dropped = sum(_wipe_tombstones(root_fd, tenant, zeros, name) for name in logs)
        os.fsync(root_fd)
    finally:
        os.close(root_fd)
        os.close(lock_fd)
    return WipeReport(
        root,
        tenant,
        records,
        record_bytes,
        unreadable,
        spare_counts[0],
        spare_counts[1],
        overwritten,
        dropped,
        segments.rewritten,
    )


def _record_tenant(dir_fd: int, name: str) -> str | None:
    """The tenant a record file's header names; None if the header does not verify."""
    try:
        fd = open_regular(name, os.O_RDONLY, dir_fd=dir_fd).fd
    except (CorruptRecord, OSError):  # NotRegularFile: a link, a FIFO (never waited on)
        return None
    try:
        return tenant_of(parse_header(read_header_region(fd)).header.ns_id)
    except (CorruptRecord, OSError):
        return None
    finally:
        os.close(fd)


def _shred(dir_fd: int, name: str, zeros: bytes) -> int:
    """Overwrite a file with zeros, fdatasync it and unlink it; returns bytes overwritten.

    Only a regular file with one link is overwritten: a symbolic or hard link planted in
    the tier could otherwise aim the zeros at a file elsewhere (wipe may run as root).
    Anything else is just unlinked; a directory is left alone.
    """
    size = 0
    try:
        opened = open_regular(name, os.O_WRONLY, dir_fd=dir_fd, sole=True)
    except NotRegularFile as err:
        if err.kind == "directory":
            return 0
    except PermissionError:
        pass
    else:
        try:
            while size < opened.info.st_size:
                size += os.pwrite(opened.fd, zeros[: opened.info.st_size - size], size)
            os.fdatasync(opened.fd)
        finally:
            os.close(opened.fd)
    os.unlink(name, dir_fd=dir_fd)
    return size


def _wipe_tombstones(
    root_fd: int, tenant: str | None, zeros: bytes, log: str = TOMBSTONE_LOG
) -> int:
    """Rewrite the tombstone log `log` without `tenant`'s entries (its records are gone, so
    they guard nothing; they still name its keys), then overwrite the old log; returns how
    many entries were dropped."""
    try:
        fd = open_regular(log, os.O_RDWR, dir_fd=root_fd).fd
    except (FileNotFoundError, NotRegularFile):  # no log (the daemon refuses a non-file)
        return 0
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0)
        entries = list(tombstone_entries(data))
        kept = [raw for ns_id, _, _, raw in entries if tenant and tenant_of(ns_id) != tenant]
        if len(kept) == len(entries) and len(data) == sum(map(len, kept)):
            return 0
        fresh = f"{log}.wipe"
        remove_entry(fresh, dir_fd=root_fd)  # a leftover (or planted) one is never opened
        new_fd = open_regular(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=root_fd).fd
        try:
            payload = b"".join(kept)
            if os.write(new_fd, payload) != len(payload):
                raise OSError(errno.EIO, "short write to the tombstone log")
            os.fsync(new_fd)
        finally:
            os.close(new_fd)
        # Atomic: a crash before this leaves the old, complete log; after it, the new one.
        os.rename(fresh, log, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        done = 0  # the old log lives on through `fd` until it is closed: zero it first
        while done < size:
            done += os.pwrite(fd, zeros[: size - done], done)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return len(entries) - len(kept)
