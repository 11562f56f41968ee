"""Same-run A/B of the planner's fetch-time honesty on the real tiers: this checkout's
estimators against a git revision's, each measured by this checkout's
`kvtier/bench/real_tiers.py` (runs of 1/4/16 blocks x 256 KiB/1 MiB/4 MiB from a real
daemon's DRAM, then NVMe tier), taking turns round by round.

    python benchmarks/real_tiers_ab.py --baseline-rev main [--rounds 3] [--runs 90]
        [--json out.json]

Per tier and tree (and apart, the held-out sizes and depths each round fetches after the
table's runs): |predicted - measured| / measured p50 and p90 per round, and the
same-run noise floor (each run "predicted" by its own cell's median measured time, in
hindsight). A tree whose client has no `PlanResult.run_latency_s` is scored on its
blocks' `fetch_s` alone, which is what its planner weighed. Figures: medians over rounds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _daemon import baseline_tree

ROOT = Path(__file__).resolve().parent.parent
FIGURES = (
    "median_abs_error",
    "p90_abs_error",
    "hindsight_cell_median_p50_abs_error",
    "hindsight_cell_median_p90_abs_error",
)

# Run with PYTHONPATH=<tree>:<dir holding this checkout's real_tiers.py as a module>: the
# tree's client and daemon, this checkout's measurement.
_WORKER = r"""
import json, sys
from pathlib import Path
import real_tiers_measure
print(json.dumps(real_tiers_measure.check_real_tiers(int(sys.argv[1]), Path(sys.argv[2]))))
"""


def one_round(tree: Path, measure_dir: Path, runs: int, scratch: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, str(runs), str(scratch)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": f"{tree}:{measure_dir}"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"round in {tree} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=90, help="fetched runs per tier a round")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-rt-ab-") as scratch,
        baseline_tree(args.baseline_rev, Path(scratch)) as base,
    ):
        measure_dir = Path(scratch) / "measure"
        measure_dir.mkdir()
        shutil.copy(ROOT / "kvtier/bench/real_tiers.py", measure_dir / "real_tiers_measure.py")
        trees = {"this": ROOT, "baseline": base}
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for i in range(args.rounds):
            for name in list(trees)[:: 1 if i % 2 == 0 else -1]:  # take turns going first
                rounds[name].append(one_round(trees[name], measure_dir, args.runs, Path(scratch)))
                print(f"round {i + 1} {name} done", file=sys.stderr, flush=True)
    report: dict[str, Any] = {"rounds": rounds, "median_over_rounds": {}}
    for tier, part in itertools.product(("dram", "nvme"), ("table", "held_out")):
        for name in trees:

            def of(r: dict[str, Any], p: str = part, t: str = tier) -> dict[str, Any]:
                figures: dict[str, Any] = r[t] if p == "table" else r[t].get(p, {})
                return figures

            if not all(of(r) for r in rounds[name]):
                continue  # a round with no held-out runs (fewer than 18 runs)
            figures = {f: statistics.median(of(r)[f] for r in rounds[name]) for f in FIGURES}
            report["median_over_rounds"][f"{tier}/{part}/{name}"] = figures
            print(
                f"{tier:>4} {part:>8} {name:>8}: p50 {figures['median_abs_error']:6.1%}  p90 "
                f"{figures['p90_abs_error']:6.1%}   (noise floor p50 "
                f"{figures['hindsight_cell_median_p50_abs_error']:5.1%}, p90 "
                f"{figures['hindsight_cell_median_p90_abs_error']:5.1%}); per round p90: "
                + ", ".join(f"{of(r)['p90_abs_error']:.0%}" for r in rounds[name])
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
