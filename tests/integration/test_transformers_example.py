"""examples/transformers_prefix_cache.py keeps working: HF transformers generating from a
DynamicCache whose prefix KV came back from a real daemon, bit-exact, same tokens.
Runs in .venv-vllm (it has transformers; `make vllm-env`)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess
from tests.integration.conftest import ROOT

pytestmark = pytest.mark.vllm

EXAMPLE = ROOT / "examples" / "transformers_prefix_cache.py"
StartDaemon = Callable[..., DaemonProcess]


def run_example(
    python: Path, model: Path, target: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), str(EXAMPLE), "--model", str(model), "--target", target, *extra],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


def test_transformers_example_generates_the_same_from_kvtier(
    vllm_python: Path, tiny_model: Path, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon(dram="64MiB", nvme="256MiB")
    done = run_example(vllm_python, tiny_model, daemon.target)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "512 of them from kvtier" in done.stdout
    assert "bit for bit: yes" in done.stdout and "identical" in done.stdout
    with daemon.client() as client:
        assert client.stats()["tiers"]["dram"]["blocks"] == 512 // 64
    # Again: the blocks are there already (same bytes), the answer is the same.
    again = run_example(vllm_python, tiny_model, daemon.target)
    assert again.returncode == 0 and "identical" in again.stdout, again.stderr[-3000:]
