"""CPU per call of the replay's DRAM order (victim, insert, hit): the cost the daemon pays
per eviction decision, measured on the order `kvtier replay` builds.

    PYTHONPATH=. python benchmarks/dram_order_cpu.py \
        ../shared/traces/synthetic_trace.jsonl --dram-capacity 5000

Run it in two checkouts, alternating, to compare orders (BENCHMARKS.md, issue 26).
Prints one JSON line: the order's class, the replay's wall time, calls and µs per call.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.sim.replay import Replay, ReplayConfig, read_trace
from kvtier.sim.transform import transform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--dram-capacity", type=int, default=5000, help="blocks")
    parser.add_argument("--transform", default="", help="as kvtier replay's")
    args = parser.parse_args()
    requests = read_trace(args.trace)
    if args.transform:
        requests = transform(requests, args.transform)
    sim = Replay(ReplayConfig(args.dram_capacity, 4 * args.dram_capacity), requests)
    spent: dict[str, list[float]] = {name: [0, 0.0] for name in ("victim", "insert", "hit")}
    for name, totals in spent.items():
        method: Callable[..., Any] = getattr(sim.dram, name)

        def timed(
            *call: Any, method: Callable[..., Any] = method, totals: list[float] = totals
        ) -> Any:
            start = time.perf_counter()
            result = method(*call)
            totals[1] += time.perf_counter() - start
            totals[0] += 1
            return result

        setattr(sim.dram, name, timed)
    start = time.perf_counter()
    sim.run()
    wall_s = time.perf_counter() - start
    print(
        json.dumps(
            {
                "order": type(sim.dram).__name__,
                "wall_s": round(wall_s, 2),
                **{
                    name: {"calls": int(n), "us_per_call": round(1e6 * s / max(n, 1), 2)}
                    for name, (n, s) in spent.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
