"""Faults under the NVMe tier: a full disk, short writes, a file-size limit, I/O errors on
read and delete, a tier that fails until it is taken offline, damaged record files.

Each row: put blocks, make sure the ones that must survive are on NVMe (a clean restart
writes DRAM out), inject the fault, check every key against the shadow, then (where the
fault can be lifted) restart without it and check that nothing that should have survived
was lost.
"""

from __future__ import annotations

import functools
import random
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.keys import hash_token
from tests.conftest import DaemonProcess, block_bytes
from tests.faults import harness
from tests.faults.harness import Report, Shadow, check_all, fired, still_serves

StartDaemon = Callable[..., DaemonProcess]
NS = "faults/nvme"
put_blocks = functools.partial(harness.put_blocks, ns=NS)
MiB = 1 << 20


def without_faults(daemon: DaemonProcess) -> DaemonProcess:
    """Restart cleanly with no failpoints and no prefix (limits, namespaces)."""
    daemon.terminate()
    daemon.env = {}
    daemon.prefix = []
    return daemon.start()


def record_files(daemon: DaemonProcess) -> list[Path]:
    return sorted((daemon.nvme_path / "v1").glob("*/*.kvr"))


def can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


def test_enospc_mid_put(start_daemon: StartDaemon, workdir: Path, report: Report) -> None:
    shadow = Shadow()
    nvme_dir = workdir / "nvme"
    if can_unshare():
        how = "NVMe directory on a 6 MiB tmpfs (unshare -m), tier capacity 64 MiB"
        prefix = [
            "unshare",
            "-m",
            "sh",
            "-c",
            'mkdir -p "$0" && mount -t tmpfs -o size=6m tmpfs "$0" && exec "$@"',
            str(nvme_dir),
        ]
        env: dict[str, str] = {}
    else:  # no mount namespace here: the same errno from the write call instead
        how = "failpoint nvme.pwrite=enospc once the tier holds 4 MiB"
        prefix, env = [], {"KVTIER_FAILPOINTS": "nvme.pwrite=enospc@0.5"}
    row = report.row("ENOSPC mid-put", how)
    daemon = start_daemon(dram="4MiB", nvme="64MiB", env=env, prefix=prefix)
    with daemon.client() as c:
        base = put_blocks(c, shadow, "base", 4, 1 * MiB, seed=1)
        # Push the base blocks out of DRAM onto the (small) disk, then keep going past full.
        for round_ in range(3):
            put_blocks(c, shadow, f"fill{round_}-", 8, 1 * MiB, seed=10 + round_)
        on_nvme = {k for k in base if c.stat(NS, k) is not None}
        check_all(row, c, shadow, must_survive=on_nvme if prefix else set())
        row.serving = still_serves(c)
    log = daemon.log()
    row.injected = len(re.findall(r"No space left on device", log))
    row.notes.append(f"{len(on_nvme)} of {len(base)} base blocks were on NVMe before full")
    row.assert_ok()


def test_short_writes(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row("short writes", "failpoint nvme.pwrite=short@0.5 (an aligned part)")
    shadow = Shadow()
    daemon = start_daemon(dram="4MiB", nvme="256MiB")
    with daemon.client() as c:
        base = put_blocks(c, shadow, "b", 12, 1 * MiB, seed=2)
    daemon.env = {"KVTIER_FAILPOINTS": "nvme.pwrite=short@0.5", "KVTIER_FAILPOINTS_SEED": "2"}
    daemon.restart()  # flushes DRAM to NVMe on stop
    with daemon.client() as c:
        put_blocks(c, shadow, "w", 12, 1 * MiB + 4096, seed=3)  # demotions under the fault
        check_all(row, c, shadow, must_survive=set())
    row.injected = fired(daemon.log(), "nvme.pwrite")
    daemon.restart()  # its flush writes through the fault as well
    row.injected = fired(daemon.log(), "nvme.pwrite")
    without_faults(daemon)
    with daemon.client() as c:
        check_all(row, c, shadow, must_survive=set(base))
        row.serving = still_serves(c)
    row.assert_ok()


def test_efbig(start_daemon: StartDaemon, report: Report) -> None:
    # RLIMIT_FSIZE also bounds the memfd behind the DRAM arena, so the arena is as large
    # as the limit: a full-arena block's record (payload + a 4 KiB header) is over it.
    row = report.row("EFBIG (file-size limit)", "prlimit --fsize=1 MiB on the daemon")
    shadow = Shadow()
    limit = ["prlimit", f"--fsize={MiB}", "--"]
    daemon = start_daemon(dram="1MiB", nvme="256MiB", prefix=limit)
    with daemon.client() as c:
        small = put_blocks(c, shadow, "small", 6, 192 << 10, seed=4)
        put_blocks(c, shadow, "big", 3, 1 * MiB, seed=5)  # records over the limit
        put_blocks(c, shadow, "push", 8, 192 << 10, seed=6)
        check_all(row, c, shadow, must_survive=set())
        row.serving = still_serves(c)
    daemon.restart()
    row.injected = len(re.findall(r"File too large", daemon.log()))
    without_faults(daemon)
    with daemon.client() as c:
        check_all(row, c, shadow, must_survive=set(small))
        row.serving = row.serving and still_serves(c)
    row.assert_ok()


def test_eio_on_read(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row("EIO on read", "failpoint nvme.read=eio@0.4")
    shadow = Shadow()
    daemon = start_daemon(dram="4MiB", nvme="256MiB")
    with daemon.client() as c:
        base = put_blocks(c, shadow, "b", 16, 512 << 10, seed=7)
    daemon.env = {
        "KVTIER_FAILPOINTS": "nvme.read=eio@0.4",
        "KVTIER_FAILPOINTS_SEED": "7",
        "KVTIER_NVME__OFFLINE_AFTER_ERRORS": "1000",  # this row is about single records
    }
    daemon.restart()
    with daemon.client() as c:
        check_all(row, c, shadow, must_survive=set())  # misses allowed while reads fail
        row.serving = still_serves(c)
    row.injected = fired(daemon.log(), "nvme.read")
    without_faults(daemon)
    with daemon.client() as c:
        check_all(row, c, shadow, must_survive=set(base))  # a failed read kept the record
    row.assert_ok()


def test_eio_on_delete(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row("EIO on delete", "failpoint nvme.remove=eio (every removal)")
    shadow = Shadow()
    daemon = start_daemon(dram="4MiB", nvme="256MiB")
    with daemon.client() as c:
        keys = put_blocks(c, shadow, "b", 16, 512 << 10, seed=8)
    daemon.env = {
        "KVTIER_FAILPOINTS": "nvme.remove=eio",
        "KVTIER_NVME__OFFLINE_AFTER_ERRORS": "1000",
    }
    daemon.restart()
    deleted = keys[::2]
    with daemon.client() as c:
        for key in deleted:
            assert c.delete(NS, key) is True
            shadow.delete(NS, key, acknowledged=True)
        for key in keys[1::2]:  # overwrites remove the old record too
            data = block_bytes(9_000 + int(key[1:]), 256 << 10)
            c.put(NS, key, data, overwrite=True)
            shadow.put(NS, key, data, acknowledged=True)
        check_all(row, c, shadow, must_survive=set(keys[1::2]))
        row.serving = still_serves(c)
    daemon.terminate()
    row.injected = fired(daemon.log(), "nvme.remove")
    files_left = len(record_files(daemon))
    daemon.env = {}
    daemon.start()
    with daemon.client() as c:
        # Deleted stays deleted across the restart (the tombstones), the rest survives.
        for key in deleted:
            row.wrong_bytes += c.get(NS, key) is not None
        check_all(row, c, shadow, must_survive=set(keys[1::2]))
        nvme_blocks = c.stats()["tiers"]["nvme"]["blocks"]
    row.notes.append(f"{files_left} record files before the restart")
    assert len(record_files(daemon)) == nvme_blocks, "record files on disk leaked"
    row.assert_ok()


def test_tier_offline_after_repeated_errors(start_daemon: StartDaemon, report: Report) -> None:
    row = report.row(
        "NVMe failing: tier offline, then back",
        "failpoints nvme.read=eio*4, nvme.write=eio*2; offline after 3 errors",
    )
    shadow = Shadow()
    daemon = start_daemon(dram="4MiB", nvme="256MiB")
    with daemon.client() as c:
        base = put_blocks(c, shadow, "b", 12, 512 << 10, seed=11)
    daemon.env = {
        "KVTIER_FAILPOINTS": "nvme.read=eio*4,nvme.write=eio*2",
        "KVTIER_NVME__OFFLINE_AFTER_ERRORS": "3",
        "KVTIER_NVME__OFFLINE_RETRY_S": "0.3",
    }
    daemon.restart()
    with daemon.client() as c:
        for key in base[:4]:
            shadow.check(row, NS, key, c.get(NS, key))
        offline = not c.stats()["tiers"]["nvme"]["online"]
        # Offline: DRAM keeps serving, puts included; NVMe blocks are misses, not errors.
        serving_offline = still_serves(c)
        deadline = time.monotonic() + 20
        while not c.stats()["tiers"]["nvme"]["online"] and time.monotonic() < deadline:
            time.sleep(0.2)
        back = c.stats()["tiers"]["nvme"]["online"]
        check_all(row, c, shadow, must_survive=set(base))
        row.serving = serving_offline and still_serves(c)
    row.injected = fired(daemon.log())
    assert offline, "three consecutive errors did not take the tier offline"
    assert back, "the tier did not come back once its probe succeeded"
    row.assert_ok()


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x10]))


@pytest.fixture
def two_tenants(workdir: Path) -> tuple[Path, dict[str, str]]:
    tokens = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
    config = workdir / "tenants.toml"
    config.write_text(
        "[auth.tokens]\n"
        + "".join(f'"{hash_token(t)}" = "{n}"\n' for n, t in tokens.items())
        + '[tenants.alice]\ndram_capacity_bytes = "4MiB"\n'
        + '[tenants.bob]\ndram_capacity_bytes = "4MiB"\n'
    )
    return config, tokens


def test_damaged_record_files(
    start_daemon: StartDaemon, report: Report, two_tenants: tuple[Path, dict[str, str]]
) -> None:
    row = report.row(
        "bit flips, truncation, records copied onto another key's / tenant's path",
        "edits to record files, daemon stopped and running",
    )
    config, tokens = two_tenants
    shadows = {name: Shadow() for name in tokens}
    daemon = start_daemon(dram="8MiB", nvme="256MiB", extra=["--config", str(config)])
    keys: dict[str, list[str]] = {}
    for n, (name, token) in enumerate(tokens.items()):
        with daemon.client(token=token) as c:
            keys[name] = put_blocks(c, shadows[name], "k", 24, 256 << 10, seed=20 + n)
    daemon.terminate()
    files = record_files(daemon)
    rng = random.Random(12)
    damaged = rng.sample(files, 16)
    for path in damaged[:6]:  # a bit anywhere: header, payload, padding
        _flip(path, rng.randrange(path.stat().st_size))
    for path in damaged[6:10]:
        with path.open("r+b") as fh:
            fh.truncate(rng.randrange(path.stat().st_size))
    for src, dst in zip(damaged[10:13], damaged[13:16], strict=True):
        shutil.copyfile(src, dst)  # another key's record under this key's name
    row.injected = 13  # 6 flips, 4 truncations, 3 records copied over others
    daemon.start()
    for name, token in tokens.items():
        with daemon.client(token=token) as c:
            check_all(row, c, shadows[name], must_survive=set())
    # Untouched records must all be there: count hits against the number left intact.
    intact = len(files) - 13  # a copied record's source is intact
    hits = 0
    for name, token in tokens.items():
        with daemon.client(token=token) as c:
            hits += sum(c.get(NS, k) is not None for k in keys[name])
    row.must_survive += intact
    row.lost += max(0, intact - hits)
    # While running: flip a payload byte of a block that is on NVMe only.
    with daemon.client(token=tokens["bob"]) as c:
        put_blocks(c, shadows["bob"], "push", 20, 256 << 10, seed=40)  # bob's blocks -> NVMe
        victims = [p for p in record_files(daemon) if p not in files][:4]
        for path in victims:
            _flip(path, 8192 + 100)
        row.injected += len(victims)
        check_all(row, c, shadows["bob"], must_survive=set())
        row.serving = still_serves(c)
    row.assert_ok()


def test_a_dropped_record_does_not_come_back_over_a_newer_value(
    start_daemon: StartDaemon, report: Report
) -> None:
    """Found by the soak: a record dropped from the catalog (here: unreadable three times)
    whose file is not removed yet, a new value put under its key, SIGKILL — the restart
    must not serve the old record's (intact) bytes over the acknowledged new value."""
    row = report.row(
        "record dropped but still on disk, new value, SIGKILL",
        "failpoints nvme.read=eio (3 per key: the record is dropped) and nvme.remove=eio "
        "(its file stays)",
    )
    shadow = Shadow()
    daemon = start_daemon(dram="4MiB", nvme="256MiB")
    with daemon.client() as c:
        keys = put_blocks(c, shadow, "k", 4, 256 << 10, seed=31)
    daemon.env = {
        "KVTIER_FAILPOINTS": "nvme.read=eio*12,nvme.remove=eio",
        "KVTIER_NVME__OFFLINE_AFTER_ERRORS": "1000",
        "KVTIER_PLANNER__CALIBRATION_S": "0",
    }
    daemon.restart()  # every block on NVMe only
    with daemon.client() as c:
        for key in keys:
            for _ in range(3):  # the third I/O error drops the record from the catalog
                shadow.check(row, NS, key, c.get(NS, key))
            data = block_bytes(9_100 + int(key[1:]), 128 << 10)
            c.put(NS, key, data, overwrite=True)  # in DRAM only: lost at the kill
            shadow.put(NS, key, data, acknowledged=True)
    row.injected = fired(daemon.log())
    assert daemon.proc is not None
    daemon.proc.kill()
    daemon.kill()
    daemon.env = {}
    daemon.start()
    with daemon.client() as c:
        check_all(row, c, shadow, must_survive=set())
        row.serving = still_serves(c)
    row.assert_ok()
