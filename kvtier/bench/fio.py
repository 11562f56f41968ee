"""fio's equivalent of a `kvtier bench nvme` run (`--vs-fio`), and how the two compare."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from kvtier.bench.results import BenchError, percentile_key, totals
from kvtier.bench.stats import median_ci


def fio_command(args: argparse.Namespace, directory: Path) -> list[str]:
    cmd = [
        "fio",
        "--name=kvtier-vs-fio",
        f"--directory={directory}",
        f"--size={args.size}",
        f"--bs={args.bs}",
        f"--iodepth={args.iodepth}",
        f"--numjobs={args.numjobs}",
        f"--rw={args.rw}",
        f"--rwmixread={args.rwmixread}",
        f"--direct={int(args.direct)}",
        "--ioengine=libaio",
        "--group_reporting",
        "--output-format=json",
    ]
    if args.runtime:
        cmd.append(f"--runtime={args.runtime}")
    if args.time_based:
        cmd.append("--time_based")
    return cmd


def run_fio(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    if shutil.which("fio") is None:
        raise BenchError("--vs-fio needs fio on PATH (Debian: apt-get install fio)")
    out = subprocess.run(
        fio_command(args, directory),
        capture_output=True,
        text=True,
        check=False,
        timeout=max(600, 10 * (args.runtime or 60)),
    )
    if out.returncode:
        raise BenchError(f"fio failed: {out.stderr.strip()[-400:]}")
    start = out.stdout.find("{")
    doc: dict[str, Any] = json.loads(out.stdout[start:])
    return doc


def comparison(
    ours: dict[str, Any],
    fio: dict[str, Any],
    pairs: dict[str, list[tuple[float, float]]] | None = None,
) -> dict[str, Any]:
    """Ours against fio's: the median runs' bandwidths and their ratio; with `pairs` (per
    direction, (ours, fio) bandwidth of each alternation) also the median of the pairs'
    ratios, which a disk drifting between alternations moves less: each pair ran back to
    back; from 6 pairs on, its 95 % confidence interval, which says whether the drive's
    noise leaves the comparison conclusive."""
    out: dict[str, Any] = {}
    for direction in ("read", "write"):
        bw, ios = totals(ours, direction)
        fio_bw, fio_ios = totals(fio, direction)
        if ios or fio_ios:
            fio_p50 = (
                fio["jobs"][0][direction]["clat_ns"]
                .get("percentile", {})
                .get(percentile_key(50.0), 0)
            )
            our_p50 = ours["jobs"][0][direction]["clat_ns"]["percentile"][percentile_key(50.0)]
            out[direction] = {
                "kvtier_bw_bytes": bw,
                "fio_bw_bytes": fio_bw,
                "bw_ratio": round(bw / fio_bw, 4) if fio_bw else None,
                "kvtier_clat_p50_ns": our_p50,
                "fio_clat_p50_ns": fio_p50,
            }
            paired = [a / b for a, b in (pairs or {}).get(direction, []) if b]
            if paired:
                out[direction]["paired_bw_ratio"] = round(statistics.median(paired), 4)
                ci = median_ci(paired)
                if ci is not None:
                    out[direction]["paired_bw_ratio_ci95"] = [round(x, 4) for x in ci]
    return out


def comparison_text(cmp: dict[str, Any]) -> str:
    lines = ["", f"{'':6} {'kvtier-bench':>14} {'fio':>14} {'ratio':>7}"]
    for direction, c in cmp.items():
        ratio = f"{c['bw_ratio']:.3f}" if c["bw_ratio"] is not None else "-"
        paired = f"  (paired: {c['paired_bw_ratio']:.3f}" if "paired_bw_ratio" in c else ""
        if "paired_bw_ratio_ci95" in c:
            low, high = c["paired_bw_ratio_ci95"]
            paired += f", 95% CI {low:.2f}-{high:.2f}"
        paired += ")" if paired else ""
        lines.append(
            f"{direction:6} {c['kvtier_bw_bytes'] / 1e6:>10.0f} MB/s "
            f"{c['fio_bw_bytes'] / 1e6:>9.0f} MB/s {ratio:>7}{paired}"
        )
        lines.append(
            f"{'p50':>6} {c['kvtier_clat_p50_ns'] / 1e3:>11.0f} us "
            f"{c['fio_clat_p50_ns'] / 1e3:>10.0f} us"
        )
    return "\n".join(lines) + "\n"
