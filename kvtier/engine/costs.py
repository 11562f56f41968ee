"""CostModel: what fetching and recomputing cost now, and what plans promised.

Pure (no I/O, no event loop): the store feeds it the transfers it timed and the fetch times
clients reported, and asks it for plans and for the per-tier costs the eviction policy
values blocks with. Paths:
  "dram"   arena -> engine buffer, fitted from the fetch times zero-copy clients report
  "nvme"   a verified record read into the arena, timed on the I/O thread that did it
  "remote" a verified fetch from the cluster's store into the arena (when configured)
  "hbm"    device to device from the GPU path's copies (added by that path)
An NVMe (remote) block reaches the engine by its path and then "dram", in series.

A plan that tells an engine to fetch a block is remembered (bounded) and settled when the
block is served: the recompute it replaced is saved time, a fetch slower than it regret.

Plans price a fetched run as the engine waits for it (issue 26, estimator honesty): one
call's round trip once per run, then each block's copy (`dram_runs`, fitted over whole
leases); NVMe blocks are read s at a time, so a run of m pays ceil(m / s) rounds of one
read each and the promotion's own start (`nvme_runs`, fitted over whole promotions, s
among 1, 2, 4, ... io_threads: the overlap the machine really gives). The planner sees
that as a per-block share of a round plus a run latency of the round trip, the start, and
the part of the first round the shares do not cover. Until those fits are warm, and for
the eviction policy's per-block values, the per-block path estimates stand.

DRAM blocks a client reads from its directory (no round trip) are priced by a third fit,
`dram_direct`, over the clients' whole calls as they waited for them (`direct_call`): the
per-hit copy times miss the client's work around the copies (~20 µs a call here, half a
256 KiB read). A run with both pays both calls' starts: get_many reads its DRAM blocks
directly, then acquires the rest in one lease.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from kvtier.engine.results import Counters
from kvtier.index.estimators import (
    ParallelRunEstimator,
    PathEstimator,
    PrefillEstimator,
    RunEstimator,
)
from kvtier.index.planner import Family, Plan, PlanRequest
from kvtier.index.planner import plan as make_plan
from kvtier.keys import tenant_of
from kvtier.profiles import MODELS
from kvtier.types import BlockCosts, BlockId, Overlap, PrefillCost, TierCost, TierName

PLANNED_BLOCKS_KEPT = 1 << 16
PLANS_KEPT = 256  # distinct plan inputs remembered (a waiting prompt's re-Plans hit)


def model_of(ns_id: str, default_model: str) -> str:
    """A namespace's model profile: its first path segment, if it names a known model."""
    model = ns_id.partition("|")[2].split("/", 1)[0]
    return model if model in MODELS else default_model


class CostModel:
    """Per-path fetch estimators, per-model prefill estimators, and plan settlement.

    `streams(tier)` says how many transfers of a tier run at once (its I/O threads): a run
    of NVMe blocks is read that many at a time, so each is priced at its share."""

    def __init__(
        self,
        seeds: dict[str, TierCost],
        default_model: str,
        streams: Callable[[str], int],
        counters: Counters,
    ) -> None:
        self.paths: dict[str, PathEstimator] = {
            name: PathEstimator(seed) for name, seed in seeds.items()
        }
        self.default_model = default_model
        self._streams = streams
        self._counters = counters
        self._prefill: dict[str, PrefillEstimator] = {}
        # Read by the policy's value model (shared dict: refreshed in place).
        self.value_costs: dict[str, TierCost] = {}
        self.planned: dict[BlockId, float] = {}  # in the order first planned
        # Changes to `planned` (plans' updates, settled fetches, trims), and the last plan
        # that updated it: (changes then, namespace, keys, recompute seconds, first index,
        # blocks planned). The same plan again with no change since finds its blocks
        # there with its values already: an engine re-planning one waiting prompt every
        # scheduler step skips ~200 dict updates a Plan.
        self._planned_changes = 0
        self._last_planned: tuple[int, str, list[bytes], list[float], int, int] | None = None
        # Plans by every input the planner reads (its request, as a tuple): an engine
        # re-plans a waiting prompt each scheduler step with nothing changed, and a new
        # fit or observation changes the key, so nothing needs invalidating.
        self._plans: dict[tuple[object, ...], tuple[Plan, BlockCosts]] = {}
        # Whole calls, as the engine waits for them (module docstring): a lease's copies,
        # a lease's NVMe promotions.
        self.dram_runs = RunEstimator(min_observations=4)
        self.dram_direct = RunEstimator(min_observations=4)  # calls read from the directory
        self.nvme_runs = ParallelRunEstimator(max(1, streams(TierName.NVME)))
        self.refresh()

    def add_path(self, tier: str, seed: TierCost) -> PathEstimator:
        """A fetch path the store does not move itself (the GPU path's HBM copies)."""
        estimator = self.paths[tier] = PathEstimator(seed)
        self.refresh()
        return estimator

    def observe(self, path: str, size_bytes: int, seconds: float) -> None:
        self.paths[path].observe(size_bytes, seconds)

    def path_cost(self, tier: str) -> TierCost:
        """Estimated cost of bringing a block from `tier` into an engine's buffer."""
        to_engine = self.paths[TierName.DRAM].estimate()
        if tier == TierName.DRAM:
            return to_engine
        if tier == TierName.HBM:
            return self.paths[tier].estimate()  # device to device, straight to the engine
        return self.paths[tier].estimate().in_parallel(self._streams(tier)).then(to_engine)

    def refresh(self) -> dict[str, TierCost]:
        """The engine-visible cost of each tier now (read by the planner and the policy)."""
        for name in self.paths:
            self.value_costs[name] = self.path_cost(name)
        return dict(self.value_costs)

    def plan_costs(
        self, block_bytes: int, nvme_in_run: bool, dram_in_run: bool = True
    ) -> tuple[dict[str, TierCost], float]:
        """Per-block costs and the run latency a plan of `block_bytes` blocks is priced by
        (module docstring); `nvme_in_run` / `dram_in_run`: the run may hold NVMe / DRAM
        blocks."""
        costs = self.refresh()
        dram = self.dram_runs.estimate()
        direct = self.dram_direct.estimate()
        run_s = 0.0
        if dram is not None:
            costs[TierName.DRAM] = to_engine = dram.per_unit(block_bytes)
            # Leased: the call's start is paid by any run (all of it when nothing is read
            # directly), else by the NVMe part's Acquire only.
            if direct is None or nvme_in_run:
                run_s = dram.per_run_s
        else:
            to_engine = costs[TierName.DRAM]
        if direct is not None:
            costs[TierName.DRAM] = direct.per_unit(block_bytes)
            if dram_in_run:
                run_s += direct.per_run_s
        if TierName.NVME in self.paths:
            fitted = self.nvme_runs.estimate()
            if fitted is not None:  # a round: one read of each of up to `streams` blocks
                nvme, streams = fitted
                read = nvme.per_unit(block_bytes)
                start_s = nvme.per_run_s
            else:
                streams = max(1, self._streams(TierName.NVME))
                read, start_s = self.paths[TierName.NVME].estimate(), 0.0
            costs[TierName.NVME] = read.in_parallel(streams).then(to_engine)
            if nvme_in_run:
                run_s += start_s + read.fetch_s(block_bytes) * (1 - 1 / streams)
        return costs, run_s

    def promoted(self, block_sizes: list[int], promote_s: float) -> None:
        """A lease's NVMe promotions, timed as its caller waited for them (all at once, on
        the I/O threads): refines what a run of NVMe blocks costs an engine."""
        self.nvme_runs.observe(block_sizes, promote_s)

    def estimates(self) -> tuple[dict[str, TierCost], dict[str, PrefillCost]]:
        """What the planner believes now: per path, and per "tenant|model" prefill."""
        return (
            {name: est.estimate() for name, est in self.paths.items()},
            {key: est.estimate() for key, est in self._prefill.items()},
        )

    def prefill_estimator(self, ns_id: str) -> PrefillEstimator:
        """The prefill estimate of a namespace's model, per tenant."""
        model = model_of(ns_id, self.default_model)
        key = f"{tenant_of(ns_id)}|{model}"
        if key not in self._prefill:
            profile = MODELS[model]
            self._prefill[key] = PrefillEstimator(
                PrefillCost(profile.a_s_per_token, profile.c_s_per_token2)
            )
        return self._prefill[key]

    def plan(
        self,
        ns_id: str,
        keys: list[bytes],
        tiers: list[TierName | None],
        tokens_per_block: int,
        prompt_tokens: int,
        engine_cached_blocks: int,
        overlap: Overlap,
        kv_bytes_per_token: int,
        first_size_bytes: int | None,
        family: Family = "any",
    ) -> tuple[Plan, BlockCosts]:
        """The plan for a chain whose blocks sit in `tiers`; remembers what it asks to fetch.
        Without `kv_bytes_per_token`, the first cached block's size (`first_size_bytes`)
        or the model's profile tells it."""
        if not kv_bytes_per_token:
            kv_bytes_per_token = (
                max(1, first_size_bytes // tokens_per_block)
                if first_size_bytes
                else MODELS[model_of(ns_id, self.default_model)].kv_bytes_per_token
            )
        # The run may hold NVMe blocks if the chain does (a DRAM head planned alone before an
        # NVMe tail is charged the NVMe start too: a scan of the chain, not of each split).
        tier_costs, run_s = self.plan_costs(
            kv_bytes_per_token * tokens_per_block, TierName.NVME in tiers, TierName.DRAM in tiers
        )
        prompt = prompt_tokens or len(keys) * tokens_per_block
        prefill = self.prefill_estimator(ns_id).estimate()
        memo_key = (
            prompt,
            tokens_per_block,
            kv_bytes_per_token,
            tuple(tiers),
            tuple(tier_costs.items()),
            prefill,
            engine_cached_blocks,
            overlap,
            family,
            run_s,
        )
        memo = self._plans.pop(memo_key, None)
        if memo is None:
            request = PlanRequest(
                prompt_tokens=prompt,
                tokens_per_block=tokens_per_block,
                kv_bytes_per_token=kv_bytes_per_token,
                cached_tiers=list(tiers),
                tier_costs=tier_costs,
                prefill=prefill,
                engine_cached_blocks=engine_cached_blocks,
                overlap=overlap,
                family=family,
                run_latency_s=run_s,
            )
            plan_made = make_plan(request)
            memo = (plan_made, plan_made.block_costs())
            if len(self._plans) >= PLANS_KEPT:
                del self._plans[next(iter(self._plans))]  # the least recently asked
        self._plans[memo_key] = memo
        result, costs = memo
        recompute = costs[2]
        planned = self.planned
        start, end = result.fetch_start, min(result.fetch_end, len(keys))
        fetched = keys[start:end]
        last = self._last_planned
        if not (
            last is not None
            and last[0] == self._planned_changes
            and last[5] == len(planned)
            and last[3] is recompute
            and last[4] == start
            and last[1] == ns_id
            and last[2] == fetched
        ):
            # One C-level update per plan: a block planned again keeps its place, so the
            # oldest first planned go first.
            planned.update(
                zip(zip(itertools.repeat(ns_id), fetched), recompute[start:end], strict=True)
            )
            if len(planned) > PLANNED_BLOCKS_KEPT:
                trim = len(planned) - PLANNED_BLOCKS_KEPT
                for block_id in list(itertools.islice(planned, trim)):
                    del planned[block_id]
            self._planned_changes += 1
            self._last_planned = (
                self._planned_changes,
                ns_id,
                fetched,
                recompute,
                start,
                len(planned),
            )
        self._counters.planned_fetch_blocks += result.fetch_blocks
        self._counters.planned_recompute_blocks += (
            len(recompute) - result.engine_blocks - result.fetch_blocks
        )
        return result, costs

    def served(
        self, block_id: BlockId, tier: TierName, size_bytes: int, measured_s: float | None
    ) -> None:
        """Count a hit; if a plan asked for this fetch, settle what it saved or cost."""
        self._counters.hits[tier.value] += 1
        recompute_s = self.planned.pop(block_id, None)
        if recompute_s is None:
            return
        self._planned_changes += 1
        fetch_s = measured_s if measured_s is not None else self.path_cost(tier).fetch_s(size_bytes)
        self._counters.recompute_avoided_s += recompute_s
        if fetch_s > recompute_s:
            self._counters.fetch_regret_s += fetch_s - recompute_s

    def engine_fetch(
        self,
        block_sizes: list[int],
        promote_s: float,
        fetch_s: float,
        fetch_bytes: int,
        runs: bool = True,
    ) -> float | None:
        """A client's measured fetch of one lease's blocks: refines the DRAM path per
        block (the request's round trip is shared by them; time spent promoting from NVMe
        is that path's, measured already) and, with `runs`, the leased-run fit (a direct
        hit whose call was reported teaches only the per-block path). Returns the copy
        seconds it fitted, or None for a report it ignored."""
        if fetch_bytes > sum(block_sizes):
            return None  # not what this lease served: ignore rather than skew the fit
        copy_s = fetch_s - promote_s
        if copy_s <= 0:
            return None
        blocks = len(block_sizes)
        self.paths[TierName.DRAM].observe(fetch_bytes // blocks, copy_s / blocks)
        if runs:
            self.dram_runs.observe(blocks, fetch_bytes, copy_s)
        return copy_s

    def direct_call(self, blocks: int, size_bytes: int, seconds: float) -> None:
        """One client call's reads from its directory, as the caller waited for them:
        refines what a run of DRAM blocks read directly costs (non-finite or non-positive
        reports are ignored by the fit)."""
        if math.isfinite(seconds):
            self.dram_direct.observe(blocks, size_bytes, seconds)
