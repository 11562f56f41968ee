"""examples/transformers_prefix_cache.py keeps working: HF transformers generating from a
DynamicCache whose prefix KV came back from a real daemon, bit-exact, same tokens; on the
CPU (the shared arena), and on the GPU path, CUDA IPC: on the daemon's CPU stand-in
(`gpu.emulate`) everywhere, and on a real GPU where there is one (scripts/gpu_check.sh).
The CPU runs use .venv-vllm (it has transformers; `make vllm-env`); the GPU run uses the
interpreter running the tests (a GPU host's image has torch with CUDA and transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess
from tests.integration.conftest import DRIVER, ROOT

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


@pytest.mark.vllm
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


def check_gpu_path(done: subprocess.CompletedProcess[str], outcome: Path, transport: str) -> None:
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "512 of them from kvtier" in done.stdout
    assert "bit for bit: yes" in done.stdout and "identical" in done.stdout
    result = json.loads(outcome.read_text())
    assert result["transport"] == transport and result["passed"] is True, result
    assert result["engine"] == "transformers" and result["ttft_ratio"] > 0, result


@pytest.mark.vllm
def test_transformers_example_through_cuda_ipc_on_the_emulated_gpu(
    vllm_python: Path, tiny_model: Path, start_daemon: StartDaemon, workdir: Path
) -> None:
    """The GPU path's code on the CPU: the cache's blocks gathered into a registered
    shared-memory buffer the daemon maps, copied out and back in by the daemon's
    (emulated) streams; nothing crosses the client's socket but the calls."""
    daemon = start_daemon(dram="64MiB", nvme="256MiB", env={"KVTIER_GPU__EMULATE": "true"})
    outcome = workdir / "outcome.json"
    flags = ("--device", "cuda", "--emulate", "--json", str(outcome))
    done = run_example(vllm_python, tiny_model, daemon.target, *flags)
    check_gpu_path(done, outcome, "cuda-ipc-emulated")
    with daemon.client() as client:
        stats = client.stats()
    assert stats["tiers"]["dram"]["blocks"] == 512 // 64 and stats["leases"] == 0


@pytest.mark.gpu
def test_transformers_example_through_cuda_ipc_on_a_real_gpu(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    model = workdir / "tiny-llama"
    subprocess.run(
        [sys.executable, str(DRIVER), "build-model", str(model)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    daemon = start_daemon(dram="256MiB", nvme="256MiB", env={"KVTIER_GPU__DEVICE": "0"})
    outcome = workdir / "outcome.json"
    done = run_example(
        Path(sys.executable), model, daemon.target, "--device", "cuda", "--json", str(outcome)
    )
    check_gpu_path(done, outcome, "cuda-ipc")
