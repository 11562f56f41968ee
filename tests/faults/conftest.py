"""The fault suite's report: each test adds a row; the session prints the table and writes
it as JSON (`$KVTIER_RELIABILITY_JSON`, default build/reliability.json) for RELIABILITY.md
(scripts/reliability_table.py renders it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.harness import Report

_REPORT = Report()
_DEFAULT_JSON = Path(__file__).resolve().parents[2] / "build" / "reliability.json"


@pytest.fixture
def report() -> Report:
    return _REPORT


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _REPORT.rows:
        return
    path = Path(os.environ.get("KVTIER_RELIABILITY_JSON", _DEFAULT_JSON))
    _REPORT.write(path)
    terminalreporter.section("fault injection")
    for r in _REPORT.rows:
        terminalreporter.write_line(
            f"{r.fault:<44} injected {r.injected:>5}  gets {r.gets_checked:>5}  "
            f"wrong {r.wrong_bytes}  lost {r.lost}/{r.must_survive}  "
            f"serving {'yes' if r.serving else 'NO'}"
        )
    terminalreporter.write_line(f"written to {path}")
