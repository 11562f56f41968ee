#!/usr/bin/env python3
"""The `kvtier bench nvme --vs-fio` grid of the benchmark issue, as a markdown table.

    python scripts/bench_nvme_grid.py --directory /mnt/nvme0 [--size 512M] [--repeat 3]
        [--modes raw,tier] [--ioengine libaio|psync]

Runs sequential read and write at --bs 1M and 4M, --iodepth 1 and 8, --direct 1, in
--mode raw and --mode tier, each against fio's equivalent job (libaio) in the same
invocation, alternating runs (--repeat, taking turns going first) and comparing medians;
the paired ratio's 95 % confidence interval needs --repeat 6 or more.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--directory", required=True)
    parser.add_argument("--size", default="512M")
    parser.add_argument("--repeat", default="3")
    parser.add_argument("--modes", default="raw,tier", help="comma-separated: raw, tier")
    parser.add_argument("--ioengine", help="raw mode's engine (default: the tool's choice)")
    args = parser.parse_args()
    print(
        "| mode | rw | bs | iodepth | kvtier-bench MB/s | fio MB/s | ratio | paired ratio "
        "| 95% CI | p50 µs (kvtier/fio) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for rw in ("read", "write"):
            for bs in ("1M", "4M"):
                for depth in ("1", "8"):
                    flags = (
                        f"--size {args.size} --bs {bs} --rw {rw} --iodepth {depth} --direct 1 "
                        f"--mode {mode} --vs-fio --repeat {args.repeat} --output-format json"
                    )
                    if mode == "raw" and args.ioengine:
                        flags += f" --ioengine {args.ioengine}"
                    out = subprocess.run(
                        [
                            sys.executable,
                            "-m",
                            "kvtier",
                            "bench",
                            "nvme",
                            "--directory",
                            args.directory,
                            *flags.split(),
                        ],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    c = json.loads(out.stdout)["vs_fio"][rw]
                    ci = c.get("paired_bw_ratio_ci95")
                    print(
                        f"| {mode} | {rw} | {bs} | {depth} | {c['kvtier_bw_bytes'] / 1e6:.0f} | "
                        f"{c['fio_bw_bytes'] / 1e6:.0f} | {c['bw_ratio']:.2f} | "
                        f"{c.get('paired_bw_ratio', c['bw_ratio']):.2f} | "
                        f"{f'{ci[0]:.2f}–{ci[1]:.2f}' if ci else '-'} | "
                        f"{c['kvtier_clat_p50_ns'] / 1e3:.0f} / {c['fio_clat_p50_ns'] / 1e3:.0f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
