"""A real daemon with nvme.encryption_key_file: blocks survive a restart, never in clear."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvtier.cli import main as cli_main
from tests.conftest import DaemonProcess, block_bytes

StartDaemon = Callable[..., DaemonProcess]
NS = "llama3-8b/bf16-b16"
MARKER = b"SECRET-PROMPT-AT-REST:"


def everything_under(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def test_blocks_come_back_from_encrypted_nvme_exactly_and_never_sit_there_in_clear(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    key_file = workdir / "kvtier.key"
    assert cli_main(["keygen", str(key_file)]) == 0
    env = {"KVTIER_NVME__ENCRYPTION_KEY_FILE": str(key_file)}
    daemon = start_daemon(dram="32MiB", nvme="256MiB", env=env)
    blocks = {f"s{i}".encode(): MARKER + block_bytes(i, 300_001 * (i % 4 + 1)) for i in range(12)}
    with daemon.client() as client:
        for key, data in blocks.items():
            client.put(NS, key, data)
    assert daemon.terminate() == 0  # flush_on_stop writes every block to NVMe
    on_disk = everything_under(daemon.nvme_path)
    assert len(list(daemon.nvme_path.glob("v1/*/*.kvr"))) == len(blocks)
    assert MARKER not in on_disk
    assert all(data[5000:5064] not in on_disk for data in blocks.values())

    daemon.start()
    with daemon.client() as client:
        result = client.lookup(NS, list(blocks))
        assert result.prefix_blocks == len(blocks) and set(result.tiers) == {"nvme"}
        keys = list(blocks)
        for key in keys[:6]:  # the gRPC get: a verified, decrypted read of the record
            assert client.get(NS, key) == blocks[key]
        for key in keys[6:]:  # zero-copy: promoted into the arena (read_into), then copied
            out = bytearray(len(blocks[key]))
            assert client.get_into(NS, key, out) == len(out) and bytes(out) == blocks[key]
        assert client.stats()["checksum_failures"] == 0
    assert daemon.terminate() == 0
    # Restarted without the key: the records cannot be read, so none is served.
    daemon.env = {}
    daemon.start()
    with daemon.client() as client:
        assert client.get(NS, keys[0]) is None
        assert client.stats()["checksum_failures"] == len(blocks)


def test_a_key_file_others_can_read_stops_the_daemon_at_start(workdir: Path) -> None:
    key_file = workdir / "kvtier.key"
    key_file.write_text(os.urandom(32).hex() + "\n")
    key_file.chmod(0o644)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "serve",
            "--listen",
            f"unix://{workdir / 'kvtier.sock'}",
            "--dram-capacity",
            "16MiB",
            "--nvme-path",
            str(workdir / "nvme"),
        ],
        env=dict(os.environ, KVTIER_NVME__ENCRYPTION_KEY_FILE=str(key_file)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert str(key_file) in proc.stderr and "chmod 600" in proc.stderr
