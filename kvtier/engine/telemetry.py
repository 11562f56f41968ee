"""Counters the hot path updates cheaply and the metrics endpoint reads at scrape time:
transfer sizes and latencies per (src, dst) path, and requests by method and status code.

Labels stay bounded: tiers and endpoints (`dram`, `nvme`, `engine`, `client`), method
names from the proto, status code names. Never a key, namespace or request id.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

# Seconds: 10 µs .. 10 s, roughly ×2.5 apart (a 4 KiB copy to a 64 MiB NVMe read).
LATENCY_BUCKETS_S = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(slots=True)
class Histogram:
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    count: int = 0
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
        if i < len(self.bucket_counts):
            self.bucket_counts[i] += 1
        self.count += 1
        self.sum_s += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus buckets: (upper bound, observations <= it), ending with +Inf."""
        out, running = [], 0
        for bound, n in zip(LATENCY_BUCKETS_S, self.bucket_counts, strict=True):
            running += n
            out.append((repr(bound), float(running)))
        out.append(("+Inf", float(self.count)))
        return out


@dataclass(slots=True)
class Telemetry:
    transfer_seconds: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    transfer_bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)  # (method, code)

    def transfer(self, src: str, dst: str, size_bytes: int, seconds: float) -> None:
        path = (src, dst)
        hist = self.transfer_seconds.get(path)
        if hist is None:
            hist = self.transfer_seconds[path] = Histogram()
        hist.observe(seconds)
        self.transfer_bytes[path] += size_bytes

    def request(self, method: str, code: str) -> None:
        self.requests[(method, code)] += 1
