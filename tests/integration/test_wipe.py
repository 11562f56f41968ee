"""`kvtier wipe` against a real daemon's tier: refused while it runs; after it, one tenant
is gone from disk and from the restarted daemon, the other is served byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import kvtier
from kvtier.keys import hash_token
from kvtier.tiers.nvme import RECORD_SUFFIX
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


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_wipe_removes_one_tenant_and_a_restart_serves_only_the_other(
    start_daemon: StartDaemon, workdir: Path, layout: str
) -> None:
    config = workdir / "kvtier.toml"
    config.write_text(
        "[auth.tokens]\n"
        + "".join(f'"{hash_token(tok)}" = "{tenant}"\n' for tenant, tok in TOKENS.items())
        + '[tenants.alice]\ndram_capacity_bytes = "16MiB"\n'
        + '[tenants.bob]\ndram_capacity_bytes = "16MiB"\n'
    )
    # In the segment layout both tenants' records share a segment: the wipe must rewrite
    # it, not remove it.
    layout_env = {"KVTIER_NVME__LAYOUT": layout}
    daemon = start_daemon(
        dram="16MiB", nvme="256MiB", extra=["--config", str(config)], env=layout_env
    )
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
    if layout == "segments":
        assert report["segments_rewritten"] >= 1

    daemon.start()
    with kvtier.Client(daemon.target, token=TOKENS["alice"]) as alice:
        assert alice.lookup(NS, list(data["alice"])).prefix_blocks == 0
        assert all(alice.get(NS, key) is None for key in data["alice"])
    with kvtier.Client(daemon.target, token=TOKENS["bob"]) as bob:
        assert set(bob.lookup(NS, list(data["bob"])).tiers) == {"nvme"}
        for key, value in data["bob"].items():
            assert bob.get(NS, key) == value
        assert bob.stats()["checksum_failures"] == 0


def _recipe(operations_md: str) -> str:
    """The shell block of docs/operations.md that runs `kvtier wipe`, as written."""
    blocks = operations_md.split("```sh\n")[1:]
    return next(b.split("```")[0] for b in blocks if "kvtier wipe --tenant" in b)


@pytest.mark.parametrize("drop_in", [False, True], ids=["cache-directory", "nvme-drop-in"])
def test_the_documented_wipe_recipe_finds_the_units_tier(workdir: Path, drop_in: bool) -> None:
    # The unit's view: systemd's directories, the config found through
    # CONFIGURATION_DIRECTORY, and (with kvtier-nvme.conf) an Environment= line.
    cache, etc, bin_dir = workdir / "cache", workdir / "etc", workdir / "bin"
    for d in (cache, etc, bin_dir):
        d.mkdir()
    (etc / "kvtier.toml").write_text('[nvme]\ncapacity_bytes = "64MiB"\n')
    unit_env = {"CACHE_DIRECTORY": str(cache), "CONFIGURATION_DIRECTORY": str(etc)}
    shown = f"KVTIER_NVME__PATH={workdir / 'drive'}" if drop_in else ""
    tier = workdir / "drive" if drop_in else cache / "nvme"
    daemon_env = dict(unit_env, **dict([shown.split("=", 1)] if shown else []))
    daemon = DaemonProcess(
        workdir, ["--listen", f"unix://{workdir}/k.sock", "--dram-capacity", "16MiB"], daemon_env
    )
    daemon.start()
    try:
        with kvtier.Client(daemon.target) as client:
            client.put(NS, b"k", b"a tenant's prompt")
        assert daemon.terminate() == 0  # flush_on_stop: the block is now a record on disk
    finally:
        daemon.kill()
    assert len(list(tier.rglob(f"*{RECORD_SUFFIX}"))) == 1

    # The recipe verbatim, with this test's paths, and stand-ins for sudo (run as the
    # user) and systemctl (stop/start do nothing here; show prints the unit's Environment=).
    fakes = {
        "sudo": '#!/bin/sh\n[ "$1" = -u ] && shift 2\nexec "$@"\n',
        "systemctl": f'#!/bin/sh\n[ "$1" = show ] && echo "{shown}"\nexit 0\n',
        "kvtier": f'#!/bin/sh\nexec {sys.executable} -m kvtier "$@"\n',
    }
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    recipe = (
        _recipe((Path(__file__).parents[2] / "docs" / "operations.md").read_text())
        .replace("/var/cache/kvtier", str(cache))
        .replace("/etc/kvtier", str(etc))
        .replace("/opt/kvtier/bin/kvtier", str(bin_dir / "kvtier"))
        .replace("--tenant team-a", "--tenant default")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    env["HOME"] = str(workdir / "home")  # where a recipe without the unit's env would look
    result = subprocess.run(
        ["sh", "-ec", recipe], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "wiped 1 records" in result.stdout and f"from {tier}" in result.stdout
