"""benchmarks/gpu_check.py's output, which a GPU host's one run must get right the first
time: the JSON keys the GPU issue names, its targets, and a failed row kept with its
error (the figures themselves need a GPU: scripts/gpu_check.sh)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
gpu_check: Any = pytest.importorskip("gpu_check")

E2E = {"engine": "transformers", "passed": True, "ttft_ratio": 0.2, "ttft_s": {}}


def rows(h2d: float = 0.95, slowdown: float = 0.04) -> list[dict[str, Any]]:
    row = gpu_check._row
    overlap = {"metric": "matmul slowdown while copying", "kvtier": slowdown, "baseline": 0.0,
               "ratio": None, "target": "<= 10 %", "ok": slowdown <= 0.10}  # fmt: skip
    return [
        row("h2d", h2d * 50e9, 50e9, ">= 0.8x", 0.8),
        row("d2h", 48e9, 50e9, ">= 0.8x", 0.8),
        row("d2d via IPC", 3.9e12, 4.0e12, ">= 0.8x", 0.8),
        row("nvme->gpu pipeline", 2.5e9, 2.7e9, ">= 0.8x", 0.8),
        row("arena pin (s)", 3.0, 4.0, "reported", None),
        overlap,
        gpu_check._e2e_row({**E2E, "ttft_s": {"kvtier": 0.01, "recompute": 0.05}}),
    ]


def test_the_json_has_the_issues_keys_and_checks_its_targets() -> None:
    out = gpu_check.summary(rows(), "NVIDIA H200", E2E, 0)
    for key in ("device", "h2d_ratio", "d2h_ratio", "d2d_ipc_ratio", "nvme_gpu_ratio",
                "matmul_slowdown", "engine_e2e"):  # fmt: skip
        assert out[key] is not None, key
    assert out["h2d_ratio"] == pytest.approx(0.95) and out["matmul_slowdown"] == 0.04
    assert out["engine_e2e"] == {"engine": "transformers", "passed": True, "ttft_ratio": 0.2}
    assert out["arena_pin_s"] == {"kvtier": 3.0, "cudaHostAlloc": 4.0}
    assert out["targets_met"] is True and out["gpu_tests_passed"] is True


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"h2d": 0.7}, "a ratio under 0.8"),
        ({"slowdown": 0.12}, "a slowdown over 10 %"),
        ({"tests_rc": 1}, "a gpu test failed"),
        ({"e2e": {**E2E, "passed": False}}, "the engine end to end failed"),
    ],
)
def test_any_target_missed_is_targets_not_met(changes: dict[str, Any], why: str) -> None:
    table = rows(changes.get("h2d", 0.95), changes.get("slowdown", 0.04))
    out = gpu_check.summary(table, "H200", changes.get("e2e", E2E), changes.get("tests_rc", 0))
    assert out["targets_met"] is False, why


def test_a_failed_row_is_kept_with_its_error_in_the_json_and_the_table() -> None:
    table = rows()
    table[0] = gpu_check._failed("h2d / d2h", RuntimeError("CUDA error: out of memory"))
    out = gpu_check.summary(table, "H200", E2E, 0)
    assert out["h2d_ratio"] is None and out["targets_met"] is False
    markdown = gpu_check.table(table, "H200", 256 << 20)
    assert "| h2d / d2h | - | - | - | - | **no** (RuntimeError: CUDA error: out of memory) |" in (
        markdown
    )
    assert "| engine e2e TTFT (s) | 0.01 s | 0.05 s | 0.20x | passed | yes |" in markdown
