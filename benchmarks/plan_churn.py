"""`Client.plan` of one 256-block chain (192 cached) while other blocks come and go, this
checkout against a git revision: each plan is preceded by nothing ("none"), a put of a
new 4 KiB block ("put": a block indexed, the chain's misses probed again) or a put and a
delete of the block put before ("putdel": a block taken out too, its hits checked
again). Each run starts its own daemon in a fresh process; trees alternate run by run.

    python benchmarks/plan_churn.py --baseline-rev f6d35d7 [--runs 2] [--plans 2000]

Prints each run's plan wall p50 / p99 (the put and delete are not timed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _daemon import PLAN_CHAIN_WORKER, baseline_tree

ROOT = Path(__file__).resolve().parent.parent

_WORKER = (
    r"""
import sys
mode, n, transport = sys.argv[1], int(sys.argv[2]), "uds"
"""
    + PLAN_CHAIN_WORKER
    + r"""
    other = kvtier.chain_keys(ns, [[10000 + i] for i in range(n)])
    walls = []
    for i in range(n):
        if mode in ("put", "putdel"):
            client.put(ns, other[i], b"y" * 4096)
        if mode == "putdel" and i:
            client.delete(ns, other[i - 1])
        started = time.perf_counter()
        client.plan(ns, chain, 16)
        walls.append(time.perf_counter() - started)
    walls.sort()
    print(statistics.median(walls), walls[int(0.99 * (len(walls) - 1))])
"""
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", required=True)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--plans", type=int, default=2000)
    parser.add_argument("--modes", default="none,put,putdel")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-ab-") as scratch,
        baseline_tree(args.baseline_rev, Path(scratch)) as base,
    ):
        trees = {"this": ROOT, "baseline": base}
        for run in range(args.runs):
            for mode in args.modes.split(","):
                names = list(trees)[:: 1 if run % 2 == 0 else -1]
                for name in names:
                    out = subprocess.run(
                        [sys.executable, "-c", _WORKER, mode, str(args.plans)],
                        cwd=trees[name],
                        env={**os.environ, "PYTHONPATH": str(trees[name])},
                        capture_output=True,
                        text=True,
                        check=True,
                    ).stdout.split()
                    p50, p99 = (float(x) * 1e6 for x in out[-2:])
                    print(f"run {run} {mode:>6} {name:>8}: p50 {p50:6.0f} µs  p99 {p99:6.0f} µs")


if __name__ == "__main__":
    main()
