"""The `kvtier` command as a user scripts it: serve, config, put/get/rm/ls/stat/stats."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]


def kvtier(
    *args: str, stdin: bytes = b"", env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[bytes]:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier", *args],
        input=stdin,
        capture_output=True,
        env=dict(os.environ, **(env or {})),
        timeout=60,
    )
    if check:
        assert result.returncode == 0, result.stderr.decode()
    return result


def test_redis_cli_style_session(start_daemon: StartDaemon, tmp_path: Path) -> None:
    daemon = start_daemon(dram="16MiB", nvme="64MiB")
    t = ("--target", daemon.target)
    payload = os.urandom(3 << 20)
    src = tmp_path / "block.bin"
    src.write_bytes(payload)
    assert kvtier("put", *t, "m/l", "blk-1", str(src)).stdout == b"OK\n"
    assert kvtier("put", *t, "m/l", "blk-1", str(src)).stdout == b"OK (already present)\n"
    assert kvtier("put", *t, "m/l", "hex:00ff", "--value", "hello").returncode == 0
    assert kvtier("put", *t, "m/l", "from-stdin", stdin=b"piped bytes").returncode == 0
    assert kvtier("get", *t, "m/l", "blk-1").stdout == payload
    assert kvtier("get", *t, "m/l", "00ff", "--hex").stdout == b"hello"
    assert kvtier("get", *t, "m/l", "from-stdin").stdout == b"piped bytes"
    out = tmp_path / "out.bin"
    kvtier("get", *t, "m/l", "blk-1", "-o", str(out))
    assert out.read_bytes() == payload

    miss = kvtier("get", *t, "m/l", "nope", check=False)
    assert miss.returncode == 1 and miss.stdout == b"" and b"(nil)" in miss.stderr

    listing = json.loads(kvtier("ls", *t, "m/l", "--json").stdout)
    assert sorted(e["key"] for e in listing) == ["blk-1", "from-stdin", "hex:00ff"]
    assert {e["size_bytes"] for e in listing} == {3 << 20, 5, 11}
    plain = kvtier("ls", *t).stdout.decode().splitlines()
    assert any(line.startswith("m/l\tblk-1\t3145728\t") for line in plain)

    stat = json.loads(kvtier("stat", *t, "m/l", "blk-1", "--json").stdout)
    assert stat["size_bytes"] == 3 << 20 and stat["tiers"] == ["dram"]

    lookup = json.loads(kvtier("lookup", *t, "m/l", "blk-1", "nope", "from-stdin", "--json").stdout)
    assert lookup == {"prefix_blocks": 1, "tiers": ["dram", None, "dram"]}

    assert kvtier("rm", *t, "m/l", "blk-1").stdout == b"1\n"
    assert kvtier("rm", *t, "m/l", "blk-1").stdout == b"0\n"

    stats = json.loads(kvtier("stats", *t, "--json").stdout)
    assert stats["tiers"]["dram"]["capacity_bytes"] == 16 << 20
    assert stats["hits"] >= 4 and stats["misses"] >= 1
    human = kvtier("stats", *t).stdout.decode()
    assert "dram" in human and "hit ratio" in human

    bad = kvtier("put", *t, "bad namespace", "k", "--value", "x", check=False)
    assert bad.returncode == 2 and b"InvalidArgument" in bad.stderr

    # Residency events since the start, as JSON lines: the session above, in order.
    with daemon.client() as client:
        epoch = client.snapshot().epoch
    out = kvtier("events", *t, "m/l", "--resume", f"{epoch}:0", "--count", "4").stdout
    events = [json.loads(line) for line in out.decode().splitlines()]
    assert [(e["key"], e["tiers"]) for e in events] == [
        ("blk-1", ["dram"]),
        ("hex:00ff", ["dram"]),
        ("from-stdin", ["dram"]),
        ("blk-1", []),
    ]
    assert all(e["epoch"] == epoch for e in events)
    stale = kvtier("events", *t, "--resume", "not-this-epoch:3").stdout
    assert json.loads(stale) == {"epoch": epoch, "resync": True}


def test_client_commands_fail_clearly_without_a_daemon(tmp_path: Path) -> None:
    result = kvtier("stats", "--target", f"unix://{tmp_path}/none.sock", check=False)
    assert result.returncode == 2
    assert b"Unavailable" in result.stderr


def test_config_default_dump_validate(tmp_path: Path) -> None:
    default = kvtier("config", "default").stdout.decode()
    assert "[dram]" in default and 'capacity_bytes = "1GiB"' in default
    good = tmp_path / "kvtier.toml"
    good.write_text(default.replace('capacity_bytes = "1GiB"', 'capacity_bytes = "3GiB"'))
    assert b"valid" in kvtier("config", "validate", "--config", str(good)).stdout
    dumped = kvtier(
        "config", "dump", "--config", str(good), env={"KVTIER_NVME__CAPACITY_BYTES": "5GiB"}
    ).stdout.decode()
    assert 'capacity_bytes = "3GiB"' in dumped and 'capacity_bytes = "5GiB"' in dumped
    assert "unix://" in dumped  # paths are resolved in a dump

    bad = tmp_path / "bad.toml"
    bad.write_text('[dram]\ncapacity_bytes = "1GiB"\ncapacity_byts = 1\n')
    result = kvtier("config", "validate", "--config", str(bad), check=False)
    assert result.returncode == 2
    assert str(bad).encode() in result.stderr and b"dram.capacity_byts" in result.stderr


def test_serve_refuses_a_metrics_port_in_use(tmp_path: Path) -> None:
    """The metrics endpoint starts off the event loop now; a port it cannot bind still
    stops the daemon with exit 2 and the key to fix, not a traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "kvtier.toml"
        path.write_text(
            f'[server]\nlisten = "unix://{tmp_path}/s.sock"\n'
            f'metrics_listen = "127.0.0.1:{port}"\n'
            f'[dram]\ncapacity_bytes = "16MiB"\nprefault = false\n'
            f'[nvme]\npath = "{tmp_path}/nvme"\ncapacity_bytes = "64MiB"\n'
        )
        result = kvtier("serve", "--config", str(path), check=False)
    assert result.returncode == 2, result.stderr.decode()
    assert b"server.metrics_listen: cannot listen on" in result.stderr
    assert b"Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[nvme]\ncapacity_bytes = "lots"\n', "nvme.capacity_bytes"),
        ("[servr]\nlisten = 'x'\n", "unknown key 'servr'"),
        ("[dram\n", "not valid TOML"),
    ],
)
def test_serve_refuses_invalid_config_naming_key_and_file(
    tmp_path: Path, text: str, words: str
) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    result = kvtier("serve", "--config", str(path), check=False)
    assert result.returncode == 2
    assert str(path).encode() in result.stderr and words.encode() in result.stderr


def test_serve_with_no_arguments_uses_embedded_defaults(tmp_path: Path) -> None:
    env = {
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "KVTIER_DRAM__CAPACITY_BYTES": "64MiB",
    }
    daemon = DaemonProcess(tmp_path, [], env)
    daemon.start()
    try:
        sock = tmp_path / "run" / "kvtier" / "kvtier.sock"
        assert f"serving on unix://{sock}" in daemon.banner
        assert str(tmp_path / "state" / "kvtier" / "nvme") in daemon.banner
        result = kvtier("put", "m/l", "k", "--value", "v", env=env)
        assert result.returncode == 0  # the client finds the default socket by itself
        assert kvtier("get", "m/l", "k", env=env).stdout == b"v"
        assert oct(sock.stat().st_mode & 0o777) == oct(0o770)
        assert daemon.terminate() == 0
        assert not sock.exists()
    finally:
        daemon.kill()


def test_second_daemon_on_the_same_socket_is_refused(start_daemon: StartDaemon) -> None:
    first = start_daemon(dram="8MiB", nvme="16MiB")
    second = DaemonProcess(first.workdir, first.args)
    with pytest.raises(AssertionError, match="already serving"):
        second.start()
    with first.client() as client:
        client.put("m/l", b"k", b"still here")
        assert client.get("m/l", b"k") == b"still here"


def test_sigterm_drains_and_exits_zero_and_sighup_reloads(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    import signal
    import time

    config = tmp_path / "kvtier.toml"
    config.write_text('[log]\nlevel = "info"\n')
    daemon = start_daemon(dram="8MiB", nvme="16MiB", extra=["--config", str(config)])
    config.write_text('[log]\nlevel = "debug"\n')
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "reloaded log.level" not in daemon.log():
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.05)
    config.write_text("[log]\nlevel = 'loud'\n")
    daemon.proc.send_signal(signal.SIGHUP)
    while "reload refused" not in daemon.log():
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.05)
    with daemon.client() as client:
        assert client.stats()["version"]  # still serving after a refused reload
    assert daemon.terminate() == 0
    assert "stopped" in daemon.log()


def test_unusable_nvme_path_and_port_are_clear_errors(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = kvtier(
        "serve",
        "--listen",
        f"unix://{tmp_path}/s.sock",
        "--dram-capacity",
        "8MiB",
        "--nvme-path",
        str(blocker / "nvme"),
        check=False,
    )
    assert result.returncode == 2
    assert b"nvme.path: cannot use" in result.stderr and b"Traceback" not in result.stderr
    result = kvtier(
        "serve",
        "--listen",
        "256.1.1.1:99999",
        "--dram-capacity",
        "8MiB",
        "--nvme-path",
        str(tmp_path / "nvme"),
        check=False,
    )
    assert result.returncode == 2 and b"server.listen" in result.stderr


def test_metrics_endpoint_exports_tier_usage(start_daemon: StartDaemon) -> None:
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = start_daemon(
        dram="8MiB", nvme="32MiB", extra=["--metrics-listen", f"127.0.0.1:{port}"]
    )
    with daemon.client() as client:
        client.put("m/l", b"k", b"v" * 5000)
        client.get("m/l", b"k")
        client.get("m/l", b"absent")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'kvtier_tier_capacity_bytes{tier="dram"} 8.388608e+06' in text
    assert 'kvtier_tier_used_bytes{tier="dram"} 8192.0' in text
    assert 'kvtier_hits_total{tier="dram"} 1.0' in text
    assert "kvtier_misses_total 1.0" in text
