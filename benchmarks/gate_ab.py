"""Same-run A/B of the polling gate (kvtier/hostload.py): puts through a real daemon from
this checkout against a git revision (daemon and client of that revision), taking turns,
with `--hogs` CPU-bound processes running through the whole run (so the host's CPU
pressure and load average have settled before the first measured round).

    python benchmarks/gate_ab.py --baseline-rev 4041227 --hogs 1 [--rounds 4] [--seconds 10]

Per size: each side's put p50 and mean (µs, medians over the rounds), this / baseline
(median of the per-round ratios), and the share of the client's looks that judged the
host busy (polling off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _daemon import baseline_tree

ROOT = Path(__file__).resolve().parent.parent

# Runs in a subprocess with PYTHONPATH naming the tree measured (daemon and client both).
WORKER = r"""
import json, os, statistics, sys, tempfile, time
from pathlib import Path
import kvtier
from kvtier import hostload
from kvtier.bench.daemon import daemon

sizes = [int(s) for s in sys.argv[1].split(",")]
warm_s, seconds = float(sys.argv[2]), float(sys.argv[3])
out = {}
with (
    tempfile.TemporaryDirectory(prefix="kvtier-gate-") as tmp,
    daemon(Path(tmp), "uds", 256 << 20) as target,
    kvtier.Client(target) as client,
):
    client.wait_ready()
    for size in sizes:
        data = os.urandom(size)
        times_s, looks, busy = [], 0, 0
        began = time.monotonic()
        i = 0
        while time.monotonic() - began < warm_s + seconds:
            started = time.perf_counter()
            client.put_from("bench", f"k{i % 64}", data, overwrite=True)
            took = time.perf_counter() - started
            i += 1
            if time.monotonic() - began >= warm_s:
                times_s.append(took)
                if i % 50 == 0:
                    looks += 1
                    busy += hostload.host_busy()
        out[size] = {
            "p50_us": statistics.median(times_s) * 1e6,
            "mean_us": statistics.mean(times_s) * 1e6,
            "calls": len(times_s),
            "busy_share": busy / max(looks, 1),
        }
print(json.dumps(out))
"""


def run(tree: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-c", WORKER, args.sizes, str(args.warm_s), str(args.seconds)]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", required=True)
    parser.add_argument("--hogs", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warm-s", type=float, default=3.0)
    parser.add_argument("--settle-s", type=float, default=30.0, help="hogs alone first")
    parser.add_argument("--sizes", default="4096,262144")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        with (
            tempfile.TemporaryDirectory(prefix="kvtier-ab-") as scratch,
            baseline_tree(args.baseline_rev, Path(scratch)) as base,
        ):
            if hogs:
                time.sleep(args.settle_s)
            rounds = []
            for i in range(args.rounds):
                order = [("new", ROOT), ("base", base)][:: 1 if i % 2 == 0 else -1]
                rounds.append({name: run(tree, args) for name, tree in order})
                print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for hog in hogs:
            hog.kill()
    report = {}
    for size in args.sizes.split(","):
        row: dict[str, float] = {}
        for field in ("p50_us", "mean_us", "busy_share"):
            for side in ("new", "base"):
                row[f"{side}_{field}"] = statistics.median(r[side][size][field] for r in rounds)
        for field in ("p50_us", "mean_us"):
            row[f"{field}_ratio"] = statistics.median(
                r["new"][size][field] / r["base"][size][field] for r in rounds
            )
        report[size] = row
    print(f"hogs {args.hogs}, {args.rounds} rounds of {args.seconds:.0f} s a side")
    print(f"{'size':>8} {'p50 new/base us':>18} {'ratio':>6} {'mean new/base us':>18} "
          f"{'ratio':>6} {'busy new/base':>14}")  # fmt: skip
    for size, row in report.items():
        p50 = f"{row['new_p50_us']:>8.0f}/{row['base_p50_us']:<9.0f}"
        mean = f"{row['new_mean_us']:>8.0f}/{row['base_mean_us']:<9.0f}"
        busy = f"{row['new_busy_share']:>6.2f}/{row['base_busy_share']:<6.2f}"
        print(
            f"{size:>8} {p50} {row['p50_us_ratio']:>6.2f} {mean} "
            f"{row['mean_us_ratio']:>6.2f} {busy}"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "rounds": rounds,
                                         "report": report}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
