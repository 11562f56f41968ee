"""DRAM's order against LRU on traffic it was not tuned on: segments of the shared trace
transformed in ways the policy never saw (kvtier/sim/transform.py), replayed through the
real catalog, policies and planner. kvtier must save at least LRU's prefill seconds."""

from __future__ import annotations

import pytest

from kvtier.sim.replay import ReplayConfig, read_trace, replay
from kvtier.sim.transform import transform
from tests.sim.test_replay import TRACE


@pytest.mark.skipif(not TRACE.exists(), reason="the shared Mooncake trace is not here")
@pytest.mark.parametrize(
    ("spec", "dram_blocks"),
    [
        # users three times as slow, half the conversations, the first 1,000 requests
        ("gaps:3,sample:0.5:9,head:1000", 400),
        # every conversation moved to a new start, the first 1,200 requests
        ("interleave:3,head:1200", 800),
    ],
)
def test_kvtier_saves_at_least_what_lru_saves(spec: str, dram_blocks: int) -> None:
    requests = transform(read_trace(TRACE), spec)
    saved = {
        policy: replay(ReplayConfig(dram_blocks, 4 * dram_blocks, policy=policy), requests)[0][
            "prefill_seconds_saved"
        ]
        for policy in ("lru", "kvtier")
    }
    assert saved["lru"] > 0  # the segment has reuse to win or lose
    assert saved["kvtier"] >= saved["lru"], saved
