"""The noise floor of `kvtier bench nvme --vs-fio` on a drive: fio against itself.

Runs fio's equivalent job of a `kvtier bench nvme` command line twice per round, back to
back, for --rounds rounds, and reports what `--vs-fio --repeat N` would report had the
tool been fio: the paired ratio (first / second of each pair), its median and 95 %
confidence interval. On a quiet drive the median sits near 1.0 with a narrow interval; a
VM's virtual disk shows how far a ratio can stray with no tool difference at all.

    python benchmarks/fio_against_itself.py --rounds 8 -- \\
        --directory /mnt/nvme0 --size 512M --bs 1M --rw read --iodepth 8 --direct 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from kvtier.bench import nvme
from kvtier.bench.results import totals
from kvtier.bench.stats import median_ci


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="kvtier bench nvme flags")
    args = parser.parse_args()
    flags = [a for a in args.bench_args if a != "--"]
    job = nvme._parse(flags)
    direction = "read" if job.rw in ("read", "randread") else "write"
    pairs: list[tuple[float, float]] = []
    for _ in range(args.rounds):
        first = totals(nvme._fio_run(job), direction)[0]
        second = totals(nvme._fio_run(job), direction)[0]
        pairs.append((first, second))
    ratios = [a / b for a, b in pairs]
    ci = median_ci(ratios)
    out = {
        "job": flags,
        "direction": direction,
        "bw_bytes": [x for pair in pairs for x in pair],
        "paired_ratios": [round(r, 4) for r in ratios],
        "paired_median": round(statistics.median(ratios), 4),
        "paired_median_ci95": [round(x, 4) for x in ci] if ci else None,
        "first_slower_in": sum(r < 1 for r in ratios),
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
