"""What the clients' calls return, and how each reply message becomes one.

Every public method of `Client` and `AsyncClient` returns one of these frozen dataclasses
(or a type of `kvtier.types`), never a protobuf message or a dict: the wire format can
change without callers noticing, and every field is typed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client._common import PB_TO_TIER
from kvtier.types import BlockPlan, LookupResult, PrefillCost


@dataclass(frozen=True, slots=True)
class BlockStat:
    """Metadata of one stored block."""

    namespace: str
    key: bytes
    size_bytes: int
    xxh3_64: int
    tiers: list[str]
    generation: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A node's blocks (of one namespace, or all of the tenant's) as of event `seq`."""

    epoch: str
    seq: int
    blocks: list[BlockStat]


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """A block's new set of tiers, fastest first (empty: it is gone from the node)."""

    seq: int
    namespace: str
    key: bytes
    tiers: list[str]


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events from WatchEvents. `resync`: those asked for are gone; take a snapshot."""

    epoch: str
    events: list[BlockEvent]
    resync: bool = False


@dataclass(frozen=True, slots=True)
class PlanResult:
    """The daemon's fetch-or-recompute decision for a chain (see kvtier.index.planner):
    blocks [0, engine_blocks) are held by the engine, [fetch_start, fetch_end) fetched,
    the others recomputed."""

    total_s: float
    recompute_all_s: float
    fetch_all_s: float
    engine_blocks: int
    fetch_start: int
    fetch_end: int
    reason: str
    tiers: list[str | None]
    fetch_s: list[float]
    recompute_s: list[float]
    # Paid once by the fetched run beyond its blocks' fetch_s: fetching blocks [i, j)
    # costs run_latency_s + sum(fetch_s[i:j]).
    run_latency_s: float = 0.0

    @property
    def fetch_blocks(self) -> int:
        return self.fetch_end - self.fetch_start

    @property
    def blocks(self) -> list[BlockPlan]:
        return [
            BlockPlan(
                index=i,
                action="engine"
                if i < self.engine_blocks
                else "fetch"
                if self.fetch_start <= i < self.fetch_end
                else "recompute",
                tier=tier,
                fetch_s=self.fetch_s[i] if tier else None,
                recompute_s=self.recompute_s[i],
            )
            for i, tier in enumerate(self.tiers)
        ]


class _ByFieldName(Mapping[str, Any]):
    """Read-only item access by field name. `stats()` returned nested dicts before it
    returned dataclasses; this keeps code written against them working:
    `stats["tiers"]["dram"]["used_bytes"]` is `stats.tiers["dram"].used_bytes`."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Any]]

    def __getitem__(self, name: str) -> Any:
        if name not in self.__dataclass_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class TierStats(_ByFieldName):
    """One tier's occupancy and counters since the daemon started."""

    used_bytes: int
    capacity_bytes: int
    blocks: int
    hits: int
    evictions: int
    online: bool  # False while offline after repeated I/O errors (served from the others)
    io_errors: int
    # NVMe: True while the daemon serves with its index still filling from disk (blocks
    # not indexed yet are misses); the records indexed so far.
    recovering: bool = False
    recovered_records: int = 0


@dataclass(frozen=True, slots=True)
class Stats(_ByFieldName):
    """The daemon's counters since it started, and each tier's (`tiers`, by tier name).
    `dataclasses.asdict(stats)` is the JSON that `kvtier stats --json` prints."""

    version: str
    uptime_s: float
    hits: int
    misses: int
    puts: int
    demotions: int
    checksum_failures: int
    dropped_blocks: int
    nvme_direct_io: bool
    leases: int  # zero-copy leases held now
    promotions: int  # blocks copied NVMe -> DRAM for a leased get
    recompute_avoided_s: float  # prefill avoided by fetches a plan asked for (as estimated)
    fetch_regret_s: float  # where such a fetch took longer than recomputing would have
    planned_fetch_blocks: int
    planned_recompute_blocks: int
    lost_reuse: int  # misses on blocks evicted from every tier a short while ago
    nvme_admitted: int
    nvme_not_admitted: int
    policy: str
    remote_puts: int
    remote_fetches: int
    tiers: dict[str, TierStats]
    # Longest event-loop stall (an upper bound, 5 ms coarse) since the daemon started, and
    # since the previous stats() call (this call resets it); 0.0 from a daemon without it.
    event_loop_stall_max_s: float = 0.0
    event_loop_stall_recent_max_s: float = 0.0


def lookup_result(resp: pb.LookupResponse) -> LookupResult:
    return LookupResult(resp.prefix_blocks, [PB_TO_TIER[t] for t in resp.tiers])


def prefill_cost(resp: pb.ReportPrefillResponse) -> PrefillCost:
    return PrefillCost(resp.a_s_per_token, resp.c_s_per_token2, resp.step_s)


def plan_result(resp: pb.PlanResponse) -> PlanResult:
    return PlanResult(
        total_s=resp.total_s,
        recompute_all_s=resp.recompute_all_s,
        fetch_all_s=resp.fetch_all_s,
        engine_blocks=resp.engine_blocks,
        fetch_start=resp.fetch_start,
        fetch_end=resp.fetch_end,
        reason=resp.reason,
        # A slice of a repeated field is a list made in C: 0.65x the time of list() of it.
        tiers=list(map(PB_TO_TIER.__getitem__, resp.tiers[:])),
        fetch_s=resp.fetch_s[:],
        recompute_s=resp.recompute_s[:],
        run_latency_s=resp.run_latency_s,
    )


def _tier_names(tiers: Iterable[int]) -> list[str]:
    return [t for t in (PB_TO_TIER[x] for x in tiers) if t]


def block_stat(info: pb.BlockInfo) -> BlockStat:
    return BlockStat(
        namespace=info.namespace,
        key=info.key,
        size_bytes=info.size_bytes,
        xxh3_64=info.xxh3_64,
        tiers=_tier_names(info.tiers),
        generation=info.generation,
    )


def snapshot_of(responses: list[pb.SnapshotResponse]) -> Snapshot:
    """One Snapshot from its streamed batches (each carries the same epoch and seq)."""
    last = responses[-1] if responses else pb.SnapshotResponse()
    return Snapshot(
        last.epoch, last.seq, [block_stat(info) for resp in responses for info in resp.blocks]
    )


def event_batch(resp: pb.WatchEventsResponse) -> EventBatch:
    return EventBatch(
        epoch=resp.epoch,
        events=[
            BlockEvent(seq=e.seq, namespace=e.namespace, key=e.key, tiers=_tier_names(e.tiers))
            for e in resp.events
        ],
        resync=resp.resync,
    )


def stats_of(resp: pb.StatsResponse) -> Stats:
    return Stats(
        version=resp.version,
        uptime_s=resp.uptime_s,
        hits=resp.hits,
        misses=resp.misses,
        puts=resp.puts,
        demotions=resp.demotions,
        checksum_failures=resp.checksum_failures,
        dropped_blocks=resp.dropped_blocks,
        nvme_direct_io=resp.nvme_direct_io,
        leases=resp.leases,
        promotions=resp.promotions,
        recompute_avoided_s=resp.recompute_avoided_s,
        fetch_regret_s=resp.fetch_regret_s,
        planned_fetch_blocks=resp.planned_fetch_blocks,
        planned_recompute_blocks=resp.planned_recompute_blocks,
        lost_reuse=resp.lost_reuse,
        nvme_admitted=resp.nvme_admitted,
        nvme_not_admitted=resp.nvme_not_admitted,
        policy=resp.policy,
        remote_puts=resp.remote_puts,
        remote_fetches=resp.remote_fetches,
        tiers={
            t.name: TierStats(
                used_bytes=t.used_bytes,
                capacity_bytes=t.capacity_bytes,
                blocks=t.blocks,
                hits=t.hits,
                evictions=t.evictions,
                online=t.online,
                io_errors=t.io_errors,
                recovering=t.recovering,
                recovered_records=t.recovered_records,
            )
            for t in resp.tiers
        },
        event_loop_stall_max_s=resp.event_loop_stall_max_s,
        event_loop_stall_recent_max_s=resp.event_loop_stall_recent_max_s,
    )


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What a `prefetch` announced: blocks accepted (a chain past the tenant's limits is
    cut), of which in DRAM already (now kept there), on NVMe (being promoted), on no local
    tier; and the TTL the daemon applied."""

    accepted_blocks: int
    in_dram: int
    to_promote: int
    not_stored: int
    ttl_s: float


def prefetch_result(resp: pb.PrefetchResponse) -> PrefetchResult:
    return PrefetchResult(
        resp.accepted_blocks, resp.in_dram, resp.to_promote, resp.not_stored, resp.ttl_s
    )
