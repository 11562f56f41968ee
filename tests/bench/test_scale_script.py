"""benchmarks/scale.py, small, so that the script cannot rot: its JSON is complete and
self-consistent (every block accounted for, every sampled block served and bit-exact)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scale.py"


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        check=True,
        env=env,
        timeout=180,
        capture_output=True,
    )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_a_small_fill_and_restart_reports_consistent_figures(tmp_path: Path) -> None:
    data = tmp_path / "data"
    r = _run(tmp_path, "--blocks", "300", "--skip-stream", "--directory", str(data))
    fill, restart, back = r["fill"], r["restart"], r["readback"]
    assert fill["blocks"] == 300 and fill["block_bytes"] == 4096
    assert fill["dram_blocks"] + fill["nvme_blocks"] == 300
    assert fill["blocks_per_s"] > 0 and fill["mb_per_s"] > 0
    assert 0 < fill["rss_anon_empty_bytes"] < fill["rss_anon_bytes"]
    assert fill["rss_anon_per_block_bytes"] > 0
    # The stall probe answered: at least one gap between its 5 ms wake-ups.
    assert 5 <= fill["stall_max_ms"] < 60_000 and 5 <= restart["stall_max_ms"] < 60_000
    assert restart["blocks_after"] == 300
    assert 0 < restart["ready_s"] <= restart["sampled_served_s"]
    assert restart["rss_anon_bytes"] > 0
    assert restart["sampled"] == back["checked"] == back["bit_exact"] == 300
    assert back["wrong"] == back["missing"] == 0
    lat = r["latency"]
    assert lat["chain_blocks"] == 256
    assert 0 < lat["lookup_p50_ms"] <= lat["lookup_p99_ms"]
    assert 0 < lat["plan_p50_ms"] <= lat["plan_p99_ms"]
    assert "stream" not in r
    assert list(data.iterdir()) == []  # the tier it made is gone


def test_the_in_process_index_measure_reports_per_entry_figures(tmp_path: Path) -> None:
    r = _run(tmp_path, "--in-process-memory", "3000")["in_process"]
    assert r["entries"] == 3000 and r["policy"] == "kvtier"
    # The packed index keeps nothing per block for the collector to walk (issue 22): well
    # under one tracked object a block (the daemon's own objects spread over 3000).
    assert 0 <= r["gc_tracked_objects_per_entry"] < 1
    assert isinstance(r["rss_anon_per_entry_bytes"], int) and r["full_gc_s"] >= 0


def test_a_small_stream_ab_reports_both_sides_and_fio(tmp_path: Path) -> None:
    data = tmp_path / "data"
    args = ["--stream-only", "--stream-bytes", "40MiB", "--layout", "segments"]
    r = _run(tmp_path, *args, "--baseline", str(ROOT), "--directory", str(data))
    assert "fill" not in r
    rows = r["stream"]
    assert [row["block_bytes"] for row in rows] == [64 << 10, 2 << 20]
    for row in rows:
        put = row["kvtier_blocks_put"]
        assert put == (40 << 20) // row["block_bytes"] == row["baseline_blocks_put"]
        for side in ("kvtier", "baseline"):
            # 40 MiB through a 16 MiB arena: all but what DRAM holds reached NVMe.
            size = row["block_bytes"]
            assert put - (16 << 20) // size <= row[f"{side}_blocks_on_nvme"] <= put
            assert row[f"{side}_mb_per_s"] > 0 and row[f"{side}_stall_max_ms"] >= 0
            # Where a block's time went (schedstat): the loop thread cannot have run
            # longer than the put took, the I/O threads wrote what reached NVMe, and the
            # wall time a block gives back the rate.
            wall_us = row[f"{side}_wall_us"]
            assert 0 < row[f"{side}_loop_cpu_us"] <= wall_us * 1.05 + 5
            assert row[f"{side}_loop_runq_us"] >= 0 and row[f"{side}_client_cpu_us"] > 0
            assert row[f"{side}_daemon_threads_cpu_us"] > 0
            rate = row[f"{side}_blocks_on_nvme"] * size / (wall_us * put)
            assert abs(rate - row[f"{side}_mb_per_s"]) <= 0.02 * rate + 0.2
            if "fio_mb_per_s" in row:
                expected = row[f"{side}_mb_per_s"] / row["fio_mb_per_s"]
                assert abs(row[f"{side}_ratio"] - expected) < 0.01
                steady = row[f"{side}_steady_mb_per_s"] / row["fio_mb_per_s"]
                assert abs(row[f"{side}_steady_ratio"] - steady) < 0.01
            _check_steady(row, side)
    assert list(data.iterdir()) == []


def _check_steady(row: dict[str, Any], side: str) -> None:
    """The steady state is the stream's second half, from the first put_many batch that
    starts in it (the 16 MiB arena fills before it): what reached NVMe in it is what was
    put in it, give or take what DRAM holds at its start and end."""
    size, put = row["block_bytes"], row[f"{side}_blocks_put"]
    step = max(1, min(256, (1 << 20) // size))  # the script's put_many batch, in blocks
    first = -(-(put // 2) // step) * step
    assert row[f"{side}_steady_blocks_put"] == put - first
    half, held = put - first, (16 << 20) // size
    on_nvme = row[f"{side}_steady_blocks_on_nvme"]
    assert half - held <= on_nvme <= min(half + held, row[f"{side}_blocks_on_nvme"])
    put_rate, rate = row[f"{side}_steady_put_mb_per_s"], row[f"{side}_steady_mb_per_s"]
    assert rate > 0 and abs(rate / put_rate - on_nvme / half) < 0.02


def test_a_stream_by_two_writers_puts_every_block(tmp_path: Path) -> None:
    """--stream-jobs 2: two clients, each every other batch; every block reaches the
    daemon (all but what DRAM holds on NVMe), none twice (the tier counts blocks)."""
    data = tmp_path / "data"
    args = ["--stream-only", "--stream-bytes", "40MiB", "--layout", "segments"]
    r = _run(tmp_path, *args, "--stream-jobs", "2", "--directory", str(data))
    for row in r["stream"]:
        size = row["block_bytes"]
        put = row["kvtier_blocks_put"]
        assert put == (40 << 20) // size
        assert put - (16 << 20) // size <= row["kvtier_blocks_on_nvme"] <= put
        assert row["kvtier_mb_per_s"] > 0
        # The writers' threads have ended when the put does: their CPU is counted still,
        # at least a copy of each block (at 30 GB/s, faster than memory here).
        assert row["kvtier_client_cpu_us"] >= size / 30e3
        _check_steady(row, "kvtier")  # marked by whichever writer puts the second half's first
    assert list(data.iterdir()) == []
