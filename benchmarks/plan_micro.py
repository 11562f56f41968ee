"""In-process cost of the planner's part of a Plan, per overlap mode (no daemon, no socket):
`plan()`, `Plan.block_costs()` and `plan_response()` of the chain plan_ab.py plans (256
blocks of 16 tokens, the first 192 in DRAM), median of 2000 calls each.

    PYTHONPATH=. python benchmarks/plan_micro.py        # this checkout
    PYTHONPATH=/path/to/other/tree python benchmarks/plan_micro.py   # a baseline
"""

from __future__ import annotations

import statistics
import time

from kvtier.index.planner import PlanRequest, plan
from kvtier.server.messages import plan_response
from kvtier.types import OVERLAPS, PrefillCost, TierCost


def request(overlap: str) -> PlanRequest:
    return PlanRequest(
        prompt_tokens=4096,
        tokens_per_block=16,
        kv_bytes_per_token=256,
        cached_tiers=["dram"] * 192 + [None] * 64,
        tier_costs={"dram": TierCost(5e9, 2e-6), "nvme": TierCost(2e9, 1e-4)},
        prefill=PrefillCost(1e-4, 1e-9, 1e-3),
        overlap=overlap,  # type: ignore[arg-type]
        run_latency_s=1e-4,
    )


def main() -> None:
    for overlap in OVERLAPS:
        req = request(overlap)
        stages: dict[str, list[int]] = {"plan": [], "block_costs": [], "plan_response": []}
        for _ in range(2000):
            t0 = time.perf_counter_ns()
            result = plan(req)
            t1 = time.perf_counter_ns()
            costs = result.block_costs()
            t2 = time.perf_counter_ns()
            plan_response(result, costs)
            t3 = time.perf_counter_ns()
            stages["plan"].append(t1 - t0)
            stages["block_costs"].append(t2 - t1)
            stages["plan_response"].append(t3 - t2)
        print(
            f"{overlap:>13}: "
            + "  ".join(f"{k} {statistics.median(v) / 1e3:6.1f} µs" for k, v in stages.items())
        )


if __name__ == "__main__":
    main()
