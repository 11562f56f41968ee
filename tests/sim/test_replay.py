"""`kvtier replay` on small traces whose answers are known."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.index.planner import TierCost
from kvtier.sim.replay import ReplayConfig, Request, read_trace, replay

# The shared Mooncake trace: beside the checkout (../shared) or where the team keeps it.
_TRACE_NAME = Path("shared") / "traces" / "synthetic_trace.jsonl"
TRACE = next(
    (
        p
        for p in (
            Path(os.environ.get("KVTIER_TRACE", "/nonexistent")),
            Path(__file__).resolve().parents[2].parent / _TRACE_NAME,
            Path("/work") / _TRACE_NAME,
        )
        if p.exists()
    ),
    Path(__file__).resolve().parents[2].parent / _TRACE_NAME,
)


def _requests(chains: list[list[int]]) -> list[Request]:
    return [Request(i * 1000.0, 512 * len(c), 1, c) for i, c in enumerate(chains)]


def test_a_repeated_prompt_hits_from_dram_and_saves_its_prefill() -> None:
    requests = _requests([[1, 2, 3], [1, 2, 3]])
    for policy in ("lru", "s3fifo", "kvtier", "oracle"):
        report, _ = replay(ReplayConfig(dram_blocks=10, nvme_blocks=10, policy=policy), requests)
        assert report["block_hit_ratio"] == pytest.approx(3 / 6)
        assert report["tiers"]["dram"]["hits"] == 3 and report["tiers"]["nvme"]["hits"] == 0
        assert report["prefill_seconds_saved"] > 0 and report["lost_reuse"] == 0


def test_blocks_pushed_out_of_dram_are_served_from_nvme_then_lost_without_it() -> None:
    requests = _requests([[1, 2], [7, 8], [1, 2]])
    with_nvme, _ = replay(ReplayConfig(2, 4, policy="lru", admission="write_back"), requests)
    assert with_nvme["tiers"]["nvme"]["hits"] == 2
    # 1, 2 demoted for 7, 8; then 7, 8 demoted when 1, 2 are promoted back.
    assert with_nvme["nvme_bytes_written"] == 4 * ReplayConfig(2, 4).block_bytes
    without, _ = replay(ReplayConfig(2, 0, policy="lru", admission="write_back"), requests)
    assert without["block_hit_ratio"] == 0 and without["lost_reuse"] == 2
    assert without["prefill_seconds_saved"] == 0


def test_selective_admission_keeps_blocks_whose_reuse_is_still_to_come() -> None:
    # 40 prompts of 4 blocks, then each again: every block comes back, but only after the
    # other 39 prompts. DRAM holds 8 blocks, NVMe all of them. Selective admission must
    # write them (as write-back does): a reuse not yet arrived is not a reuse missed.
    # (When placements counted as not reused at once, P fell below min_p_reuse within a
    # few prompts and the second round recomputed most of the trace.)
    chains = [[10 * n + i for i in range(4)] for n in range(40)]
    requests = _requests(chains + chains)
    for policy in ("lru", "kvtier"):
        report, _ = replay(ReplayConfig(8, 200, policy=policy, admission="selective"), requests)
        back, _ = replay(ReplayConfig(8, 200, policy=policy, admission="write_back"), requests)
        assert report["lost_reuse"] == 0
        assert report["block_hit_ratio"] == back["block_hit_ratio"] == pytest.approx(0.5)


def test_a_hit_the_planner_would_not_fetch_saves_nothing() -> None:
    requests = _requests([[1, 2], [7, 8], [1, 2]])
    slow = ReplayConfig(2, 4, policy="lru", admission="write_back", nvme=TierCost(1e6, 1.0))
    report, _ = replay(slow, requests)
    assert report["block_hit_ratio"] > 0 and report["tiers"]["nvme"]["hits"] == 0
    assert report["prefill_seconds_saved"] == pytest.approx(0, abs=1e-12)


def test_bad_trace_lines_are_refused_with_the_line_number(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        read_trace(trace)


@pytest.mark.skipif(not TRACE.exists(), reason="the shared trace is not in this checkout")
def test_cli_on_the_shared_trace_matches_its_published_lru_figure(tmp_path: Path) -> None:
    # The trace's README: LRU over 5k blocks (one tier) hits 27.9 % of block references.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "replay",
            str(TRACE),
            "--dram-capacity",
            "5000",
            "--nvme-capacity",
            "0",
            "--policy",
            "lru",
            "--admission",
            "write_back",
            "--json",
            "--plot",
            str(tmp_path / "replay.png"),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    report = json.loads(out.stdout)
    assert round(report["block_hit_ratio"], 3) == 0.279
    for field in (
        "policy",
        "requests",
        "tokens_hit",
        "prefill_seconds_saved",
        "fetch_regret_seconds",
        "lost_reuse",
        "nvme_bytes_written",
        "gpu_hours_saved",
        "usd_saved",
        "tiers",
    ):
        assert field in report
    assert report["requests"] == 3993
    assert (tmp_path / "replay.png").stat().st_size > 10_000


def _run_replay(tmp_path: Path, *args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """`kvtier replay` as a user runs it; `prelude` runs first in the same interpreter."""
    trace = tmp_path / "trace.jsonl"
    # One 100-block prompt twice: longer than a DRAM of 4 GiB (64 llama3-8b blocks).
    line = {"input_length": 100 * 512, "hash_ids": list(range(100))}
    trace.write_text("".join(json.dumps({"timestamp": t, **line}) + "\n" for t in (0, 1000)))
    code = f"{prelude}\nimport sys\nfrom kvtier.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, "replay", str(trace), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_replays_a_chain_longer_than_dram_under_every_policy(tmp_path: Path) -> None:
    # The oracle divided by the distance to a block's next use, 0 for a block of the
    # request being served: ZeroDivisionError with any DRAM smaller than a prompt.
    result = _run_replay(tmp_path, "--dram-capacity", "4GiB", "--json")
    assert result.returncode == 0, result.stderr
    reports = {r["policy"]: r for r in json.loads(result.stdout)}
    assert set(reports) == {"lru", "s3fifo", "kvtier", "oracle"}
    oracle = reports["oracle"]
    assert oracle["dram_blocks"] == 64
    # It keeps what the second request needs: every one of its 100 blocks is a hit.
    assert oracle["block_hit_ratio"] == pytest.approx(0.5)
    assert oracle["tiers"]["dram"]["hits"] == 64 and oracle["tiers"]["nvme"]["hits"] == 36


def test_cli_plot_without_matplotlib_says_how_to_get_it(tmp_path: Path) -> None:
    hide = "import sys\nsys.modules['matplotlib'] = None  # import matplotlib: ImportError"
    result = _run_replay(tmp_path, "--plot", str(tmp_path / "r.png"), prelude=hide)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--plot needs matplotlib" in result.stderr and "pip install" in result.stderr
    assert not (tmp_path / "r.png").exists()


def test_the_segment_layouts_write_amplification_follows_the_eviction_order() -> None:
    """NVMe evicting in the order it was written (no reuse: LRU is FIFO) empties whole
    segments, so reclaim copies nothing; hits that reorder LRU leave segments part live,
    which reclaim must copy once the tier is full."""
    import random

    config = ReplayConfig(2, 64, policy="lru", admission="write_back")
    fifo, _ = replay(config, _requests([[n] for n in range(1, 600)]))
    assert fifo["nvme_write_amplification"] == 1.0
    rng = random.Random(5)
    chains: list[list[int]] = []
    for n in range(1, 600):
        chains.append([n])
        if n > 80:  # a block NVMe still holds, hit: now the most recent there
            chains.append([rng.randrange(n - 60, n - 2)])
    reordered, _ = replay(config, _requests(chains))
    assert reordered["tiers"]["nvme"]["hits"] > 100
    assert reordered["nvme_write_amplification"] > 1.05
    none, _ = replay(ReplayConfig(2, 0, policy="lru"), _requests([[1], [2]]))
    assert none["nvme_write_amplification"] is None
