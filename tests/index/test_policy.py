"""Eviction policies, admission and ghosts: properties that must hold for any access pattern."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index.planner import PrefillCost, TierCost
from kvtier.index.policy import (
    POLICIES,
    BlockInfo,
    FrequencySketch,
    Ghosts,
    Policies,
    ReuseEstimator,
    ValueModel,
    ValuePolicy,
)

MODEL = ValueModel(
    tokens_per_block=16,
    kv_bytes_per_token=1024,
    prefill=PrefillCost(40e-6, 1.3e-9),
    tier_costs={"dram": TierCost(50e9, 10e-6), "nvme": TierCost(7e9, 100e-6)},
)
SIZE = 16 * 1024

# A workload: chains of block ids (each id's parent is the id before it in its chain).
chains = st.lists(
    st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True), min_size=1, max_size=60
)


def _drive(policy_name: str, workload: list[list[int]], capacity: int, pinned: set[int]) -> None:
    """A one-tier cache of `capacity` blocks under the policy; checks invariants as it goes."""
    policies = Policies(policy_name, "write_back", MODEL, ghost_capacity=capacity)
    tier = policies.new_tier("dram", "nvme", capacity * SIZE)
    parent_of: dict[int, int | None] = {}
    held: set[int] = set()
    for chain in workload:
        for i, block in enumerate(chain):
            parent_of.setdefault(block, chain[i - 1] if i else None)
            info = BlockInfo(SIZE, i, parent_of[block], len(chain) - 1 - i)
            policies.accessed(block, info)
            if block in held:
                tier.hit(block)
                continue
            while len(held) >= capacity:
                victim = tier.victim(lambda k: k not in pinned)
                if victim is None:
                    break
                assert victim not in pinned, "a leased block was evicted"
                if policy_name == "kvtier":
                    children = {b for b in held if parent_of.get(b) == victim}
                    assert not children, "a parent was evicted before its cached children"
                held.discard(victim)
            if len(held) < capacity:
                tier.insert(block, info)
                held.add(block)
            assert len(held) <= capacity
            assert len(tier) == len(held)
            assert all(b in tier for b in held)


@settings(max_examples=60, deadline=None)
@given(workload=chains, capacity=st.integers(1, 12), pinned=st.sets(st.integers(0, 40), max_size=4))
def test_every_policy_keeps_capacity_and_never_evicts_a_pinned_block(
    workload: list[list[int]], capacity: int, pinned: set[int]
) -> None:
    for name in POLICIES:
        _drive(name, workload, capacity, pinned)


def test_value_policy_evicts_leaves_before_parents_and_cheap_blocks_first() -> None:
    sketch = FrequencySketch()
    policy = ValuePolicy("nvme", None, MODEL, sketch)
    # One chain 0 -> 1 -> 2 and a lone block 10 used often.
    for _ in range(5):
        sketch.add(10)
    policy.insert(10, BlockInfo(SIZE, 40))
    for i in range(3):
        policy.insert(i, BlockInfo(SIZE, i, i - 1 if i else None))
    order = [policy.victim(lambda k: True) for _ in range(4)]
    assert order[:3] == [2, 1, 0]  # the chain from its leaf; the popular block last
    assert order[3] == 10 and policy.victim(lambda k: True) is None


def test_a_block_dearer_to_fetch_than_to_recompute_is_worth_nothing() -> None:
    slow = ValueModel(16, 1024, PrefillCost(1e-9, 0.0), {"nvme": TierCost(1e6, 0.1)})
    assert slow.saving_s("nvme", None, BlockInfo(SIZE, 3)) == 0.0
    assert MODEL.saving_s("nvme", None, BlockInfo(SIZE, 3)) > 0
    # Later positions cost more to recompute, so they save more.
    assert MODEL.saving_s("nvme", None, BlockInfo(SIZE, 300)) > MODEL.saving_s(
        "nvme", None, BlockInfo(SIZE, 3)
    )


def test_reuse_estimate_learns_that_chain_tails_rarely_recur() -> None:
    reuse = ReuseEstimator(remembered_keys=50)  # horizon: 50 other keys
    for n in range(200):
        # 200 prompts: the body block recurs, the tail never does.
        reuse.observe(("body", n % 20), 1, BlockInfo(SIZE, 0, None, 5))
        reuse.observe(("tail", n), 1, BlockInfo(SIZE, 6, None, 0))
    tail = reuse.p_reuse(("tail", 999), 1, BlockInfo(SIZE, 6, None, 0))
    body = reuse.p_reuse(("body", 999), 1, BlockInfo(SIZE, 0, None, 5))
    assert tail < 0.05 < 0.5 < body


def test_a_placement_whose_reuse_may_still_come_does_not_count_against_it() -> None:
    # 100 blocks placed once and not yet back: within the horizon nothing is known, so P
    # stays at the prior (counting them at once read 1/102 and refused them all at NVMe).
    reuse = ReuseEstimator(remembered_keys=200)
    body = BlockInfo(SIZE, 0, None, 5)
    for n in range(100):
        reuse.observe(("first", n), 1, body)
    assert reuse.p_reuse(("new", 0), 1, body) == 0.5
    for n in range(100):  # all of them come back: P of a block seen once is now high
        reuse.observe(("first", n), 2, body)
    assert reuse.p_reuse(("new", 1), 1, body) > 0.95
    # Blocks never seen again are counted as not reused once the horizon has passed them.
    for n in range(500):
        reuse.observe(("once", n), 1, body)
    assert reuse.p_reuse(("new", 2), 1, body) == 101 / 402  # 300 of 500 resolved


@settings(max_examples=300, deadline=None)
@given(
    calls=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 4), st.integers(-1, 4))),
    remembered=st.integers(1, 8),
)
def test_reuse_estimate_counts_each_placement_once_its_outcome_is_known(
    calls: list[tuple[int, int, int]], remembered: int
) -> None:
    """P(reuse) by bucket against its definition, computed from the whole call history:
    an observation resolves as reused if its key is observed again before `remembered`
    distinct other keys are, as not reused once they have been; until then it counts
    for nothing."""
    reuse = ReuseEstimator(remembered)
    history: list[tuple[int, tuple[int, int]]] = []
    for key, uses, from_end in calls:
        info = BlockInfo(SIZE, 0, None, from_end)
        reuse.observe(key, uses, info)
        history.append((key, ReuseEstimator.bucket(uses, info)))
        reused: dict[tuple[int, int], int] = {}
        resolved: dict[tuple[int, int], int] = {}
        for i, (k, bucket) in enumerate(history):
            others: set[int] = set()
            for later, _ in history[i + 1 :]:
                if later == k:
                    reused[bucket] = reused.get(bucket, 0) + 1
                    resolved[bucket] = resolved.get(bucket, 0) + 1
                    break
                others.add(later)
                if len(others) >= remembered:
                    resolved[bucket] = resolved.get(bucket, 0) + 1
                    break
        for uses_b in range(4):
            for end_b in range(-1, 4):
                bucket = (uses_b, end_b)
                want = (reused.get(bucket, 0) + 1) / (resolved.get(bucket, 0) + 2)
                assert reuse.probability(bucket) == want


def test_selective_admission_skips_what_rarely_recurs_and_write_back_takes_all() -> None:
    for mode, expect_tail in (("selective", False), ("write_back", True)):
        policies = Policies("kvtier", mode, MODEL, ghost_capacity=8)  # type: ignore[arg-type]
        for n in range(100):
            policies.accessed(("tail", n), BlockInfo(SIZE, 6, None, 0))
        tail = BlockInfo(SIZE, 6, None, 0)
        assert policies.admission.admit_on_evict(("tail", 500), tail) is expect_tail


def test_ghosts_count_each_lost_reuse_once_and_stay_bounded() -> None:
    ghosts = Ghosts(3)
    for key in range(5):
        ghosts.add(key)
    assert len(ghosts) == 3
    assert not ghosts.take(0)  # pushed out by newer ghosts
    assert ghosts.take(4) and not ghosts.take(4)


def test_sketch_counts_and_ages() -> None:
    sketch = FrequencySketch(width=256, reset_after=100)
    for _ in range(6):
        sketch.add("hot")
    assert sketch.count("hot") >= 6 and sketch.count("cold") <= 1
    for i in range(100):
        sketch.add(("other", i))
    assert sketch.count("hot") <= 3  # halved
