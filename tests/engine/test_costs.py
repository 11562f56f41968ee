"""CostModel without a daemon: how a tier is priced, what a plan remembers, and how a
served block settles it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.costs import CostModel
from kvtier.engine.results import Counters
from kvtier.profiles import MODELS
from kvtier.types import TierCost, TierName

NS = "t|llama3-8b/bf16"
MIB = 1 << 20


def make(threads: int = 4) -> tuple[CostModel, Counters]:
    counters = Counters()
    seeds = {"dram": TierCost(10e9, 2e-5), "nvme": TierCost(1e9, 1e-4)}
    return CostModel(seeds, "llama3-8b", lambda tier: threads, counters), counters


def test_an_nvme_block_costs_its_share_of_the_parallel_read_then_the_dram_copy() -> None:
    model, _ = make(threads=4)
    dram, nvme = TierCost(10e9, 2e-5), TierCost(1e9, 1e-4)
    assert model.path_cost("dram") == dram
    assert model.path_cost("nvme") == nvme.in_parallel(4).then(dram)
    assert model.path_cost("nvme").fetch_s(MIB) > dram.fetch_s(MIB)
    # The policy reads the same figures, refreshed in place.
    assert model.value_costs["nvme"] == model.path_cost("nvme")


def test_a_planned_fetch_is_settled_once_when_served() -> None:
    model, counters = make()
    keys = [bytes([i]) * 16 for i in range(8)]
    plan, (tiers, _, recompute) = model.plan(NS, keys, ["dram"] * 8, 512, 0, 0, "none", 0, 64 * MIB)
    assert plan.fetch_blocks == 8 and tiers == ["dram"] * 8
    assert counters.planned_fetch_blocks == 8
    model.served((NS, keys[3]), TierName.DRAM, 64 * MIB, None)
    assert counters.hits["dram"] == 1
    assert counters.recompute_avoided_s == pytest.approx(recompute[3])
    assert counters.fetch_regret_s == 0.0
    model.served((NS, keys[3]), TierName.DRAM, 64 * MIB, None)  # not planned again
    assert counters.recompute_avoided_s == pytest.approx(recompute[3])
    # A fetch measured slower than the recompute it replaced is regret.
    model.served((NS, keys[4]), TierName.DRAM, 64 * MIB, recompute[4] + 0.5)
    assert counters.fetch_regret_s == pytest.approx(0.5)


def test_a_chain_planned_again_is_settled_again_after_each_serve() -> None:
    """Re-planning one chain with nothing changed leaves `planned` as it is; once one of
    its blocks was served (and settled), the next plan of it expects that fetch again,
    and a plan of another chain between two of the same chain changes nothing of it."""
    model, counters = make()
    keys = [bytes([i]) * 16 for i in range(8)]
    other = [bytes([100 + i]) * 16 for i in range(4)]
    args = (["dram"] * 8, 512, 0, 0, "none", 0, 64 * MIB)
    _, (_, _, recompute) = model.plan(NS, keys, *args)  # type: ignore[arg-type]
    want = {(NS, k): r for k, r in zip(keys, recompute, strict=True)}
    for _ in range(2):
        model.plan(NS, list(keys), *args)  # type: ignore[arg-type]
        assert model.planned == want
    for served in range(1, 4):
        model.served((NS, keys[3]), TierName.DRAM, 64 * MIB, None)
        assert (NS, keys[3]) not in model.planned
        assert counters.recompute_avoided_s == pytest.approx(served * recompute[3])
        model.plan(NS, list(keys), *args)  # type: ignore[arg-type]
        assert model.planned[(NS, keys[3])] == recompute[3]
    model.plan(NS, other, ["dram"] * 4, 512, 0, 0, "none", 0, 64 * MIB)
    model.plan(NS, list(keys), *args)  # type: ignore[arg-type]
    assert {b: model.planned[b] for b in want} == want and len(model.planned) == 12


def test_a_plan_without_kv_bytes_uses_the_first_cached_block_or_the_profile() -> None:
    model, _ = make()
    keys = [b"k" * 16]
    plan, _ = model.plan(NS, keys, ["dram"], 512, 0, 0, "none", 0, None)
    assert plan._req.kv_bytes_per_token == MODELS["llama3-8b"].kv_bytes_per_token
    plan, _ = model.plan(NS, keys, ["dram"], 512, 0, 0, "none", 0, 512 * 1000)
    assert plan._req.kv_bytes_per_token == 1000


def test_engine_fetch_reports_fit_per_block_and_odd_reports_are_ignored() -> None:
    model, _ = make()
    seed = model.paths["dram"].estimate()
    assert model.engine_fetch([MIB, MIB], 0.0, 1.0, 3 * MIB) is None  # more than served
    assert model.engine_fetch([MIB], 0.5, 0.4, MIB) is None  # promotion took it all
    assert model.paths["dram"].estimate() == seed
    for _ in range(40):
        assert model.engine_fetch([MIB, MIB], 0.001, 0.001 + 2 * 1e-3, 2 * MIB) == (
            pytest.approx(2e-3)
        )
    fitted = model.paths["dram"].estimate()
    assert fitted.fetch_s(MIB) == pytest.approx(1e-3, rel=0.05)


def test_prefill_estimates_are_per_tenant_and_model() -> None:
    model, _ = make()
    a = model.prefill_estimator("t1|llama3-8b/bf16")
    assert model.prefill_estimator("t1|llama3-8b/other") is a
    assert model.prefill_estimator("t2|llama3-8b/bf16") is not a
    # An unknown model is priced as the default one (planner.default_model).
    assert model.prefill_estimator("t1|no-such-model/x") is a
    assert model.prefill_estimator("t1|llama3-70b/x") is not a
    assert set(model.estimates()[1]) == {"t1|llama3-8b", "t2|llama3-8b", "t1|llama3-70b"}


def test_a_plan_prices_a_run_as_the_calls_measured_it() -> None:
    """Once leases and promotions have been timed, a Plan's run latency plus its blocks'
    fetch_s is what fetching that run costs, at one block and at sixteen: the model the
    planner decides with, not a separate one."""
    model, _ = make(threads=4)
    size = 2 * MIB

    def dram_s(blocks: int) -> float:  # the call's round trip once, then each copy
        return 200e-6 + blocks * size / 8e9

    def promote_s(blocks: int) -> float:  # reads overlap two at a time, whatever threads
        return 300e-6 + -(-blocks // 2) * (100e-6 + size / 2e9)

    for blocks in (1, 4, 16, 2, 8) * 4:
        model.engine_fetch([size] * blocks, 0.0, dram_s(blocks), blocks * size)
        model.promoted([size] * blocks, promote_s(blocks))
    for tier, want in (("dram", dram_s), ("nvme", lambda m: dram_s(m) + promote_s(m))):
        for blocks in (1, 16):
            keys = [bytes([tier == "dram", i]) * 8 for i in range(blocks)]
            plan, (_, fetch_s, _) = model.plan(
                NS, keys, [tier] * blocks, 16, 0, 0, "none", size // 16, None, "prefix"
            )
            predicted = plan.run_latency_s + sum(fetch_s)
            # Exact for one block; a run that fills its last round of reads is priced up
            # to (1 - 1/s) of one read high (the planner's costs are per block plus once
            # per run, so rounds are spread over blocks): here 0.5 of 8 reads.
            assert want(blocks) <= predicted * (1 + 1e-9)
            assert predicted == pytest.approx(want(blocks), rel=0.05), (tier, blocks)


def _fields(plan: object) -> tuple[object, ...]:
    names = (
        "total_s",
        "fetch_start",
        "fetch_end",
        "recompute_all_s",
        "fetch_all_s",
        "reason",
        "run_latency_s",
    )
    return tuple(getattr(plan, n) for n in names)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("plan"), st.integers(0, 24), st.sampled_from(["none", "layerwise"])),
            st.tuples(st.just("prefill"), st.integers(100, 4000), st.floats(0.01, 2.0)),
            st.tuples(st.just("fetch"), st.integers(1, 8), st.floats(1e-4, 0.05)),
            st.tuples(st.just("nvme"), st.integers(1, 4), st.floats(1e-4, 0.05)),
        ),
        max_size=25,
    )
)
def test_a_remembered_plan_is_the_plan_the_inputs_make_now(
    script: list[tuple[str, int, object]],
) -> None:
    """Plans are remembered by their inputs: whatever was observed between two Plans of a
    chain (a prefill report, a fetch report), the answer equals one made from scratch, and
    each call still counts and remembers its fetches for settlement."""
    model, counters = make()
    keys = [bytes([i]) * 16 for i in range(24)]
    calls = 0
    for op, number, arg in script:
        if op == "plan":
            half = number // 2
            tiers: list[TierName | None] = (
                [TierName.DRAM] * half + [TierName.NVME] * (number - half) + [None] * (24 - number)
            )
            args = (NS, keys, tiers, 16, 0, 0, arg, 0, 64 * 1024)
            plan, costs = model.plan(*args)  # type: ignore[arg-type]
            calls += 1
            model._plans.clear()
            fresh, fresh_costs = model.plan(*args)  # type: ignore[arg-type]
            calls += 1
            assert _fields(plan) == _fields(fresh) and costs == fresh_costs
            again, _ = model.plan(*args)  # type: ignore[arg-type]
            calls += 1
            assert again is fresh  # remembered: the same inputs give the same object
        elif op == "prefill":
            # A burst: the estimators keep their seeds until 8 observations.
            for j in range(8):
                model.prefill_estimator(NS).observe(0, number + 100 * j, float(arg) * (1 + j / 8))  # type: ignore[arg-type]
        elif op == "nvme":  # the NVMe path's own fit: only the tier costs change
            for j in range(8):
                model.observe("nvme", number * MIB * (1 + j % 3), float(arg) * (1 + j % 3))  # type: ignore[arg-type]
        else:
            for j in range(8):
                size = 64 * 1024 * (1 + j % 3)
                model.engine_fetch([size] * number, 0.0, float(arg) * (1 + j % 3), size * number)  # type: ignore[arg-type]
    assert counters.planned_fetch_blocks + counters.planned_recompute_blocks == 24 * calls


def test_runs_read_from_the_directory_are_priced_by_the_calls_clients_reported() -> None:
    """Direct reads cost a call's start once, then per block, and no lease round trip; a
    run that also holds NVMe blocks pays the lease's start for them as well. Hits of a
    reported call teach the per-block path only, not the leased-run fit."""
    model, _ = make(threads=1)
    size = MIB

    def direct_s(blocks: int) -> float:
        return 25e-6 + blocks * (5e-6 + size / 20e9)

    def leased_s(blocks: int) -> float:
        return 300e-6 + blocks * size / 8e9

    for blocks in (1, 4, 16, 2) * 3:
        model.direct_call(blocks, blocks * size, direct_s(blocks))
        model.engine_fetch([size], 0.0, 1e-6, size, runs=False)  # a reported call's hit
        model.engine_fetch([size] * blocks, 0.0, leased_s(blocks), blocks * size)
    model.direct_call(1, size, float("nan"))  # ignored
    assert model.dram_runs.observations == 12  # the hits did not join the leased fit
    for blocks in (1, 3, 16):
        keys = [bytes([blocks, i]) * 8 for i in range(blocks)]
        plan, (_, fetch_s, _) = model.plan(
            NS, keys, ["dram"] * blocks, 16, 0, 0, "none", size // 16, None, "prefix"
        )
        assert plan.run_latency_s + sum(fetch_s) == pytest.approx(direct_s(blocks), rel=0.02)
    # One DRAM block then one NVMe block: a direct read, then a lease with its promotion.
    costs, run_s = model.plan_costs(size, nvme_in_run=True, dram_in_run=True)
    dram_only, direct_run_s = model.plan_costs(size, nvme_in_run=False, dram_in_run=True)
    assert dram_only["dram"] == costs["dram"]
    assert run_s - direct_run_s == pytest.approx(300e-6, rel=0.05)  # the lease's start
    assert costs["nvme"].fetch_s(size) > size / 8e9  # its copy out of the lease
