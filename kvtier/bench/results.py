"""What a `kvtier bench nvme` run measured, laid out as fio lays out its own: the JSON
document (`jobs[].read|write.{io_bytes,bw_bytes,iops,runtime,clat_ns.percentile}` under the
top key "kvtier-bench version"), fio's text report, and the `--plot` figure.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvtier
from kvtier.sizes import human_size


class BenchError(Exception):
    """A refusal with a message that says what to change."""


# fio's default completion-latency percentiles, and its key format.
PERCENTILES = (
    1.0,
    5.0,
    10.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    70.0,
    80.0,
    90.0,
    95.0,
    99.0,
    99.5,
    99.9,
    99.95,
    99.99,
)


def percentile_key(p: float) -> str:
    return f"{p:f}"


@dataclass(slots=True)
class Direction:
    """Completed I/Os of one direction (read or write) of a job."""

    clat_ns: list[int] = field(default_factory=list)
    io_bytes: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes)

    def record(self, started_ns: int, ended_ns: int, size: int, t0_ns: int) -> None:
        self.clat_ns.append(ended_ns - started_ns)
        self.io_bytes += size
        self.timeline.append(((ended_ns - t0_ns) / 1e9, size))

    def to_fio(self, runtime_s: float) -> dict[str, Any]:
        lat = sorted(self.clat_ns)
        n = len(lat)
        pct = {
            percentile_key(p): (lat[min(n - 1, math.ceil(p / 100 * n) - 1)] if n else 0)
            for p in PERCENTILES
        }
        clat = {
            "min": lat[0] if n else 0,
            "max": lat[-1] if n else 0,
            "mean": statistics.fmean(lat) if n else 0.0,
            "stddev": statistics.pstdev(lat) if n > 1 else 0.0,
            "N": n,
            "percentile": pct,
        }
        bw_bytes = int(self.io_bytes / runtime_s) if runtime_s > 0 and n else 0
        return {
            "io_bytes": self.io_bytes,
            "io_kbytes": self.io_bytes // 1024,
            "bw_bytes": bw_bytes,
            "bw": bw_bytes // 1024,
            "iops": n / runtime_s if runtime_s > 0 else 0.0,
            "runtime": round(runtime_s * 1000) if n else 0,
            "total_ios": n,
            "clat_ns": clat,
            "lat_ns": dict(clat),
        }


@dataclass(slots=True)
class Job:
    index: int
    args: argparse.Namespace
    path: Path  # file (raw) or directory (tier)
    read: Direction = field(default_factory=Direction)
    write: Direction = field(default_factory=Direction)
    runtime_s: float = 0.0
    error: str = ""


def job_options(args: argparse.Namespace) -> dict[str, str]:
    return {
        "rw": args.rw,
        "bs": str(args.bs),
        "size": str(args.size),
        "iodepth": str(args.iodepth),
        "numjobs": str(args.numjobs),
        "direct": str(int(args.direct)),
        "rwmixread": str(args.rwmixread),
        "runtime": str(args.runtime or 0),
        "time_based": str(int(args.time_based)),
        "mode": args.mode,
        "pattern": args.pattern,
    }


def report(args: argparse.Namespace, jobs: list[Job]) -> dict[str, Any]:
    """The run as a fio-like JSON document."""
    return {
        "kvtier-bench version": f"kvtier-{kvtier.__version__}",
        "timestamp": int(time.time()),
        "time": time.strftime("%a %b %d %H:%M:%S %Y"),
        "global options": {"directory": str(args.directory), "ioengine": args.ioengine},
        "jobs": [
            {
                "jobname": args.name,
                "groupid": 0,
                "error": 1 if job.error else 0,
                "error_message": job.error,
                "job options": job_options(args),
                "read": job.read.to_fio(job.runtime_s),
                "write": job.write.to_fio(job.runtime_s),
                "job_runtime": int(job.runtime_s * 1000),
            }
            for job in jobs
        ],
    }


def totals(doc: dict[str, Any], direction: str) -> tuple[float, int]:
    """Aggregate bandwidth (bytes/s) and I/O count of one direction over all jobs."""
    jobs = doc["jobs"]
    return (
        sum(j[direction]["bw_bytes"] for j in jobs),
        sum(j[direction]["total_ios"] for j in jobs),
    )


def _unit(ns_values: list[float]) -> tuple[str, str, float]:
    """Unit, format and divisor for latencies: usec, unless even the smallest is past 10 ms.
    Both keep 1 us of precision: one slow I/O must not round the rest to 0 or 1 msec."""
    low = min(ns_values, default=0)
    return ("msec", ".3f", 1e6) if low >= 1e7 else ("usec", ".0f", 1e3)


def settings_line(doc: dict[str, Any]) -> str:
    """What the run was, as fio's first line says it: a number means nothing without it."""
    options = doc["jobs"][0]["job options"]
    ioengine = doc["global options"]["ioengine"]
    parts = [
        f"rw={options['rw']}",
        f"bs={human_size(int(options['bs']))}",
        f"size={human_size(int(options['size']))}",
        f"ioengine={ioengine}",
        f"iodepth={options['iodepth']}",
        f"numjobs={options['numjobs']}",
        f"direct={options['direct']}",
    ]
    if options["rw"] in ("randrw", "rw", "readwrite"):
        parts.append(f"rwmixread={options['rwmixread']}")
    if float(options["runtime"]):
        based = ", time_based" if options["time_based"] == "1" else ""
        parts.append(f"runtime={float(options['runtime']):g}s{based}")
    parts += [f"mode={options['mode']}", f"pattern={options['pattern']}"]
    return (
        f"{doc['jobs'][0]['jobname']}: (g=0): {', '.join(parts)}\n"
        f"  directory={doc['global options']['directory']}"
    )


def early_end(doc: dict[str, Any]) -> str | None:
    """Why a run with --runtime ended sooner, or None: without --time-based --runtime only
    caps the run (fio's semantics), so a --size done first ends it."""
    jobs = doc["jobs"]
    options = jobs[0].get("job options", {}) if jobs else {}
    runtime_s = float(options.get("runtime", 0))
    if not runtime_s or options.get("time_based") == "1" or any(j["error"] for j in jobs):
        return None
    took_ms = max(j["job_runtime"] for j in jobs)
    if took_ms >= runtime_s * 1000:
        return None
    return (
        f"ended after {took_ms} msec, before --runtime {runtime_s:g}s: each job's --size "
        f"({human_size(int(options['size']))}) was done; --runtime caps a run, "
        "--time-based loops over the file until it ends (as fio)"
    )


def normal_text(doc: dict[str, Any]) -> str:
    lines = [settings_line(doc)]
    for i, job in enumerate(doc["jobs"]):
        lines.append(
            f"{job['jobname']}: (groupid=0, jobs=1): err={job['error']:2d}: job={i}"
            + (f" ({job['error_message']})" if job["error"] else "")
        )
        for direction in ("read", "write"):
            d = job[direction]
            if not d["total_ios"]:
                continue
            mib = d["bw_bytes"] / (1 << 20)
            lines.append(
                f"  {direction}: IOPS={d['iops']:.0f}, BW={mib:.0f}MiB/s "
                f"({d['bw_bytes'] / 1e6:.0f}MB/s)({human_size(d['io_bytes'])}/{d['runtime']}msec)"
            )
            clat = d["clat_ns"]
            unit, fmt, div = _unit([clat["min"]])
            lines.append(
                f"    clat ({unit}): min={clat['min'] / div:{fmt}}, "
                f"max={clat['max'] / div:{fmt}}, avg={clat['mean'] / div:.2f}, "
                f"stdev={clat['stddev'] / div:.2f}"
            )
            lines.append(f"     clat percentiles ({unit}):")
            cells = [f"{float(k):5.2f}th=[{v / div:6{fmt}}]" for k, v in clat["percentile"].items()]
            for row in range(0, len(cells), 4):
                lines.append("     | " + ", ".join(cells[row : row + 4]) + ",")
    if why := early_end(doc):
        lines.append(f"note: {why}")
    return "\n".join(lines) + "\n"


def plot(jobs: list[Job], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib") from None
    fig, (ax_lat, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    for direction in ("read", "write"):
        lat = [ns / 1e3 for job in jobs for ns in getattr(job, direction).clat_ns]
        if lat:
            # Log-spaced bins: one slow outlier must not squash the distribution.
            low, high = max(min(lat), 1e-3), max(lat)
            edges = [low * (high / low) ** (i / 60) for i in range(61)] if high > low else 60
            ax_lat.hist(lat, bins=edges, alpha=0.6, label=direction)
            ax_lat.set_xscale("log")
        points = sorted(p for job in jobs for p in getattr(job, direction).timeline)
        if points:
            bin_s = max(0.1, points[-1][0] / 100)
            bins: dict[int, int] = {}
            for t, size in points:
                bins[int(t / bin_s)] = bins.get(int(t / bin_s), 0) + size
            xs = sorted(bins)
            ax_bw.plot(
                [x * bin_s for x in xs], [bins[x] / bin_s / 1e6 for x in xs], label=direction
            )
    ax_lat.set(xlabel="completion latency (µs)", ylabel="I/Os", title="latency distribution")
    ax_bw.set(xlabel="time (s)", ylabel="MB/s", title="bandwidth over time")
    ax_lat.legend()
    ax_bw.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
