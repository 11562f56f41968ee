"""Same-run A/B of `Client.plan` on a 256-block chain: this checkout against a git
revision, each with its own real daemon, taking turns round by round.

    python benchmarks/plan_ab.py --baseline-rev 890b437 [--rounds 8] [--plans 200]
        [--overlaps none,layerwise,bidirectional] [--transports uds,tcp] [--json out.json]

The chain is the one an engine re-plans every scheduler step while a prompt waits: 256
blocks of 16 tokens, the first 192 cached in DRAM, the model's prefill estimate warmed by
20 ReportPrefill calls, planned as `Client.plan` does: on "uds" through the attached session
(the zero-copy socket), on "tcp" over gRPC (a client without the shared arena). Per
transport and overlap mode it reports the wall-clock p50 and p99 of a plan (each over a
round) and the CPU time per plan of the client and of the daemon (from the daemon
process's own counters):
on a loaded machine the wall clock mostly measures the scheduler, the CPU times do not.
Each figure is the median over rounds; the ratio is this checkout / baseline.
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

from _daemon import PLAN_CHAIN_WORKER, baseline_tree

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("wall_p50_s", "client_cpu_s", "daemon_cpu_s", "wall_p99_s")

# Runs in a subprocess with PYTHONPATH set to one tree: its client and (through
# kvtier.bench.daemon) its daemon. One line per round on stdin -> one line of figures.
_WORKER = (
    r"""
import psutil, sys
overlap, plans, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3]
"""
    + PLAN_CHAIN_WORKER
    + r"""
    for _ in range(100):
        client.plan(ns, chain, 16, overlap=overlap)
    served_by = psutil.Process().children()[0]
    print("ready", flush=True)
    for _ in sys.stdin:
        walls = []
        cpu0, d0 = time.process_time(), served_by.cpu_times()
        for _ in range(plans):
            started = time.perf_counter()
            client.plan(ns, chain, 16, overlap=overlap)
            walls.append(time.perf_counter() - started)
        cpu1, d1 = time.process_time(), served_by.cpu_times()
        daemon_cpu = (d1.user + d1.system - d0.user - d0.system) / plans
        p99 = sorted(walls)[int(0.99 * (len(walls) - 1))]
        print(statistics.median(walls), (cpu1 - cpu0) / plans, daemon_cpu, p99, flush=True)
"""
)


def measure(
    trees: dict[str, Path], overlap: str, transport: str, args: argparse.Namespace
) -> dict[str, Any]:
    workers = {
        name: subprocess.Popen(
            [sys.executable, "-c", _WORKER, overlap, str(args.plans), transport],
            cwd=tree,  # `-c` puts the working directory first on sys.path
            env={**os.environ, "PYTHONPATH": str(tree)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, tree in trees.items()
    }
    rounds: dict[str, list[list[float]]] = {name: [] for name in trees}
    try:
        for worker in workers.values():
            assert worker.stdout is not None
            if worker.stdout.readline().strip() != "ready":
                raise SystemExit("a benchmark worker did not start its daemon")
        for i in range(args.rounds):
            names = list(workers)[:: 1 if i % 2 == 0 else -1]  # take turns going first
            for name in names:
                worker = workers[name]
                assert worker.stdin is not None and worker.stdout is not None
                worker.stdin.write("go\n")
                worker.stdin.flush()
                rounds[name].append([float(x) for x in worker.stdout.readline().split()])
    finally:
        for worker in workers.values():
            assert worker.stdin is not None
            worker.stdin.close()
            worker.wait(60)
    row: dict[str, Any] = {"overlap": overlap, "transport": transport}
    for col, field in enumerate(FIELDS):
        this, base = (statistics.median(r[col] for r in rounds[n]) for n in ("this", "baseline"))
        row[field] = {"this": this, "baseline": base, "ratio": round(this / base, 3)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", required=True)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--plans", type=int, default=200, help="plans per round")
    parser.add_argument("--overlaps", default="none,layerwise,bidirectional")
    parser.add_argument(
        "--transports", default="uds", help="uds (the session socket), tcp (gRPC), or both"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-ab-") as scratch,
        baseline_tree(args.baseline_rev, Path(scratch)) as base,
    ):
        trees = {"this": ROOT, "baseline": base}
        report = [
            measure(trees, overlap, transport, args)
            for transport in args.transports.split(",")
            for overlap in args.overlaps.split(",")
        ]
    for row in report:
        for field in FIELDS:
            f = row[field]
            print(
                f"{row['transport']:>3} {row['overlap']:>13} {field:>13}: "
                f"baseline {f['baseline'] * 1e6:6.0f} µs -> "
                f"this {f['this'] * 1e6:6.0f} µs  ({f['ratio']:.2f}x)"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
