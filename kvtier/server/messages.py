"""kvtier.v1 response messages built from the store's results.

Pure conversions, no I/O and no policy: the servicer decides what to answer, these say
how it looks on the wire. Per-item errors go through `kvtier.errors.to_status`, the same
mapping a failed call gets.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier import __version__
from kvtier._proto import kvtier_pb2 as pb
from kvtier.engine.events import BlockEvent
from kvtier.engine.results import CommitOutcome, LeasedSlot, PutResult, StoreStats
from kvtier.errors import to_status
from kvtier.index.catalog import Entry, TierName
from kvtier.index.planner import Plan
from kvtier.keys import namespace_of
from kvtier.server.looplag import LagReading
from kvtier.types import BlockCosts, PrefillCost

TIER_TO_PB: dict[TierName | None, pb.Tier.ValueType] = {
    None: pb.TIER_UNSPECIFIED,
    TierName.HBM: pb.TIER_HBM,
    TierName.DRAM: pb.TIER_DRAM,
    TierName.NVME: pb.TIER_NVME,
    TierName.REMOTE: pb.TIER_REMOTE,
}
TIER_NAME_TO_PB: dict[str | None, pb.Tier.ValueType] = {
    (k.value if k else None): v for k, v in TIER_TO_PB.items()
}


def block_info(entry: Entry) -> pb.BlockInfo:
    ns_id, key = entry.block_id
    return pb.BlockInfo(
        namespace=namespace_of(ns_id),
        key=key,
        size_bytes=entry.size_bytes,
        xxh3_64=entry.xxh3_64,
        tiers=[TIER_TO_PB[t] for t in entry.tiers],
        generation=entry.generation,
    )


def block_event(event: BlockEvent) -> pb.BlockEvent:
    ns_id, key = event.block_id
    return pb.BlockEvent(
        seq=event.seq,
        namespace=namespace_of(ns_id),
        key=key,
        tiers=[TIER_TO_PB[t] for t in event.tiers],
    )


def commit_results(outcomes: Iterable[CommitOutcome]) -> list[pb.CommitResult]:
    results = []
    for outcome in outcomes:
        if outcome.error is None:
            results.append(pb.CommitResult(stored=outcome.stored))
            continue
        status = to_status(outcome.error)
        results.append(
            pb.CommitResult(stored=outcome.stored, code=status.value, message=status.message)
        )
    return results


def put_response(result: PutResult) -> pb.PutResponse:
    return pb.PutResponse(
        size_bytes=result.size_bytes,
        xxh3_64=result.xxh3_64,
        tier=TIER_TO_PB[result.tier],
        already_present=result.already_present,
    )


def leased(slot: LeasedSlot | None) -> pb.LeasedBlock:
    if slot is None:
        return pb.LeasedBlock(found=False)
    return pb.LeasedBlock(
        found=True,
        offset=slot.offset,
        size_bytes=slot.size_bytes,
        xxh3_64=slot.xxh3_64,
        tier=TIER_TO_PB[slot.tier],
    )


def cuda_got(tiers: Iterable[TierName | None]) -> pb.CudaGetResponse:
    return pb.CudaGetResponse(
        blocks=[pb.CudaGetResult(found=t is not None, tier=TIER_TO_PB[t]) for t in tiers]
    )


def plan_response(plan: Plan, costs: BlockCosts) -> pb.PlanResponse:
    tiers, fetch_s, recompute_s = costs
    return pb.PlanResponse(
        total_s=plan.total_s,
        recompute_all_s=plan.recompute_all_s,
        fetch_all_s=plan.fetch_all_s,
        engine_blocks=plan.engine_blocks,
        fetch_start=plan.fetch_start,
        fetch_end=plan.fetch_end,
        reason=plan.reason,
        tiers=list(map(TIER_NAME_TO_PB.__getitem__, tiers)),  # C-level: 256 blocks a Plan
        fetch_s=fetch_s,
        recompute_s=recompute_s,
        run_latency_s=plan.run_latency_s,
    )


PLAN_RESPONSES_KEPT = 64  # a waiting prompt each: the engine's queue, with room


class PlanResponses:
    """`plan_response`, made once for each plan the cost model hands out again: an engine
    re-plans each waiting prompt every scheduler step, and while no estimate or tier moves
    the daemon answers with the same `Plan` object (its plan memo), so the same message."""

    def __init__(self) -> None:
        # id(plan) -> (plan, its message): the plan held, so its id names it while kept.
        self._kept: dict[int, tuple[Plan, pb.PlanResponse]] = {}

    def __call__(self, plan: Plan, costs: BlockCosts) -> pb.PlanResponse:
        kept = self._kept.pop(id(plan), None)
        if kept is None or kept[0] is not plan:
            kept = (plan, plan_response(plan, costs))
            if len(self._kept) >= PLAN_RESPONSES_KEPT:
                del self._kept[next(iter(self._kept))]  # the least recently answered
        self._kept[id(plan)] = kept
        return kept[1]


def prefill_response(fit: PrefillCost) -> pb.ReportPrefillResponse:
    return pb.ReportPrefillResponse(
        a_s_per_token=fit.a_s_per_token,
        c_s_per_token2=fit.c_s_per_token2,
        step_s=fit.step_s,
    )


def stats_response(
    stats: StoreStats, policy: str, lag: LagReading | None = None
) -> pb.StatsResponse:
    return pb.StatsResponse(
        tiers=[
            pb.TierStats(
                name=t.name,
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
            for t in stats.tiers
        ],
        hits=stats.hits,
        misses=stats.misses,
        puts=stats.puts,
        demotions=stats.demotions,
        checksum_failures=stats.checksum_failures,
        dropped_blocks=stats.dropped_blocks,
        uptime_s=stats.uptime_s,
        version=__version__,
        nvme_direct_io=stats.nvme_direct_io,
        leases=stats.leases,
        promotions=stats.promotions,
        recompute_avoided_s=stats.recompute_avoided_s,
        fetch_regret_s=stats.fetch_regret_s,
        remote_puts=stats.remote_puts,
        remote_fetches=stats.remote_fetches,
        planned_fetch_blocks=stats.planned_fetch_blocks,
        planned_recompute_blocks=stats.planned_recompute_blocks,
        lost_reuse=stats.lost_reuse,
        nvme_admitted=stats.admitted,
        nvme_not_admitted=stats.not_admitted,
        policy=policy,
        event_loop_stall_max_s=lag.stall_max_s if lag else 0.0,
        event_loop_stall_recent_max_s=lag.recent_stall_max_s if lag else 0.0,
    )
