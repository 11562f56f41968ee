"""Fixtures for the tests that run real SGLang code from .venv-sglang (make sglang-env)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    if not SGLANG_PYTHON.exists():
        if os.environ.get("KVTIER_REQUIRE_SGLANG") == "1":
            pytest.fail(f"{SGLANG_PYTHON} is missing: run `make sglang-env`")
        pytest.skip(f"real SGLang not installed ({SGLANG_PYTHON}): run `make sglang-env` first")
    return SGLANG_PYTHON
