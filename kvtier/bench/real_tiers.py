"""Predicted against measured fetch time on the real DRAM and NVMe tiers of a daemon.

    kvtier bench planner --real-tiers 90 [--json]

Starts a daemon (UNIX socket, NVMe tier in a temporary directory, or `--dir`) and stores
runs of blocks: every pairing of a block size (256 KiB, 1 MiB, 4 MiB) and a queue depth
(1, 4, 16 blocks fetched by one call, as an engine loads a prefix of that many blocks), the
`runs` spread evenly over the pairings. In random order, for each run it asks `Plan` what
fetching that chain will cost (the plan's run latency plus its blocks' `fetch_s`: what the
planner itself weighs against recomputing) and then fetches it through the zero-copy
path (`Client.get_many`) into buffers already touched (an engine's KV buffers are in use:
a first-touch page fault is not a fetch's cost), timing it as an engine would. Then it
restarts the daemon — SIGTERM flushes every block to NVMe, the new process starts with
an empty DRAM arena — and does the same again, so every fetch reads its blocks from NVMe. The
predictions come from whatever the daemon's estimators hold at that moment: its start-up
calibration at first, then the fit of the fetches already done, exactly as a serving
engine would see them.

The figure is the relative error |predicted - measured| / measured of each run, its p50 and
p90 per tier (target: p90 <= 25 %), and the medians per (size, depth).

Held out: after those runs, each tier also fetches `runs // 2` runs of sizes and depths the
table above never has (512 KiB, 2 MiB, 3 MiB blocks; 2, 8, 12 per call), predicted by the
fits as the table's runs left them and reported on their own (`held_out`): a model fitted
to the table's nine pairings, rather than to what a fetch costs, shows there.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIZES_BYTES = (256 << 10, 1 << 20, 4 << 20)
DEPTHS = (1, 4, 16)
HELD_OUT_SIZES_BYTES = (512 << 10, 2 << 20, 3 << 20)
HELD_OUT_DEPTHS = (2, 8, 12)
TOKENS_PER_BLOCK = 16
NAMESPACE = "llama3-8b/real-tiers"


@dataclass(frozen=True, slots=True)
class FetchErrors:
    """Relative errors |predicted - measured| / measured over a set of fetches."""

    count: int
    p50: float
    p90: float
    worst: float


def fetch_errors(predicted_s: list[float], measured_s: list[float]) -> FetchErrors:
    """p50 and p90 (nearest rank, no interpolation: a p90 is an error some fetch had) of
    the relative errors; measured times must be > 0."""
    if len(predicted_s) != len(measured_s) or not measured_s:
        raise ValueError("need one prediction per measurement, at least one")
    if min(measured_s) <= 0:
        raise ValueError("measured times must be > 0")
    errors = sorted(abs(p - m) / m for p, m in zip(predicted_s, measured_s, strict=True))

    def rank(q: float) -> float:  # the ceil(q n)-th smallest (rounded: 0.9 * 10 is 9)
        return errors[max(0, math.ceil(round(q * len(errors), 9)) - 1)]

    return FetchErrors(len(errors), rank(0.5), rank(0.9), errors[-1])


def check_real_tiers(runs: int = 90, workdir: Path | None = None) -> dict[str, Any]:
    """Per tier: p50 and p90 relative error of predicted vs measured fetch seconds."""
    with tempfile.TemporaryDirectory(prefix="kvtier-real-tiers-", dir=workdir) as tmp:
        return _run(Path(tmp), runs)


@dataclass(frozen=True, slots=True)
class _Run:
    size_bytes: int
    keys: list[bytes]


def _layout(
    runs: int, sizes: tuple[int, ...] = SIZES_BYTES, depths: tuple[int, ...] = DEPTHS
) -> list[_Run]:
    cells = list(itertools.product(sizes, depths))
    per_cell = max(1, runs // len(cells))
    out = []
    for r, (size, depth) in itertools.product(range(per_cell), cells):
        keys = [f"run-{size}-{depth}-{r}/{i}".encode() for i in range(depth)]
        out.append(_Run(size, keys))
    return out


def _run(workdir: Path, runs: int) -> dict[str, Any]:
    import kvtier
    from kvtier.bench.daemon import daemon

    table = _layout(runs)
    held_out = _layout(runs // 2, HELD_OUT_SIZES_BYTES, HELD_OUT_DEPTHS) if runs >= 18 else []
    layout = table + held_out
    largest = max(SIZES_BYTES + HELD_OUT_SIZES_BYTES)
    pattern = os.urandom(largest + 4096)
    total_bytes = sum(run.size_bytes * len(run.keys) for run in layout)
    dram_bytes = total_bytes * 5 // 4 + (64 << 20)  # every block fits: no eviction
    out: dict[str, Any] = {
        "runs_per_tier": len(table),
        "held_out_runs_per_tier": len(held_out),
        "block_sizes_bytes": list(SIZES_BYTES),
        "depths": list(DEPTHS),
    }
    for tier in ("dram", "nvme"):
        with daemon(workdir, "uds", dram_bytes) as target, kvtier.Client(target) as client:
            client.wait_ready()
            if tier == "dram":
                for n, run in enumerate(layout):
                    for i, key in enumerate(run.keys):
                        offset = (n * 31 + i * 7) % 4096
                        client.put_from(
                            NAMESPACE, key, memoryview(pattern)[offset : offset + run.size_bytes]
                        )
            out[tier] = _measure(client, tier, table, largest)
            if held_out:  # after the table's runs: the fits as they left them
                out[tier]["held_out"] = _measure(client, tier, held_out, largest)
    return out


def _measure(client: Any, tier: str, layout: list[_Run], largest_bytes: int) -> dict[str, Any]:
    depth = max(len(run.keys) for run in layout)
    buffers = [bytearray(largest_bytes) for _ in range(depth)]
    for buffer in buffers:  # an engine's KV buffers are in use: no first-touch faults timed
        buffer[:] = bytes(largest_bytes)
    order = list(range(len(layout)))
    random.Random(7).shuffle(order)
    predicted: list[float] = []
    measured: list[float] = []
    cells: dict[tuple[int, int], list[tuple[float, float]]] = {}
    run_latency_s: dict[tuple[int, int], list[float]] = {}
    for n in order:
        run = layout[n]
        plan = client.plan(NAMESPACE, run.keys, TOKENS_PER_BLOCK)
        if plan.tiers != [tier] * len(run.keys):
            raise SystemExit(f"run {n} is in {plan.tiers!r}, expected {tier!r}")
        views = [memoryview(b)[: run.size_bytes] for b in buffers[: len(run.keys)]]
        started = time.perf_counter()
        got = client.get_many(NAMESPACE, run.keys, views)
        seconds = time.perf_counter() - started
        if got != [run.size_bytes] * len(run.keys):
            raise SystemExit(f"run {n}: fetched {got}, stored {run.size_bytes} each")
        # A client older than run pricing has no run_latency_s: its planner weighed the
        # blocks alone (what benchmarks/real_tiers_ab.py measures as the baseline).
        run_s = getattr(plan, "run_latency_s", 0.0)
        guess = run_s + sum(plan.fetch_s)
        predicted.append(guess)
        measured.append(seconds)
        cells.setdefault((run.size_bytes, len(run.keys)), []).append((guess, seconds))
        run_latency_s.setdefault((run.size_bytes, len(run.keys)), []).append(run_s)
    errors = fetch_errors(predicted, measured)
    half = len(predicted) // 2
    # The noise floor, same run: each fetch "predicted" by the median measured time of its
    # own (size, depth) cell, in hindsight — no model of size and depth can do better by
    # much, so a p90 near this is the machine's spread, not the estimator's error.
    cell_median = {cell: statistics.median(m for _, m in pairs) for cell, pairs in cells.items()}
    hindsight = [cell_median[cell] for cell, pairs in cells.items() for _ in pairs]
    in_cells = [m for pairs in cells.values() for _, m in pairs]
    floor = fetch_errors(hindsight, in_cells)
    return {
        "hindsight_cell_median_p50_abs_error": floor.p50,
        "hindsight_cell_median_p90_abs_error": floor.p90,
        "median_abs_error": errors.p50,
        "p90_abs_error": errors.p90,
        "max_abs_error": errors.worst,
        "median_abs_error_second_half": fetch_errors(predicted[half:], measured[half:]).p50,
        "p90_abs_error_second_half": fetch_errors(predicted[half:], measured[half:]).p90,
        "median_predicted_s": statistics.median(predicted),
        "median_measured_s": statistics.median(measured),
        "by_size_and_depth": {
            f"{size}x{depth}": {
                "median_predicted_s": statistics.median(p for p, _ in pairs),
                "median_measured_s": statistics.median(m for _, m in pairs),
                "p90_abs_error": fetch_errors([p for p, _ in pairs], [m for _, m in pairs]).p90,
                "median_run_latency_s": statistics.median(run_latency_s[(size, depth)]),
            }
            for (size, depth), pairs in sorted(cells.items())
        },
    }
