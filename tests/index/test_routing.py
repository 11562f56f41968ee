"""Prefix-aware routing: the node where the request starts generating first."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index.planner import PrefillCost, TierCost
from kvtier.index.routing import NodeState, choose_node, estimate

PREFILL = PrefillCost(4e-5, 1.3e-9)  # ~21 ms for the first 512-token block
FAST = {"dram": TierCost(50e9, 10e-6), "nvme": TierCost(7e9, 100e-6)}
KEYS = [bytes([i]) for i in range(16)]
TPB, KV = 512, 128 << 10  # 64 MiB blocks


def holding(blocks: int, tier: str = "dram") -> object:
    def tiers(keys: Sequence[bytes]) -> list[str | None]:
        return [tier if i < blocks else None for i in range(len(keys))]

    return tiers


def node(name: str, wait_s: float = 0.0, blocks: int = 0, tier: str = "dram", costs=FAST):  # type: ignore[no-untyped-def]
    return NodeState(name, wait_s, costs, PREFILL, holding(blocks, tier))  # type: ignore[arg-type]


def route(*nodes: NodeState) -> str:
    return choose_node(list(nodes), KEYS, len(KEYS) * TPB, TPB, KV).node


def test_the_node_holding_the_prefix_wins_when_both_are_idle() -> None:
    assert route(node("cold"), node("warm", blocks=12)) == "warm"


def test_a_busy_node_loses_its_cache_advantage_to_an_idle_one() -> None:
    recompute_all_s, _ = estimate(node("x"), KEYS, len(KEYS) * TPB, TPB, KV)
    assert route(node("warm", wait_s=2 * recompute_all_s, blocks=16), node("idle")) == "idle"
    # ... but a short queue is worth waiting for
    assert route(node("warm", wait_s=0.05 * recompute_all_s, blocks=16), node("idle")) == "warm"


def test_a_prefix_on_a_tier_slower_than_recompute_is_not_a_reason_to_go_there() -> None:
    slow = {"dram": TierCost(1e8, 0.5), "nvme": TierCost(1e8, 0.5)}  # 0.5 s + 0.64 s a block
    choice = choose_node(
        [node("slow-cache", wait_s=0.01, blocks=16, costs=slow), node("idle")],
        KEYS,
        len(KEYS) * TPB,
        TPB,
        KV,
    )
    assert choice.node == "idle" and choice.plan.fetch_blocks == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 10), st.integers(0, 16), st.sampled_from(["dram", "nvme"])),
        min_size=1,
        max_size=6,
    )
)
def test_the_choice_is_the_smallest_estimate(specs: list[tuple[float, int, str]]) -> None:
    nodes = [node(str(i), w, b, t) for i, (w, b, t) in enumerate(specs)]
    choice = choose_node(nodes, KEYS, len(KEYS) * TPB, TPB, KV)
    estimates = {n.name: estimate(n, KEYS, len(KEYS) * TPB, TPB, KV)[0] for n in nodes}
    assert choice.ttft_by_node == estimates
    assert choice.ttft_s == min(estimates.values()) == estimates[choice.node]


def test_on_a_loaded_fleet_the_work_a_cache_saves_outweighs_a_slightly_earlier_start() -> None:
    recompute_all_s, _ = estimate(node("x"), KEYS, len(KEYS) * TPB, TPB, KV)
    warm_total_s = estimate(node("w", blocks=16), KEYS, len(KEYS) * TPB, TPB, KV)[0]
    # The warm node's queue makes it a little later than recomputing on the idle node...
    wait_s = recompute_all_s - warm_total_s + 0.02
    idle_fleet = [node("warm", wait_s=wait_s, blocks=16), node("idle")]
    assert route(*idle_fleet) == "idle"
    # ... which is the right call on an idle fleet, not on one whose engines are 80 % busy:
    # recomputing there delays everyone queued behind it by ~5x its own length.
    busy = [
        NodeState(n.name, n.wait_s, n.tier_costs, n.prefill, n.cached_tiers, utilization=0.8)
        for n in idle_fleet
    ]
    assert route(*busy) == "warm"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 10), st.integers(0, 16), st.floats(0, 1)),
        min_size=1,
        max_size=6,
    )
)
def test_the_choice_minimises_wait_plus_work_scaled_by_utilization(
    specs: list[tuple[float, int, float]],
) -> None:
    nodes = [
        NodeState(str(i), w, FAST, PREFILL, holding(b), utilization=u)  # type: ignore[arg-type]
        for i, (w, b, u) in enumerate(specs)
    ]
    choice = choose_node(nodes, KEYS, len(KEYS) * TPB, TPB, KV)

    def cost(n: NodeState) -> float:
        total_s = estimate(n, KEYS, len(KEYS) * TPB, TPB, KV)[1].total_s
        return n.wait_s + total_s / (1 - min(n.utilization, 0.9))

    assert cost(nodes[int(choice.node)]) <= min(cost(n) for n in nodes) + 1e-12
