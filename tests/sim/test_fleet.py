"""Fleet replay: routing policies over simulated nodes, on traces whose answers are known."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index.planner import TierCost
from kvtier.sim.fleet import (
    ROUTINGS,
    FleetConfig,
    NodeRemote,
    SharedRemote,
    fleet_replay,
    sticky_node,
)
from kvtier.sim.replay import Replay, ReplayConfig, Request


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


def _trace_file(tmp_path: Path) -> Path:
    """A Mooncake-format trace of `conversations` on disk, for the CLI."""
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
    return trace


def test_cli_fleet_replay_prints_one_report_per_routing(tmp_path: Path) -> None:
    trace = _trace_file(tmp_path)
    cmd = [sys.executable, "-m", "kvtier", "replay", str(trace), "--nodes", "3", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    reports = json.loads(out.stdout)
    assert [r["routing"] for r in reports] == list(ROUTINGS)
    assert all(r["nodes"] == 3 and r["requests"] == 22 for r in reports)
    bad = subprocess.run([*cmd, "--policy", "oracle"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "oracle" in bad.stderr


# ---- the shared remote tier ---------------------------------------------------------------
FAST_REMOTE = TierCost(25e9, 50e-6)  # ~2.7 ms a 64 MiB block: always worth fetching


def remote_run(
    routing: str,
    requests: list[Request],
    nodes: int = 2,
    remote_blocks: int = 1000,
    remote: TierCost = FAST_REMOTE,
) -> dict[str, Any]:
    config = ReplayConfig(dram_blocks=200, nvme_blocks=800, remote=remote)
    fleet = FleetConfig(nodes, routing, 2.0, remote_blocks=remote_blocks)  # type: ignore[arg-type]
    report, _ = fleet_replay(config, fleet, requests)
    return report


def repeated(chain: list[int], times: int, gap_ms: float) -> list[Request]:
    return [Request(i * gap_ms, 512 * len(chain), 1, chain) for i in range(times)]


def test_a_prefix_prefilled_on_one_node_is_a_remote_hit_on_another_then_held_there() -> None:
    chain = list(range(1, 13))
    # Round-robin over 2 nodes: node 0, node 1, node 0, node 1, each after the last ended.
    requests = repeated(chain, 4, gap_ms=5000)
    without = remote_run("round-robin", requests, remote_blocks=0)
    report = remote_run("round-robin", requests)
    block_bytes = ReplayConfig(1, 1).block_bytes
    # Without a remote tier node 1 recomputes its first request; with it, fetches it.
    assert without["tiers"]["dram"]["hits"] == 24 and "remote" not in without["tiers"]
    assert without["remote"] is None
    assert report["tiers"]["remote"] == {"hits": 12, "bytes_read": 12 * block_bytes}
    assert report["tiers"]["dram"]["hits"] == 24  # node 1's second one: from its own DRAM
    assert report["remote"]["hits"] == 12 and report["remote"]["bytes_read"] == 12 * block_bytes
    assert report["remote"]["blocks_written"] == 12  # once, by node 0
    assert report["prefill_seconds_saved"] > without["prefill_seconds_saved"] > 0
    assert report["fetch_regret_seconds"] == 0


def test_a_block_another_node_is_still_prefilling_is_not_readable_yet() -> None:
    chain = list(range(1, 13))
    requests = repeated(chain, 2, gap_ms=1)  # node 1's request arrives 1 ms after node 0's
    report = remote_run("round-robin", requests)
    assert report["remote"]["hits"] == 0 and report["block_hit_ratio"] == 0
    # ...both wrote it; it is stored once, readable from the earlier prefill's end.
    assert report["remote"]["blocks_written"] == 12 and report["remote"]["blocks_held"] == 12


def test_a_throttled_remote_path_is_not_fetched_and_saves_nothing() -> None:
    chain = list(range(1, 13))
    requests = repeated(chain, 2, gap_ms=5000)
    report = remote_run("round-robin", requests, remote=TierCost(1e6, 10.0))
    assert report["block_hit_ratio"] == pytest.approx(0.5)  # node 1 sees it remotely...
    assert report["remote"]["hits"] == 0  # ...but recomputing beats a 10 s fetch
    assert report["prefill_seconds_saved"] == pytest.approx(0, abs=1e-9)
    assert report["fetch_regret_seconds"] == 0


def test_a_node_sees_the_blocks_it_lacks_but_the_remote_holds_once_written() -> None:
    shared = SharedRemote(10, block_bytes=1)
    sim = Replay(ReplayConfig(10, 10), [], NodeRemote(shared))
    keys = [(b).to_bytes(8, "little") for b in (1, 2, 3)]
    shared.commit(keys[:2], ready_s=1.0)
    shared.now_s = 0.5
    assert sim.residency(keys) == [None, None, None]
    shared.now_s = 1.0
    assert sim.residency(keys) == ["remote", "remote", None]
    assert sim.tier_costs["remote"] == ReplayConfig(10, 10).remote
    assert "remote" not in Replay(ReplayConfig(10, 10), []).tier_costs


def test_prefix_aware_routing_counts_a_remote_prefix_as_fetchable_on_an_idle_node() -> None:
    chain = list(range(1, 41))
    requests = [
        Request(0.0, 512 * 40, 1, chain),  # node 0, ~1.1 s
        Request(2_000.0, 512 * 50, 1, [*chain, *range(200, 210)]),  # node 0 again, ~0.5 s
        # Node 0 holds the prefix but is busy for ~0.45 s more; node 1 is idle. Recomputing
        # there (~1.1 s) loses to waiting for node 0; fetching the prefix remotely (~0.3 s) wins.
        Request(2_050.0, 512 * 41, 1, [*chain, 99]),
    ]
    remote = TierCost(10e9, 50e-6)
    report = remote_run("prefix-aware", requests, remote=remote)
    without = remote_run("prefix-aware", requests, remote_blocks=0)
    assert without["node_prefill_seconds"][1] == 0  # waited for node 0
    assert report["remote"]["hits"] == 40
    assert 0 < report["node_prefill_seconds"][1] < 0.5


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 8),
    st.lists(
        st.tuples(st.lists(st.integers(0, 20), max_size=6), st.booleans(), st.integers(0, 20)),
        max_size=40,
    ),
)
def test_the_shared_remote_never_exceeds_capacity_and_keeps_the_most_recent(
    capacity: int, ops: list[tuple[list[int], bool, int]]
) -> None:
    store = SharedRemote(capacity, block_bytes=1)
    store.now_s = float("inf")
    recent: list[int] = []  # model: most recently written or read last
    for written, read_one, which in ops:
        if read_one and store.holds(bytes([which])):
            store.read(bytes([which]))
            recent = [k for k in recent if k != which] + [which]
        store.commit([bytes([k]) for k in written], ready_s=0.0)
        for k in written:
            recent = [r for r in recent if r != k] + [k]
        recent = recent[-capacity:]
        assert len(store) <= capacity
        assert {k for k in range(21) if store.holds(bytes([k]))} == set(recent)


def test_cli_fleet_replay_with_a_remote_tier(tmp_path: Path) -> None:
    trace = _trace_file(tmp_path)
    cmd = [sys.executable, "-m", "kvtier", "replay", str(trace), "--nodes", "2", "--json"]
    out = subprocess.run(
        [*cmd, "--routing", "sticky", "--remote", "1GiB", "--remote-bandwidth", "12.5GB/s"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(out.stdout)
    assert report["remote"]["capacity_blocks"] == 16  # 1 GiB of 64 MiB blocks
    assert report["remote"]["bandwidth_bytes_per_s"] == 12.5e9
    assert report["remote"]["latency_s"] == 50e-6  # the default
    assert report["remote"]["blocks_held"] <= 16
    bad = subprocess.run([*cmd, "--remote", "lots"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--remote" in bad.stderr
