"""`kvtier wipe` against a real daemon's tier: refused while it runs; after it, one tenant
is gone from disk and from the restarted daemon, the other is served byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import kvtier
from kvtier.keys import hash_token
from tests.conftest import DaemonProcess, block_bytes

StartDaemon = Callable[..., DaemonProcess]
NS = "llama3-8b/bf16-b16"
TOKENS = {"alice": "token-of-alice", "bob": "token-of-bob"}


def kvtier_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")},
    )


def everything_under(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def blocks_of(tenant: str) -> dict[bytes, bytes]:
    marker = f"<prompt of {tenant}>".encode()
    seed = sorted(TOKENS).index(tenant) * 100
    return {f"{tenant}-{i}".encode(): marker + block_bytes(seed + i, 200_000 + i) for i in range(8)}


def test_wipe_removes_one_tenant_and_a_restart_serves_only_the_other(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    config = workdir / "kvtier.toml"
    config.write_text(
        "[auth.tokens]\n"
        + "".join(f'"{hash_token(tok)}" = "{tenant}"\n' for tenant, tok in TOKENS.items())
        + '[tenants.alice]\ndram_capacity_bytes = "16MiB"\n'
        + '[tenants.bob]\ndram_capacity_bytes = "16MiB"\n'
    )
    daemon = start_daemon(dram="16MiB", nvme="256MiB", extra=["--config", str(config)])
    data = {tenant: blocks_of(tenant) for tenant in TOKENS}
    for tenant, token in TOKENS.items():
        with kvtier.Client(daemon.target, token=token) as client:
            for key, value in data[tenant].items():
                client.put(NS, key, value)

    refused = kvtier_cli("wipe", "--tenant", "alice", "--nvme-path", str(daemon.nvme_path))
    assert refused.returncode == 2
    assert "in use by a running kvtier daemon; stop it first" in refused.stderr

    assert daemon.terminate() == 0  # flushes both tenants' blocks to NVMe
    on_disk = everything_under(daemon.nvme_path)
    assert b"<prompt of alice>" in on_disk and b"<prompt of bob>" in on_disk
    done = kvtier_cli("wipe", "--tenant", "alice", "--nvme-path", str(daemon.nvme_path), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["tenant"] == "alice" and report["records"] == len(data["alice"])
    assert report["record_bytes"] >= sum(map(len, data["alice"].values()))
    on_disk = everything_under(daemon.nvme_path)
    assert b"<prompt of alice>" not in on_disk and b"alice|" not in on_disk
    assert on_disk.count(b"<prompt of bob>") == len(data["bob"])

    daemon.start()
    with kvtier.Client(daemon.target, token=TOKENS["alice"]) as alice:
        assert alice.lookup(NS, list(data["alice"])).prefix_blocks == 0
        assert all(alice.get(NS, key) is None for key in data["alice"])
    with kvtier.Client(daemon.target, token=TOKENS["bob"]) as bob:
        assert set(bob.lookup(NS, list(data["bob"])).tiers) == {"nvme"}
        for key, value in data["bob"].items():
            assert bob.get(NS, key) == value
        assert bob.stats()["checksum_failures"] == 0
