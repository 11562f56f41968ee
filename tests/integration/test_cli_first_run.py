"""A newcomer's first commands: every mistake exits 2 with what to fix, never a traceback.

Each case is a command line as typed at a shell, with no daemon running unless it says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run(
    *args: str | bytes, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier", *args],
        capture_output=True,
        env=dict(os.environ, **(env or {})),
        cwd=cwd,
        timeout=60,
    )
    return subprocess.CompletedProcess(
        result.args,
        result.returncode,
        result.stdout.decode(errors="replace"),
        result.stderr.decode(errors="replace"),
    )


def refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit 2, one message naming `words`, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)


def test_put_of_a_missing_file_names_it_and_the_other_ways_in(tmp_path: Path) -> None:
    missing = tmp_path / "missing.bin"
    target = f"unix://{tmp_path}/none.sock"
    result = run("put", "--target", target, "m/l", "k", str(missing))
    refused(result, f"cannot read {missing}", "No such file", "--value")


def test_a_key_that_is_not_utf8_is_refused_with_its_hex_spelling(tmp_path: Path) -> None:
    target = f"unix://{tmp_path}/none.sock"
    result = run("put", "--target", target, "m/l", b"blk-\xff", "--value", "x")
    refused(result, "not UTF-8", "hex:626c6b2dff", "--hex 626c6b2dff")
    refused(run("get", "--target", target, b"m/\xfe", "k"), "namespace", "not UTF-8")


@pytest.mark.parametrize(
    "command", [["stats"], ["get", "m/l", "k"], ["put", "m/l", "k", "--value", "v"]]
)
def test_no_daemon_says_which_address_and_how_to_start_one(
    tmp_path: Path, command: list[str]
) -> None:
    sock = tmp_path / "none.sock"
    result = run(*command, "--target", f"unix://{sock}")
    refused(result, f"no kvtier daemon at unix://{sock}", "kvtier serve", "--target")
    assert "failed to connect to all addresses" not in result.stderr
    assert "FAILED_PRECONDITION" not in result.stderr


def test_no_daemon_at_the_default_socket_names_that_socket(tmp_path: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "KVTIER_TARGET": ""}
    result = run("stats", env=env)
    refused(result, f"no kvtier daemon at unix://{tmp_path}/kvtier/kvtier.sock", "kvtier serve")


def test_no_daemon_on_a_tcp_port_names_the_port() -> None:
    # Port 1 (tcpmux) has no listener on any machine these tests run on.
    result = run("stats", "--target", "127.0.0.1:1")
    refused(result, "no kvtier daemon at 127.0.0.1:1", "Connection refused", "--target")


def test_an_unwritable_output_file_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    # An OSError from a path the user gave (here matplotlib's savefig): the catch in main
    # names the file.
    pytest.importorskip("matplotlib")
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]}\n')
    plot = tmp_path / "no-such-dir" / "replay.png"
    result = run("replay", str(trace), "--policy", "lru", "--plot", str(plot))
    refused(result, f"kvtier: {plot}: No such file or directory")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[dram]\ncapacity_byts = 1\n", ["unknown key 'dram.capacity_byts'", "'capacity_bytes'"]),
        ('[auth.tokens]\n"abc" = "team-a"\n', ["invalid value for 'auth.tokens': keys must"]),
    ],
)
def test_a_config_mistake_is_named_in_our_words(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    for command in (["config", "validate"], ["serve"]):
        result = run(*command, "--config", str(path))
        refused(result, str(path), *words)
        assert "Value error" not in result.stderr
