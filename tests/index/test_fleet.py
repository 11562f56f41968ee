"""Fleet replay: routing policies over simulated nodes, on traces whose answers are known."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.index.fleet import ROUTINGS, FleetConfig, fleet_replay, sticky_node
from kvtier.index.replay import ReplayConfig, Request


def conversations(
    hot_turns: int, cold: int, gap_ms: float, hot_gap_ms: float | None = None
) -> list[Request]:
    """One hot conversation (many turns, each extending the last, every `hot_gap_ms`) and
    `cold` conversations of three turns, interleaved in time (every `gap_ms`)."""
    requests: list[tuple[float, list[int]]] = []
    hot = [1000]
    for turn in range(hot_turns):
        hot = [*hot, 1000 + turn + 1]
        requests.append((turn * (hot_gap_ms or gap_ms), list(hot)))
    for c in range(cold):
        chain = [10_000 * (c + 2)]
        for turn in range(3):
            chain = [*chain, chain[-1] + 1, chain[-1] + 2]
            requests.append(((c * 3 + turn) * gap_ms + gap_ms / 2, list(chain)))
    requests.sort(key=lambda r: r[0])
    return [Request(t, 512 * len(chain), 1, chain) for t, chain in requests]


def run(routing: str, requests: list[Request], nodes: int = 4) -> dict[str, object]:
    config = ReplayConfig(dram_blocks=200, nvme_blocks=800)
    report, series = fleet_replay(config, FleetConfig(nodes, routing, 2.0), requests)  # type: ignore[arg-type]
    assert len(series) == 100 and all(0 <= b <= 1.0 + 1e-9 for p in series for b in p["busy"])
    return report


def test_every_routing_serves_every_request_once_and_keeps_a_conversation_together() -> None:
    requests = conversations(hot_turns=30, cold=12, gap_ms=300)
    for routing in ROUTINGS:
        report = run(routing, requests)
        assert report["requests"] == len(requests)
        assert 0 <= report["goodput"] <= 1  # type: ignore[operator]
        work = report["node_prefill_seconds"]
        assert sum(work) == pytest.approx(  # type: ignore[arg-type]
            report["prefill_seconds_without_cache"] - report["prefill_seconds_saved"]  # type: ignore[operator]
        )
    assert len({sticky_node(r, 4) for r in requests if r.hash_ids[0] == 1000}) == 1


def test_prefix_aware_spreads_a_hot_conversation_that_sticky_pins_to_one_node() -> None:
    # Turns of the hot conversation arrive faster than one node can prefill them, even
    # with their prefix cached (~60 ms each here).
    requests = conversations(hot_turns=40, cold=8, gap_ms=150, hot_gap_ms=20)
    sticky, aware, spread = (run(r, requests) for r in ("sticky", "prefix-aware", "round-robin"))
    assert aware["load_max_over_mean"] < sticky["load_max_over_mean"]  # type: ignore[operator]
    assert aware["ttft_p99_s"] < sticky["ttft_p99_s"]  # type: ignore[operator]
    # ...while still finding the prefixes that round-robin scatters.
    assert aware["prefill_seconds_saved"] > spread["prefill_seconds_saved"]  # type: ignore[operator]


def test_cli_fleet_replay_prints_one_report_per_routing(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": r.timestamp_ms,
                    "input_length": r.input_tokens,
                    "hash_ids": r.hash_ids,
                }
            )
            + "\n"
            for r in conversations(hot_turns=10, cold=4, gap_ms=200)
        )
    )
    cmd = [sys.executable, "-m", "kvtier", "replay", str(trace), "--nodes", "3", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    reports = json.loads(out.stdout)
    assert [r["routing"] for r in reports] == list(ROUTINGS)
    assert all(r["nodes"] == 3 and r["requests"] == 22 for r in reports)
    bad = subprocess.run([*cmd, "--policy", "oracle"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "oracle" in bad.stderr
