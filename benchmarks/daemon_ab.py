"""Same-run A/B of the whole daemon path: `kvtier bench daemon` from this checkout against
the same command from a git revision (both daemon and client of that revision), taking
turns, so both see the same drift of a noisy machine.

    python benchmarks/daemon_ab.py --baseline-rev f89d756 [--pairs 5] [--sizes 256KiB,4MiB]
        [--peers none] [--json out.json]

The baseline runs from a temporary `git worktree` of the revision (with PYTHONPATH set
to it, so its daemon subprocess imports the revision's code). For each path and block
size it reports this checkout / baseline for get and put throughput and p50 latency:
the median over the pairs of the ratio within each pair (drift-robust), and the range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _daemon import baseline_tree

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("get_gbps", "put_gbps", "get_p50_us", "put_p50_us")


def bench(tree: Path, args: argparse.Namespace) -> dict[tuple[str, int], dict[str, Any]]:
    cmd = [sys.executable, "-m", "kvtier", "bench", "daemon", "--json"]
    cmd += ["--sizes", args.sizes, "--peers", args.peers, "--rounds", str(args.rounds)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)["results"]
    return {(r["path"], r["block_bytes"]): r for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", required=True)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--sizes", default="256KiB,1MiB,4MiB,16MiB")
    parser.add_argument("--peers", default="none")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-ab-") as scratch,
        baseline_tree(args.baseline_rev, Path(scratch)) as base,
    ):
        pairs = []
        for i in range(args.pairs):
            # Take turns going first: the first run of a pair tends to be the slower.
            order = [("new", ROOT), ("base", base)][:: 1 if i % 2 == 0 else -1]
            runs = {name: bench(tree, args) for name, tree in order}
            pairs.append(runs)
            print(f"pair {i + 1}/{args.pairs} done", file=sys.stderr)
    report = []
    for key in sorted(pairs[0]["new"], key=lambda k: (k[1], k[0])):
        row: dict[str, Any] = {"path": key[0], "block_bytes": key[1]}
        for field in FIELDS:
            ratios = [
                p["new"][key][field] / p["base"][key][field]
                for p in pairs
                if key in p["base"] and p["new"][key].get(field) and p["base"][key].get(field)
            ]
            if ratios:
                row[field] = {
                    "median_ratio": round(statistics.median(ratios), 3),
                    "min": round(min(ratios), 3),
                    "max": round(max(ratios), 3),
                    "new_median": statistics.median(p["new"][key][field] for p in pairs),
                    "base_median": statistics.median(p["base"][key][field] for p in pairs),
                }
        report.append(row)
    print(f"{'path':10} {'block':>8}  " + "  ".join(f"{f:>22}" for f in FIELDS))
    for row in report:
        cells = []
        for field in FIELDS:
            r = row.get(field)
            cells.append(f"{r['median_ratio']:>6.3f} ({r['min']:.2f}-{r['max']:.2f})" if r else "-")
        print(
            f"{row['path']:10} {row['block_bytes'] >> 10:>6}Ki  "
            + "  ".join(f"{c:>22}" for c in cells)
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"baseline": args.baseline_rev, "rows": report}, indent=1))


if __name__ == "__main__":
    main()
