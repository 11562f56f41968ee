"""Predicted against measured fetch time on the real DRAM and NVMe tiers of a daemon.

    kvtier bench planner --real-tiers 200 [--json]

Starts a daemon (UNIX socket, NVMe tier in a temporary directory, or `--dir`), stores
`fetches` blocks of 256 KiB, 1 MiB and 4 MiB, and, in random order, asks `Plan` what
fetching each one will cost and then fetches it into a buffer through the zero-copy path
(`Client.get_into`), timing it as an engine would. Then it restarts the daemon — SIGTERM
flushes every block to NVMe, the new process starts with an empty DRAM arena — and does
the same again, so every fetch reads its block from NVMe. The predictions come from
whatever the daemon's estimators hold at that moment: its start-up calibration at first,
then the fit of the fetches already done, exactly as a serving engine would see them.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES_BYTES = (256 << 10, 1 << 20, 4 << 20)
TOKENS_PER_BLOCK = 16
NAMESPACE = "llama3-8b/real-tiers"


def check_real_tiers(fetches: int = 200, workdir: Path | None = None) -> dict[str, Any]:
    """Per tier: median absolute relative error of predicted vs measured fetch seconds."""
    with tempfile.TemporaryDirectory(prefix="kvtier-real-tiers-", dir=workdir) as tmp:
        return _run(Path(tmp), fetches)


def _run(workdir: Path, fetches: int) -> dict[str, Any]:
    import kvtier
    from kvtier.bench.daemon import daemon

    sizes = [SIZES_BYTES[i % len(SIZES_BYTES)] for i in range(fetches)]
    keys = [f"block-{i}".encode() for i in range(fetches)]
    pattern = os.urandom(max(SIZES_BYTES) + fetches)
    dram_bytes = 2 * sum(sizes) + (64 << 20)  # every block fits: no eviction in the way
    out: dict[str, Any] = {"fetches_per_tier": fetches, "block_sizes_bytes": list(SIZES_BYTES)}
    for tier in ("dram", "nvme"):
        with daemon(workdir, "uds", dram_bytes) as target, kvtier.Client(target) as client:
            client.wait_ready()
            if tier == "dram":
                for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                    client.put_from(NAMESPACE, key, memoryview(pattern)[i : i + size])
            out[tier] = _measure(client, tier, keys, sizes)
    return out


def _measure(client: Any, tier: str, keys: list[bytes], sizes: list[int]) -> dict[str, Any]:
    buffer = bytearray(max(sizes))
    order = list(range(len(keys)))
    random.Random(7).shuffle(order)
    errors, predicted, measured = [], [], []
    for i in order:
        plan = client.plan(NAMESPACE, [keys[i]], TOKENS_PER_BLOCK)
        if plan.tiers[0] != tier:
            raise SystemExit(f"block {i} is in {plan.tiers[0]!r}, expected {tier!r}")
        started = time.perf_counter()
        got = client.get_into(NAMESPACE, keys[i], buffer)
        seconds = time.perf_counter() - started
        if got != sizes[i]:
            raise SystemExit(f"block {i}: fetched {got} bytes, stored {sizes[i]}")
        predicted.append(plan.fetch_s[0])
        measured.append(seconds)
        errors.append(abs(plan.fetch_s[0] - seconds) / seconds)
    half = len(errors) // 2
    return {
        "median_abs_error": statistics.median(errors),
        "median_abs_error_second_half": statistics.median(errors[half:]),
        "p90_abs_error": statistics.quantiles(errors, n=10)[-1],
        "median_predicted_s": statistics.median(predicted),
        "median_measured_s": statistics.median(measured),
        "by_size": {
            str(size): {
                "median_predicted_s": statistics.median(
                    p
                    for p, s in zip(predicted, (sizes[i] for i in order), strict=True)
                    if s == size
                ),
                "median_measured_s": statistics.median(
                    m for m, s in zip(measured, (sizes[i] for i in order), strict=True) if s == size
                ),
            }
            for size in SIZES_BYTES
        },
    }
