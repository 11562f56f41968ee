"""What the store's flows return, and the counters they keep: frozen results at the
boundary (the servicer and the metrics read them), one mutable tally inside."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvtier.errors import KVTierError
from kvtier.types import TierName


@dataclass(frozen=True, slots=True)
class PutResult:
    size_bytes: int
    xxh3_64: int
    tier: TierName
    already_present: bool


@dataclass(frozen=True, slots=True)
class TierUsage:
    name: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    hits: int
    evictions: int
    online: bool = True
    io_errors: int = 0
    recovering: bool = False  # NVMe: its index still filling (those blocks are misses)
    recovered_records: int = 0  # NVMe: records the index has recovered so far


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: list[TierUsage]
    hits: int
    misses: int
    puts: int
    demotions: int
    checksum_failures: int
    dropped_blocks: int
    uptime_s: float
    nvme_direct_io: bool
    leases: int
    promotions: int
    recompute_avoided_s: float
    fetch_regret_s: float
    planned_fetch_blocks: int
    planned_recompute_blocks: int
    lost_reuse: int = 0
    admitted: int = 0
    not_admitted: int = 0
    eviction_reasons: dict[tuple[str, str], int] = field(default_factory=dict)
    remote_puts: int = 0
    remote_fetches: int = 0


@dataclass(frozen=True, slots=True)
class LeasedSlot:
    """Where a block (or a reserved slot) lives in the arena mapping."""

    offset: int
    size_bytes: int
    xxh3_64: int = 0
    tier: TierName | None = None


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    stored: bool
    error: KVTierError | None = None


@dataclass(slots=True)
class Counters:
    """The store's running tallies, shared by its units (each adds to its own fields)."""

    hits: dict[str, int] = field(
        default_factory=lambda: {"hbm": 0, "dram": 0, "nvme": 0, "remote": 0}
    )
    evictions: dict[str, int] = field(default_factory=lambda: {"dram": 0, "nvme": 0})
    # (tier, reason): demoted (the copy lives on in NVMe), dropped (gone from every tier),
    # capacity (an NVMe record removed for room), corrupt (failed verification)
    eviction_reasons: Counter[tuple[str, str]] = field(default_factory=Counter)
    misses: int = 0
    puts: int = 0
    demotions: int = 0
    promotions: int = 0
    checksum_failures: int = 0
    dropped_blocks: int = 0
    recompute_avoided_s: float = 0.0
    fetch_regret_s: float = 0.0
    planned_fetch_blocks: int = 0
    planned_recompute_blocks: int = 0
    lost_reuse: int = 0
    admitted: int = 0
    not_admitted: int = 0
    remote_puts: int = 0
    remote_fetches: int = 0
