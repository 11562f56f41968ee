"""Restart safety: SIGKILL, clean stops, and damaged record files on the NVMe tier."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess, block_bytes

NS = "llama3-8b/bf16-b16-tp1"
StartDaemon = Callable[..., DaemonProcess]


def record_files(nvme: Path) -> list[Path]:
    return sorted(nvme.glob("v1/*/*.kvr"))


def record_of(nvme: Path, key: bytes) -> Path:
    for path in record_files(nvme):
        if key in path.read_bytes()[:4096]:
            return path
    raise AssertionError(f"no record holds key {key!r}")


@pytest.mark.slow
def test_sigkill_during_puts_keeps_every_block_that_reached_nvme(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon(dram="32MiB", nvme="1GiB")
    acked: dict[bytes, int] = {}  # key -> seed
    sizes: dict[bytes, int] = {}
    stop = threading.Event()

    def writer(worker: int) -> None:
        rng = random.Random(worker)
        with daemon.client() as client:
            seq = 0
            while not stop.is_set():
                key = f"w{worker}-{seq}".encode()
                size = rng.randint(1 << 10, 4 << 20)
                seed = worker * 1_000_000 + seq
                try:
                    client.put(NS, key, block_bytes(seed, size))
                except Exception:
                    return  # the daemon died under us
                acked[key], sizes[key] = seed, size
                seq += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(sizes.values()) < 160 << 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    with daemon.client() as probe:
        keys = list(acked)
        on_nvme = {
            k for k, t in zip(keys, probe.lookup(NS, keys).tiers, strict=True) if t == "nvme"
        }
    assert len(on_nvme) > 20, "the test must have spilled blocks to NVMe before the kill"
    daemon.kill()  # SIGKILL while the writers are mid-put
    stop.set()
    for t in threads:
        t.join()

    daemon.start()
    with daemon.client() as client:
        served = 0
        for key, seed in list(acked.items()):
            got = client.get(NS, key)
            if key in on_nvme:
                assert got == block_bytes(seed, sizes[key]), f"{key!r} lost or damaged"
            if got is not None:
                assert got == block_bytes(seed, sizes[key]), f"{key!r} came back with wrong bytes"
                served += 1
        assert served >= len(on_nvme)
        # Puts that were in flight at the kill are misses or exact; never a partial record.
        for worker in range(3):
            seq = max(int(k.split(b"-")[1]) for k in acked if k.startswith(f"w{worker}-".encode()))
            for extra in range(seq + 1, seq + 3):
                key = f"w{worker}-{extra}".encode()
                assert client.get(NS, key) is None
        assert client.stats()["checksum_failures"] == 0
    assert not list((daemon.nvme_path / "tmp").iterdir()), "temporary files must be cleaned"


def test_clean_stop_flushes_dram_and_restart_serves_everything(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="32MiB", nvme="256MiB")
    blocks = {f"c{i}".encode(): block_bytes(i, 1_000_003 * (i % 5 + 1)) for i in range(20)}
    with daemon.client() as client:
        for key, data in blocks.items():
            client.put(NS, key, data)
        assert "dram" in client.lookup(NS, list(blocks)).tiers
    assert daemon.terminate() == 0
    assert "flushed" in daemon.log()
    daemon.start()
    with daemon.client() as client:
        result = client.lookup(NS, list(blocks))
        assert result.prefix_blocks == len(blocks)
        assert set(result.tiers) == {"nvme"}
        for key, data in blocks.items():
            assert client.get(NS, key) == data


def _flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("where", ["payload", "header", "padding", "truncate", "extend"])
def test_damaged_record_is_a_miss_after_restart(start_daemon: StartDaemon, where: str) -> None:
    daemon = start_daemon(dram="16MiB", nvme="256MiB")
    blocks = {f"d{i}".encode(): block_bytes(i, 3 * 4096 + 100 + i) for i in range(8)}
    with daemon.client() as client:
        for key, data in blocks.items():
            client.put(NS, key, data)
    assert daemon.terminate() == 0
    victim = record_of(daemon.nvme_path, b"d3")
    size = victim.stat().st_size
    if where == "payload":
        _flip_byte(victim, 4096 + 5000)
    elif where == "header":
        _flip_byte(victim, 20)
    elif where == "padding":
        _flip_byte(victim, size - 10)
    elif where == "truncate":
        os.truncate(victim, size - 4096)
    else:
        with victim.open("ab") as fh:
            fh.write(b"\0" * 4096)
    daemon.start()
    with daemon.client() as client:
        assert client.get(NS, b"d3") is None
        for key, data in blocks.items():
            if key != b"d3":
                assert client.get(NS, key) == data
        stats = client.stats()
        assert stats["checksum_failures"] >= 1
        # The daemon keeps serving, and the damaged block can be stored again.
        client.put(NS, b"d3", blocks[b"d3"])
        assert client.get(NS, b"d3") == blocks[b"d3"]
    assert not victim.exists(), "a damaged record must be removed"


def test_bit_flip_while_running_is_a_miss_and_the_daemon_keeps_serving(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon(dram="8MiB", nvme="256MiB")
    blocks = {f"r{i}".encode(): block_bytes(i, 1 << 20) for i in range(16)}
    with daemon.client() as client:
        for key, data in blocks.items():
            client.put(NS, key, data)
        assert client.lookup(NS, [b"r0"]).tiers == ["nvme"]
        _flip_byte(record_of(daemon.nvme_path, b"r0"), 4096 + 12345)
        assert client.get(NS, b"r0") is None
        assert client.get(NS, b"r0") is None  # dropped: stays a miss, no repeated disk read
        assert client.lookup(NS, [b"r0"]).tiers == [None]
        for key, data in blocks.items():
            if key != b"r0":
                assert client.get(NS, key) == data
        assert client.stats()["checksum_failures"] == 1


def test_stray_and_foreign_files_are_ignored(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="16MiB", nvme="64MiB")
    with daemon.client() as client:
        client.put(NS, b"keep", b"x" * 10_000)
    assert daemon.terminate() == 0
    nvme = daemon.nvme_path
    (nvme / "tmp" / "half-written.tmp").write_bytes(b"partial")
    (nvme / "v1" / "zz").mkdir()
    (nvme / "v1" / "zz" / "garbage.1.kvr").write_bytes(os.urandom(8192))
    original = record_of(nvme, b"keep")
    (original.parent / original.name.replace(".kvr", "9.kvr")).write_bytes(original.read_bytes())
    daemon.start()
    with daemon.client() as client:
        assert client.get(NS, b"keep") == b"x" * 10_000
        assert [s.key for s in client.list(NS)] == [b"keep"]
    assert not (nvme / "tmp" / "half-written.tmp").exists()
    assert not (nvme / "v1" / "zz" / "garbage.1.kvr").exists()
