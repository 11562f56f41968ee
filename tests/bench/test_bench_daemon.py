"""The benchmarks' daemon is the kvtier the benchmark imported, wherever it runs from."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvtier
from kvtier.bench.daemon import daemon


def test_the_bench_daemon_runs_this_kvtier_from_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A directory holding another `kvtier` (one that cannot start), as another checkout
    # would: `python -m kvtier` started there without a cwd of its own imports it.
    other = tmp_path / "elsewhere"
    (other / "kvtier").mkdir(parents=True)
    (other / "kvtier" / "__init__.py").write_text("raise SystemExit('the wrong kvtier')\n")
    (other / "kvtier" / "__main__.py").write_text("raise SystemExit('the wrong kvtier')\n")
    monkeypatch.chdir(other)
    with daemon(Path("work"), "uds", 8 << 20) as target, kvtier.Client(target) as client:
        client.wait_ready()
        assert target == f"unix://{other / 'work' / 'bench.sock'}"  # relative to the caller
        client.put("m/bench", b"k" * 16, b"v" * 4096)
        assert client.get("m/bench", b"k" * 16) == b"v" * 4096
