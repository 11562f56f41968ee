"""benchmarks/bookkeeping_instructions.py's measured work, small and without valgrind, so
that the script cannot rot: for every policy it catalogues every block and then demotes
every whole batch (it checks both itself, and exits non-zero where either falls short,
rather than count the instructions of work not done)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bookkeeping_instructions.py"


def _child(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--child", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("policy", ["kvtier", "lru", "s3fifo"])
def test_the_measured_work_catalogues_and_demotes_every_block(policy: str) -> None:
    for part in ("add", "demote"):
        done = _child("200", "--part", part, "--policy", policy)
        assert done.returncode == 0, done.stderr[-2000:]


def test_a_demotion_that_finds_too_few_victims_is_refused() -> None:
    """The check that keeps a no-op from passing for a gain: a residency whose DRAM order
    gives no victims (every block pinned by a stand-in) makes the child exit non-zero."""
    code = (
        "import sys; sys.argv = ['x', '--child', '64', '--part', 'demote'];"
        "sys.path.insert(0, 'benchmarks');"
        "from kvtier.index.catalog import Catalog;"
        "Catalog.evictable_slot = lambda self, slot: False;"
        "import bookkeeping_instructions as b; raise SystemExit(b.main())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "victims" in done.stderr
