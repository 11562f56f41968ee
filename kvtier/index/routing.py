"""Prefix-aware routing: send a request to the node where it will start generating first.

For each node: the time before that node can start the request (its queued prefill work),
plus the planner's best total for the prompt there — fetch what that node holds (in
whatever tier, at that node's measured costs), recompute the rest (at its engine's
measured prefill cost). The node with the smallest sum wins. This is the planner's cost
model applied per node (kvtier.index.planner), so a node holding the prefix on a slow or
throttled tier is not preferred over an idle node that recomputes faster, and a busy
node's cache is weighed against its queue rather than pinning the conversation to it.

The sum is the request's own time to first token. Under load the choice also costs
everyone else: prefill work added to a node delays the requests that arrive behind it
while it is busy. With the node's engine busy a fraction u of the time, a second of work
there holds up the queue for about 1 / (1 - u) seconds (the busy period it starts or
extends, as in an M/G/1 queue), so nodes are ranked by

    wait + total / (1 - u)

which is the plain TTFT on an idle fleet and, on a loaded one, weighs the prefill a node's
cache saves against its queue — rather than recomputing a long cached prefix on an idle
node for a slightly earlier first token while the fleet pays for it (measured on the
shared trace: BENCHMARKS.md, fleet replay). `u` is capped at MAX_UTILIZATION.

Each node's residency comes from its events (kvtier.client.events.BlockIndex.chain_tiers)
or, in a simulation, from its catalog.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.index.planner import Overlap, Plan, PlanRequest, PrefillCost, TierCost, plan

MAX_UTILIZATION = 0.9  # a second of work counts at most 10 seconds


@dataclass(frozen=True, slots=True)
class NodeState:
    """What a router knows of one node when a request arrives."""

    name: str
    wait_s: float  # before this node could start the request (queued prefill work)
    tier_costs: dict[str, TierCost]  # fetch cost from each of its tiers into its engine
    prefill: PrefillCost  # its engine's prefill cost for the request's model
    cached_tiers: Callable[[Sequence[bytes]], Sequence[str | None]]  # per key: tier or None
    load_s: float = 0.0  # prefill work it has done lately: breaks ties (cold prompts spread)
    utilization: float = 0.0  # its engine's busy fraction lately (0..1): see the module


@dataclass(frozen=True, slots=True)
class Choice:
    node: str
    ttft_s: float  # estimated: wait + the plan's total
    plan: Plan
    ttft_by_node: dict[str, float]


def estimate(
    node: NodeState,
    keys: Sequence[bytes],
    prompt_tokens: int,
    tokens_per_block: int,
    kv_bytes_per_token: int,
    overlap: Overlap = "none",
) -> tuple[float, Plan]:
    """(estimated time to first token on `node`, its plan for the prompt)."""
    result = plan(
        PlanRequest(
            prompt_tokens=prompt_tokens,
            tokens_per_block=tokens_per_block,
            kv_bytes_per_token=kv_bytes_per_token,
            cached_tiers=node.cached_tiers(keys),
            tier_costs=node.tier_costs,
            prefill=node.prefill,
            overlap=overlap,
        )
    )
    return max(node.wait_s, 0.0) + result.total_s, result


def choose_node(
    nodes: Sequence[NodeState],
    keys: Sequence[bytes],
    prompt_tokens: int,
    tokens_per_block: int,
    kv_bytes_per_token: int,
    overlap: Overlap = "none",
) -> Choice:
    """The node with the smallest wait + total / (1 - utilization) (see the module; ties:
    the shorter wait, then the lighter load, then the first listed)."""
    if not nodes:
        raise ValueError("no nodes to route to")
    best: tuple[float, float, float, int] | None = None
    plans: dict[str, tuple[float, Plan]] = {}
    for order, node in enumerate(nodes):
        ttft_s, node_plan = estimate(
            node, keys, prompt_tokens, tokens_per_block, kv_bytes_per_token, overlap
        )
        plans[node.name] = (ttft_s, node_plan)
        busy = min(max(node.utilization, 0.0), MAX_UTILIZATION)
        cost_s = max(node.wait_s, 0.0) + node_plan.total_s / (1 - busy)
        rank = (cost_s, node.wait_s, node.load_s, order)
        if best is None or rank < best:
            best = rank
    assert best is not None
    chosen = nodes[best[3]]
    return Choice(
        node=chosen.name,
        ttft_s=plans[chosen.name][0],
        plan=plans[chosen.name][1],
        ttft_by_node={name: t for name, (t, _) in plans.items()},
    )
