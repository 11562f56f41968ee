"""The shared vocabulary: what a block is called, where it can live, and what a lookup or a
plan returns. Core: imported by the clients, the deciding code and the daemon alike, so it
imports nothing of kvtier's but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

BlockId = tuple[str, bytes]  # (namespace id, key)


class TierName(StrEnum):
    """Where a block's copy can live. A StrEnum: its value is the name on the wire and in
    metrics, so `TierName.DRAM == "dram"`."""

    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"
    REMOTE = "remote"  # a store the cluster shares: never a catalog entry's own copy


@dataclass(frozen=True, slots=True)
class Extent:
    """A byte range of a DRAM arena: [offset, offset + size_bytes)."""

    offset: int
    size_bytes: int


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How much of an ordered chain of keys is cached, and where each key lives."""

    prefix_blocks: int
    tiers: list[TierName | None] = field(default_factory=list)

    @classmethod
    def of(cls, tiers: list[TierName | None]) -> LookupResult:
        """The result for per-key `tiers` (None: not cached): the prefix ends at the first
        None."""
        return cls(tiers.index(None) if None in tiers else len(tiers), tiers)


Overlap = Literal["none", "layerwise", "bidirectional"]
OVERLAPS: tuple[Overlap, ...] = ("none", "layerwise", "bidirectional")

# Per block of a plan: its tier (None: not cached), fetch seconds, recompute seconds.
BlockCosts = tuple[list[str | None], list[float], list[float]]


@dataclass(frozen=True, slots=True)
class TierCost:
    """Measured cost of fetching from one tier to the engine: time = latency + bytes / bw."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def fetch_s(self, size_bytes: int) -> float:
        return self.latency_s + size_bytes / self.bandwidth_bytes_per_s

    def in_parallel(self, streams: int) -> TierCost:
        """The per-block cost of a run fetched `streams` at a time (the daemon's I/O
        threads): amortized over the run, each stream's time overlaps the others'."""
        return TierCost(self.bandwidth_bytes_per_s * streams, self.latency_s / streams)

    def then(self, after: TierCost) -> TierCost:
        """This transfer followed by `after` (e.g. NVMe -> DRAM, then DRAM -> engine)."""
        return TierCost(
            bandwidth_bytes_per_s=1
            / (1 / self.bandwidth_bytes_per_s + 1 / after.bandwidth_bytes_per_s),
            latency_s=self.latency_s + after.latency_s,
        )


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """Prefill seconds for tokens [s, e) after [0, s): a*(e-s) + c*(e^2-s^2)/2 + step_s."""

    a_s_per_token: float
    c_s_per_token2: float
    step_s: float = 0.0

    def seconds(self, start_token: int, end_token: int) -> float:
        if end_token <= start_token:
            return 0.0
        return (
            self.a_s_per_token * (end_token - start_token)
            + self.c_s_per_token2 * (end_token**2 - start_token**2) / 2
            + self.step_s
        )


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """One block of a plan: what to do with it, from which tier, at what estimated cost."""

    index: int
    action: Literal["engine", "fetch", "recompute"]
    tier: str | None
    fetch_s: float | None  # estimated cost to fetch it (None: not cached)
    recompute_s: float  # estimated cost to recompute it where it stands in the prompt
