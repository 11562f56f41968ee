"""The NVMe tier's start-up (kvtier/tiers/nvme.py): what recovery reports, and what the tier
keeps beside its records — the generation epoch and the tombstone logs. Blocking calls, on
the tier's own files, opened as safe_open.py opens everything in the tier.

* `epoch`: the last epoch a start claimed (8 bytes and their xxh3). Each start claims the
  next one, durably, before it hands out a generation, and numbers its generations from
  epoch << EPOCH_BITS: above every generation an earlier run can have written, known
  without reading a record. 2**40 generations a run, 2**24 runs.
* `tombstones.log`: this run's tombstones, appended. At start the last runs' log is set
  aside as `tombstones.<n>.log`, read by recovery and removed once a recovery is complete,
  so this run's entries never follow a torn entry of an earlier run (the parser stops at
  the first one) and no entry is lost while deletes go on during recovery.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvtier.errors import ConfigError, NotRegularFile
from kvtier.tiers.record import RecordHeader
from kvtier.tiers.safe_open import RefusedFiles, open_regular, remove_entry

logger = logging.getLogger(__name__)

__all__ = [
    "EPOCH_BITS",
    "EPOCH_FILE",
    "LAYOUT_DIRS",
    "TOMBSTONE_LOG",
    "FanScan",
    "GenerationEpoch",
    "RecoveredRecord",
    "RecoveryReport",
    "fsync_dir",
    "is_tombstone_log",
    "read_epoch",
    "read_tombstone_logs",
    "refuse_other_layout",
    "set_aside_tombstone_logs",
    "tombstone_entries",
    "tombstone_entry",
    "write_epoch",
]

EPOCH_FILE = "epoch"
# Where each `nvme.layout` keeps its records: a tier holding the other one is refused.
LAYOUT_DIRS = {"files": "v1", "segments": "segments"}
EPOCH_BITS = 40
_EPOCH = struct.Struct("<QQ")  # epoch, xxh3 of its 8 bytes
TOMBSTONE_LOG = "tombstones.log"
_TOMBSTONE = struct.Struct("<QHH")  # generation, namespace length, key length; then both, xxh3
_TOMBSTONE_XXH3 = struct.Struct("<Q")


# ---- what recovery finds ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RecoveredRecord:
    header: RecordHeader
    file: str  # the record file's path (a Path per record cost ~10 µs at start)
    location: int = 0  # where it lies in the segment layout (segment_file.pack_location)

    @property
    def path(self) -> Path:
        return Path(self.file)


@dataclass(slots=True)
class FanScan:
    """What recovery found in one fan directory (merged by `NvmeTier._recover`, or handed
    to its `on_fan` as soon as the fan is done)."""

    fan: str = ""
    records: list[RecoveredRecord] = field(default_factory=list)
    files: int = 0  # record files looked at
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (file name, why)
    stale: int = 0
    deleted: int = 0


@dataclass(slots=True)
class RecoveryReport:
    records: list[RecoveredRecord]
    dropped_corrupt: int
    dropped_stale: int
    removed_temporary: int
    dropped_deleted: int = 0
    max_tombstone_generation: int = 0
    refused_files: int = 0  # not regular files (links, FIFOs, ...): removed, not records
    complete: bool = True  # False: `stop_recovery()` ended it before every fan was scanned
    max_generation: int = 0  # of the records kept


# ---- the epoch ----------------------------------------------------------------------------
class GenerationEpoch:
    """This run's claimed epoch: `claim_next` at start (False if the last one is unknown:
    a tier an older kvtier wrote, or a damaged file), then `claim_above` the highest
    generation a full recovery found; `claim_above(0)` once 2**40 generations are used."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self.epoch = 0  # 0: none claimed yet
        self.first_generation: int | None = None

    @property
    def ceiling(self) -> int:
        """The first generation this run's epoch does not cover."""
        return (self.epoch + 1) << EPOCH_BITS

    def claim_next(self, refused: RefusedFiles) -> bool:
        last = read_epoch(self._root, refused)
        if last is None:
            return False
        self.claim(last + 1)
        return True

    def claim_above(self, generation: int) -> int:
        self.claim(max(self.epoch + 1, (generation >> EPOCH_BITS) + 1))
        assert self.first_generation is not None
        return self.first_generation

    def claim(self, epoch: int) -> None:
        write_epoch(self._root, epoch)  # durable before any of its generations is used
        self.epoch = epoch
        self.first_generation = epoch << EPOCH_BITS


# ---- the epoch file ----------------------------------------------------------------------------
def read_epoch(root: Path, refused: RefusedFiles) -> int | None:
    """The last epoch a start claimed; None when there is no epoch file (or it is damaged:
    then the highest generation is only known after a full recovery)."""
    try:
        opened = open_regular(root / EPOCH_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except NotRegularFile as err:
        refused.refuse("epoch file", err.kind)
        remove_entry(root / EPOCH_FILE)
        data = b""
    else:
        with os.fdopen(opened.fd, "rb") as fh:
            data = fh.read(_EPOCH.size + 1)
    if len(data) == _EPOCH.size:
        epoch, digest = _EPOCH.unpack(data)
        if digest == xxhash.xxh3_64_intdigest(data[:8]):
            return int(epoch)
    logger.warning("%s is damaged: recovering the whole index before serving", EPOCH_FILE)
    return None


def write_epoch(root: Path, epoch: int) -> None:
    """Durably record `epoch` as claimed (written aside, synced, renamed, directory synced),
    before any generation of it is handed out: after a crash, even a power loss, the next
    start claims a later one."""
    if epoch >= 1 << (64 - EPOCH_BITS):
        raise ConfigError(
            f"nvme.path: {root} has used up its generation numbers; empty it (kvtier wipe) "
            "to start afresh"
        )
    head = struct.pack("<Q", epoch)
    data = _EPOCH.pack(epoch, xxhash.xxh3_64_intdigest(head))
    fresh = root / f"{EPOCH_FILE}.new"
    remove_entry(fresh)  # a leftover (or planted) one is never opened
    fd = open_regular(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL).fd
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, "short write to the epoch file")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(fresh, root / EPOCH_FILE)
    fsync_dir(root)


# ---- the layout ------------------------------------------------------------------------
def refuse_other_layout(root: Path, layout: str) -> None:
    """A ConfigError if `root` holds records in another `nvme.layout` than `layout`: never
    served as this one, never overwritten (there is no migration yet)."""
    for other, name in LAYOUT_DIRS.items():
        if other == layout or not _holds_files(root / name):
            continue
        raise ConfigError(
            f"nvme.path: {root} holds records in the {other!r} layout but nvme.layout is "
            f"{layout!r}; set nvme.layout = {other!r} to serve them, or empty the directory "
            "to start afresh (its blocks are lost)"
        )


def _holds_files(directory: Path) -> bool:
    """Whether `directory` (or a directory in it) holds anything but empty directories."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return False
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False) or _holds_files(Path(entry.path)):
            return True
    return False


# ---- the tombstone logs ---------------------------------------------------------------------
def is_tombstone_log(name: str) -> bool:
    """Whether a file in the tier's root is a tombstone log: the live one, or one a start
    set aside (`tombstones.<n>.log`) until a recovery completes."""
    if name == TOMBSTONE_LOG:
        return True
    stem, dot, number = name.removesuffix(".log").partition(".")
    return name.endswith(".log") and stem == "tombstones" and bool(dot) and number.isdigit()


def set_aside_tombstone_logs(root: Path, refused: RefusedFiles) -> tuple[list[str], int]:
    """Move the live log aside as tombstones.<n>.log (unless it is empty) and create a fresh
    one; returns the names of every log set aside (this start's and any an incomplete
    recovery left) and the fresh log's fd, open for appends."""
    live = root / TOMBSTONE_LOG
    names = [name for name in os.listdir(root) if is_tombstone_log(name)]
    numbers = [int(name.split(".")[1]) for name in names if name != TOMBSTONE_LOG]
    if TOMBSTONE_LOG in names:
        try:
            opened = open_regular(live, os.O_RDONLY)
            os.close(opened.fd)
            keep = opened.info.st_size > 0
        except NotRegularFile as err:
            refused.refuse("tombstone log", err.kind)
            keep = False
        if keep:
            aside = f"tombstones.{max(numbers, default=0) + 1}.log"
            os.rename(live, root / aside)
            names.append(aside)
        else:
            remove_entry(live)
    fd = open_regular(live, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL).fd
    fsync_dir(root)
    return sorted(name for name in names if name != TOMBSTONE_LOG), fd


def read_tombstone_logs(
    root: Path, names: list[str], refused: RefusedFiles
) -> dict[tuple[str, bytes], int]:
    """(namespace, key) -> newest deleted generation over the logs `names`; a torn last
    entry of a log is ignored, a log that is not a regular file refused and removed."""
    out: dict[tuple[str, bytes], int] = {}
    for name in names:
        try:
            opened = open_regular(root / name, os.O_RDONLY)
        except FileNotFoundError:
            continue
        except NotRegularFile as err:
            refused.refuse("tombstone log", err.kind)
            remove_entry(root / name)
            continue
        with os.fdopen(opened.fd, "rb") as log:
            data = log.read()
        for ns_id, key, generation, _ in tombstone_entries(data):
            out[ns_id, key] = max(out.get((ns_id, key), 0), generation)
    return out


def tombstone_entry(ns_id: str, key: bytes, generation: int) -> bytes:
    ns = ns_id.encode()
    entry = _TOMBSTONE.pack(generation, len(ns), len(key)) + ns + key
    return entry + _TOMBSTONE_XXH3.pack(xxhash.xxh3_64_intdigest(entry))


def tombstone_entries(data: bytes) -> Iterator[tuple[str, bytes, int, bytes]]:
    """(namespace id, key, generation, the entry's bytes) of each intact entry, in order,
    up to the first torn or damaged one."""
    pos = 0
    while pos + _TOMBSTONE.size <= len(data):
        generation, ns_len, key_len = _TOMBSTONE.unpack_from(data, pos)
        end = pos + _TOMBSTONE.size + ns_len + key_len
        if end + _TOMBSTONE_XXH3.size > len(data):
            return
        (digest,) = _TOMBSTONE_XXH3.unpack_from(data, end)
        if digest != xxhash.xxh3_64_intdigest(data[pos:end]):
            logger.warning("tombstone log damaged at byte %d; the rest is ignored", pos)
            return
        body = pos + _TOMBSTONE.size
        ns_id = data[body : body + ns_len].decode()
        yield ns_id, data[body + ns_len : end], generation, data[pos : end + _TOMBSTONE_XXH3.size]
        pos = end + _TOMBSTONE_XXH3.size


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
