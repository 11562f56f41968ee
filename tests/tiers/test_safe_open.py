"""The NVMe tier against files planted in it, and its modes whatever the umask: links are
never followed, FIFOs never waited on, only regular files used (kvtier/tiers/safe_open.py);
what the tier creates has no group or other access."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.errors import ConfigError, CorruptRecord, NotRegularFile
from kvtier.tiers import nvme as nvme_module
from kvtier.tiers import safe_open
from kvtier.tiers.allocator import round_up
from kvtier.tiers.crypto import load_key_file
from kvtier.tiers.nvme import NvmeTier, RecoveryReport
from kvtier.tiers.record import RecordHeader, header_size_for
from kvtier.tiers.safe_open import RefusedFiles, open_regular, private_dir
from kvtier.tiers.wipe import wipe

NS = "default|m/l"
HANG_S = 10.0  # far beyond any open here; only a blocked one takes this long


@pytest.fixture
def umask() -> Iterator[Callable[[int], None]]:
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def open_tier(tiers: list[NvmeTier], root: Path, direct: bool = False) -> NvmeTier:
    while tiers:
        tiers.pop().close()
    tier = NvmeTier(root, 1 << 30, direct_io=direct, sync_writes=False)
    tiers.append(tier)
    tier.report = tier.open()  # type: ignore[attr-defined]
    return tier


def report(tier: NvmeTier) -> RecoveryReport:
    got: RecoveryReport = tier.report  # type: ignore[attr-defined]
    return got


def write(tier: NvmeTier, key: bytes, data: bytes, generation: int = 1) -> RecordHeader:
    header = RecordHeader(
        NS, key, generation, len(data), xxhash.xxh3_64_intdigest(data), header_size_for(NS, key)
    )
    buf = aligned_buffer(round_up(max(len(data), 1), 4096))
    buf[: len(data)] = data
    assert tier.write(header, [memoryview(buf)[: round_up(len(data), 4096)]]) > 0
    return header


def read(tier: NvmeTier, header: RecordHeader) -> bytes:
    buf, offset = tier.read(header)
    return bytes(buf[offset : offset + header.payload_bytes])


def loose(root: Path) -> list[str]:
    """Every file or directory under `root` (itself too) that group or others can touch."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if mode & 0o077:
            found.append(f"{path.relative_to(root)} {stat.filemode(mode)}")
    return found


def finishes(fn: Callable[[], object], fifos: list[Path]) -> bool:
    """Whether `fn` returns (or raises) within HANG_S. If it hangs on a FIFO, each is
    opened for reading and writing (never blocks) and closed, so the test run can go on."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except Exception:
            pass
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    if done.wait(HANG_S):
        return True
    for fifo in fifos:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
    done.wait(HANG_S)
    return False


def fill(tier: NvmeTier, count: int, size: int = 9000) -> list[RecordHeader]:
    return [write(tier, f"k{i}".encode(), bytes([i + 1]) * size) for i in range(count)]


# ---- modes --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mask", [0o000, 0o002, 0o007, 0o022, 0o027, 0o277], ids=lambda m: f"umask{m:04o}"
)
def test_everything_the_tier_makes_is_private_whatever_the_umask(
    tmp_path: Path, tiers: list[NvmeTier], umask: Callable[[int], None], mask: int
) -> None:
    umask(mask)
    root = tmp_path / "nvme"
    tier = open_tier(tiers, root)
    headers = fill(tier, 6)
    for header in headers[:3]:
        tier.tombstone(header.ns_id, header.key, header.generation)
        tier.remove(header)  # into free/
    assert list((root / "free").iterdir())
    write(tier, b"k0", b"\1" * 9000, generation=2)  # over a spare (mode kept)
    tier = open_tier(tiers, root)  # a restart: log compacted, lock file reopened
    tier.tombstone(NS, b"k1", 9)
    assert (root / "tombstones.log").stat().st_size > 0
    assert loose(root) == []
    for path in [root, *root.rglob("*")]:  # and usable: a narrow umask is widened back
        want = 0o700 if path.is_dir() else 0o600
        assert stat.S_IMODE(path.lstat().st_mode) == want, path


def test_a_tier_an_older_version_left_open_is_closed_up_at_start(
    tmp_path: Path, tiers: list[NvmeTier]
) -> None:
    root = tmp_path / "nvme"
    tier = open_tier(tiers, root)
    headers = fill(tier, 8)
    tier.remove(headers[0])
    tier.close()
    tiers.clear()
    for path in [root, *root.rglob("*")]:  # what umask 0022 made of it before
        path.chmod(0o755 if path.is_dir() else 0o644)
    tier = open_tier(tiers, root)
    assert loose(root) == []
    assert [read(tier, h) for h in headers[1:]] == [bytes([i + 2]) * 9000 for i in range(7)]


def test_private_dir_chmods_back_and_replaces_what_is_not_a_directory(tmp_path: Path) -> None:
    refused = RefusedFiles()
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    victim.chmod(0o755)
    link = tmp_path / "fan"
    link.symlink_to(victim)
    assert private_dir(link, refused, "v1/") is False  # a new directory, not the link's
    assert link.is_dir() and not link.is_symlink() and refused.count == 1
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755  # the target was not touched
    loose_dir = tmp_path / "loose"
    loose_dir.mkdir()
    loose_dir.chmod(0o775)
    assert private_dir(loose_dir, refused, "v1/") is True
    assert stat.S_IMODE(loose_dir.stat().st_mode) == 0o700


# ---- open_regular -------------------------------------------------------------------------
def test_open_regular_refuses_every_kind_of_special_file_without_blocking(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"x" * 4096)
    (tmp_path / "link").symlink_to(target)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    os.link(target, tmp_path / "hard")
    kinds = {
        "link": "symbolic link",
        "fifo": "FIFO",
        "dir": "directory",
    }
    for name, kind in kinds.items():
        for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):
            with pytest.raises(NotRegularFile) as caught:
                open_regular(tmp_path / name, flags)
            assert isinstance(caught.value, CorruptRecord)
            if flags == os.O_RDONLY or name != "fifo":  # no reader: ENXIO, "FIFO or socket"
                assert caught.value.kind == kind
    with pytest.raises(NotRegularFile, match="hard links"):
        open_regular(tmp_path / "hard", os.O_WRONLY, sole=True)
    opened = open_regular(tmp_path / "hard", os.O_RDONLY)  # reading one is fine
    os.close(opened.fd)
    assert target.read_bytes() == b"x" * 4096


def test_open_regular_refuses_a_fifo_under_o_direct(tmp_path: Path) -> None:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(NotRegularFile):
        open_regular(tmp_path / "fifo", os.O_RDONLY | os.O_DIRECT)


# ---- spares -------------------------------------------------------------------------------
def spare_of(tier: NvmeTier, size: int = 9000) -> Path:
    header = write(tier, b"old", b"o" * size)
    tier.remove(header)
    [spare] = list((tier.root / "free").iterdir())
    return spare


@pytest.mark.parametrize("direct", [False, True])
def test_a_symlink_planted_as_a_spare_is_never_written_through(
    tmp_path: Path, tiers: list[NvmeTier], direct: bool
) -> None:
    tier = open_tier(tiers, tmp_path / "nvme", direct)
    spare = spare_of(tier)
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * spare.stat().st_size)
    spare.unlink()
    spare.symlink_to(victim)  # the pool still lists the name
    header = write(tier, b"new", b"n" * 9000)
    assert victim.read_bytes() == b"v" * len(victim.read_bytes())
    record = tier.record_path(NS, b"new", 1)
    assert not record.is_symlink() and read(tier, header) == b"n" * 9000
    assert not spare.exists() and not spare.is_symlink()  # removed, the link only
    assert tier.refused.count == 1


def test_a_hard_linked_spare_is_never_written_over(tmp_path: Path, tiers: list[NvmeTier]) -> None:
    tier = open_tier(tiers, tmp_path / "nvme")
    spare = spare_of(tier)
    other = tmp_path / "other"
    os.link(spare, other)
    before = other.read_bytes()
    header = write(tier, b"new", b"n" * 9000)
    assert other.read_bytes() == before and read(tier, header) == b"n" * 9000
    assert tier.refused.count == 1


def test_a_fifo_as_a_spare_does_not_block_the_writer(tmp_path: Path, tiers: list[NvmeTier]) -> None:
    tier = open_tier(tiers, tmp_path / "nvme")
    spare = spare_of(tier)
    spare.unlink()
    os.mkfifo(spare)
    written: list[RecordHeader] = []
    assert finishes(lambda: written.append(write(tier, b"new", b"n" * 9000)), [spare])
    assert read(tier, written[0]) == b"n" * 9000 and tier.refused.count == 1


def test_a_spare_swapped_for_a_link_while_written_is_not_renamed_into_v1(
    tmp_path: Path, tiers: list[NvmeTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tiers, tmp_path / "nvme")
    spare = spare_of(tier)
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 8)
    real_pwrite = nvme_module.pwritev_all
    swapped: list[str] = []

    def pwrite_then_swap(fd: int, iov: list[memoryview], total: int, offset: int) -> None:
        real_pwrite(fd, iov, total, offset)
        if not swapped:  # after the open, before the rename: the name now is a link
            swapped.append(str(spare))
            spare.unlink()
            spare.symlink_to(victim)

    monkeypatch.setattr(nvme_module, "pwritev_all", pwrite_then_swap)
    header = write(tier, b"new", b"n" * 9000)
    record = tier.record_path(NS, b"new", 1)
    assert swapped and not record.is_symlink() and read(tier, header) == b"n" * 9000
    assert victim.read_bytes() == b"v" * 8 and not spare.is_symlink()
    assert tier.refused.count == 1


# ---- records, temporaries and the log at start --------------------------------------------
def test_a_fifo_in_place_of_a_record_does_not_hang_the_start(
    tmp_path: Path, tiers: list[NvmeTier]
) -> None:
    root = tmp_path / "nvme"
    tier = open_tier(tiers, root)
    headers = fill(tier, 4)
    tier.close()
    tiers.clear()
    record = tier.record_path(NS, b"k0", 1)
    record.unlink()
    os.mkfifo(record)
    spare_name = root / "free" / f"{headers[1].record_bytes}.{'f' * 32}"
    os.mkfifo(spare_name)
    os.mkfifo(root / "tmp" / "stray.tmp")
    (root / "tmp" / "link.tmp").symlink_to(tmp_path)
    (root / "v1" / record.parent.name / f"{'0' * 32}.1.kvr").mkdir()
    fifos = [record, spare_name, root / "tmp" / "stray.tmp"]
    assert finishes(lambda: open_tier(tiers, root), fifos), "open() blocked on a FIFO"
    tier = tiers[-1]
    got = report(tier)
    assert sorted(r.header.key for r in got.records) == [b"k1", b"k2", b"k3"]
    assert got.refused_files == 5 == tier.refused.count
    assert got.dropped_corrupt == 0
    assert not any(p.exists() or p.is_symlink() for p in fifos)
    assert list((root / "tmp").iterdir()) == []
    assert [read(tier, h) for h in headers[1:]] == [bytes([i + 2]) * 9000 for i in range(3)]


def test_a_record_turned_fifo_at_run_time_is_a_miss_and_not_recycled(
    tmp_path: Path, tiers: list[NvmeTier]
) -> None:
    tier = open_tier(tiers, tmp_path / "nvme", direct=True)
    header = fill(tier, 1)[0]
    record = tier.record_path(NS, b"k0", 1)
    record.unlink()
    os.mkfifo(record)
    caught: list[BaseException] = []

    def get() -> None:
        try:
            tier.read(header)
        except CorruptRecord as err:
            caught.append(err)

    assert finishes(get, [record])
    assert isinstance(caught[0], NotRegularFile) and tier.refused.count == 1
    tier.remove(header)  # the store drops it: removed, not made a spare
    assert not record.exists() and list((tier.root / "free").iterdir()) == []


def test_a_planted_tombstone_log_or_its_new_copy_is_neither_followed_nor_waited_on(
    tmp_path: Path, tiers: list[NvmeTier]
) -> None:
    root = tmp_path / "nvme"
    open_tier(tiers, root).close()
    tiers.clear()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (root / "tombstones.log").unlink()
    os.mkfifo(root / "tombstones.log")
    (root / "tombstones.log.new").symlink_to(victim)
    assert finishes(lambda: open_tier(tiers, root), [root / "tombstones.log"])
    tier = tiers[-1]
    assert victim.read_bytes() == b"keep me" and tier.refused.count == 1
    assert stat.S_ISREG((root / "tombstones.log").lstat().st_mode)
    tier.tombstone(NS, b"k", 1)  # the fresh log works


def test_a_lock_file_that_is_a_link_stops_the_start(tmp_path: Path, tiers: list[NvmeTier]) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"")
    (root / ".lock").symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        open_tier(tiers, root)


def test_a_fifo_as_the_key_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    key = tmp_path / "key"
    os.mkfifo(key, 0o600)
    caught: list[BaseException] = []

    def load() -> None:
        try:
            load_key_file(key)
        except ConfigError as err:
            caught.append(err)

    assert finishes(load, [key])
    assert "not a regular file" in str(caught[0])


def test_wipe_neither_waits_on_a_fifo_nor_follows_a_link(
    tmp_path: Path, tiers: list[NvmeTier]
) -> None:
    root = tmp_path / "nvme"
    tier = open_tier(tiers, root)
    fill(tier, 2)
    tier.close()
    tiers.clear()
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 4096)
    fan = tier.record_path(NS, b"k0", 1).parent
    os.mkfifo(fan / f"{'a' * 32}.1.kvr")
    (fan / f"{'b' * 32}.1.kvr").symlink_to(victim)
    os.mkfifo(root / "free" / "123.x")
    fifos = [fan / f"{'a' * 32}.1.kvr", root / "free" / "123.x"]
    done: list[object] = []
    assert finishes(lambda: done.append(wipe(root, None)), fifos)
    assert done and victim.read_bytes() == b"v" * 4096
    assert list(fan.iterdir()) == [] and list((root / "free").iterdir()) == []


def test_refusals_are_logged_once_per_kind_and_place(caplog: pytest.LogCaptureFixture) -> None:
    refused = RefusedFiles()
    with caplog.at_level("WARNING", logger=safe_open.__name__):
        for _ in range(50):
            refused.refuse("free/", "symbolic link")
        refused.refuse("free/", "FIFO")
    assert refused.count == 51
    assert len(caplog.records) == 2
