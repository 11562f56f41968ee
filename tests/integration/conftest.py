"""Fixtures for the tests that run real vLLM or transformers from .venv-vllm."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).with_name("vllm_driver.py")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        if os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
            pytest.fail(f"{VLLM_PYTHON} is missing: run `make vllm-env`")
        pytest.skip(f"real vLLM not installed ({VLLM_PYTHON}): run `make vllm-env` first")
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vllm") / "tiny-llama"
    subprocess.run(
        [str(vllm_python), str(DRIVER), "build-model", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out
