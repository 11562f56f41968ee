"""The planner as it was before issue 25 vectorised its layerwise and bidirectional
searches and cached its prefill arrays (kvtier/index/planner.py at b9ab26d), frozen as the
specification the fast path must match decision for decision (tests/index/test_planner.py).
Its model and search are described in kvtier/index/planner.py."""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvtier.types import (
    OVERLAPS,
    BlockCosts,
    BlockPlan,
    Overlap,
    PrefillCost,
    TierCost,
)

Family = Literal["any", "prefix"]
FAMILIES: tuple[Family, ...] = ("any", "prefix")

__all__ = [
    "FAMILIES",
    "OVERLAPS",
    "BlockCosts",
    "BlockPlan",
    "Family",
    "Overlap",
    "Plan",
    "PlanRequest",
    "PrefillCost",
    "TierCost",
    "cost_of",
    "oracle_total",
    "plan",
    "split_cost",
]


@dataclass(frozen=True, slots=True)
class Plan:
    """The decision for one prompt: blocks [0, engine_blocks) are held by the engine,
    [engine_blocks, fetch_start) are recomputed (the front), [fetch_start, fetch_end) are
    fetched, and [fetch_end, n) recomputed. No fetch: fetch_start == fetch_end."""

    overlap: Overlap
    total_s: float
    engine_blocks: int
    fetch_start: int
    fetch_end: int
    recompute_all_s: float
    fetch_all_s: float  # every cached block fetched, the rest recomputed (same overlap)
    reason: str
    _req: PlanRequest
    _arrays: _Arrays

    @property
    def fetch_blocks(self) -> int:
        """How many blocks to fetch."""
        return self.fetch_end - self.fetch_start

    @property
    def run_latency_s(self) -> float:
        """What the fetched run costs once, beyond its blocks' `fetch_s` (see module)."""
        return self._req.run_latency_s

    @property
    def recompute_front_blocks(self) -> int:
        """Blocks recomputed before (bidirectional: beside) the fetched run."""
        return self.fetch_start - self.engine_blocks

    def block_costs(self) -> BlockCosts:
        """Per block: its tier (None: not cached), fetch seconds (0 if not cached) and
        recompute seconds at its position — the figures `blocks` is made of, cheaply."""
        arr, req = self._arrays, self._req
        e, end = arr.engine, arr.cached_end
        tiers: list[str | None] = [None] * arr.n
        tiers[e:end] = [str(t) for t in req.cached_tiers[e:end]]
        fetch = [0.0] * arr.n
        fetch[e:end] = arr.fetch_cost
        pre = req.prefill
        a, half_c, t = pre.a_s_per_token, pre.c_s_per_token2 / 2, arr.tokens
        t0, t1 = t[:-1], t[1:]
        recompute: list[float] = (a * (t1 - t0) + half_c * (t1 * t1 - t0 * t0)).tolist()
        return tiers, fetch, recompute

    @property
    def blocks(self) -> list[BlockPlan]:
        """Per block: what to do, from which tier, and the estimated costs (built on demand)."""
        arr, req = self._arrays, self._req
        e = arr.engine
        step = req.prefill.step_s
        return [
            BlockPlan(
                index=i,
                action="engine"
                if i < e
                else "fetch"
                if self.fetch_start <= i < self.fetch_end
                else "recompute",
                tier=str(req.cached_tiers[i]) if e <= i < arr.cached_end else None,
                fetch_s=arr.fetch_cost[i - e] if e <= i < arr.cached_end else None,
                recompute_s=req.prefill.seconds(int(arr.tokens[i]), int(arr.tokens[i + 1])) - step,
            )
            for i in range(arr.n)
        ]


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """Everything the planner needs about one prompt."""

    prompt_tokens: int
    tokens_per_block: int
    kv_bytes_per_token: int
    cached_tiers: Sequence[str | None]  # per block from 0: the tier holding it, or None
    tier_costs: dict[str, TierCost]
    prefill: PrefillCost
    engine_cached_blocks: int = 0
    overlap: Overlap = "none"
    layers: int = 32
    family: Family = "any"  # the splits the engine can carry out (module docstring)
    # Paid once by any non-empty fetch, whatever its length: what one load call costs
    # before its first byte (per-block costs alone overprice long runs of small blocks).
    run_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0 or self.tokens_per_block <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("prompt_tokens, tokens_per_block and kv_bytes_per_token must be > 0")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAPS)}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}")
        if not self.run_latency_s >= 0:
            raise ValueError("run_latency_s must be >= 0")
        if self.layers <= 0:
            raise ValueError("layers must be > 0")


@dataclass(frozen=True, slots=True)
class _Arrays:
    """Per-prompt cost arrays, indexed by block number."""

    engine: int
    cached_end: int
    n: int
    tokens: np.ndarray  # boundary i's token, min(i * b, prompt), as doubles (exact < 2^26)
    fetch_cost: list[float]  # for blocks engine..cached_end-1
    # Indexed by split boundary 0..cached_end (a split never goes past the cached run):
    loaded: list[float]  # loaded[i]: fetch [engine, i)  (constant below engine)
    front: list[float]  # front[g]: recompute [engine, g)
    tail: list[float]  # tail[k]: recompute [k, n)
    # The same three as arrays, for the vectorised searches.
    loaded_np: np.ndarray
    front_np: np.ndarray
    tail_np: np.ndarray


def _arrays(req: PlanRequest) -> _Arrays:
    b = req.tokens_per_block
    n = -(-req.prompt_tokens // b)
    engine = min(req.engine_cached_blocks, n)
    cached_end = engine  # end of the leading run of fetchable blocks after the engine's
    costs = req.tier_costs
    for tier in itertools.islice(req.cached_tiers, engine, n):
        if tier not in costs:
            break
        cached_end += 1
    tokens = np.arange(n + 1, dtype=np.float64) * b
    tokens[n] = req.prompt_tokens
    # Every block but a partial last one has b tokens: one fetch cost per tier.
    whole = {
        name: cost.fetch_s(b * req.kv_bytes_per_token) for name, cost in req.tier_costs.items()
    }
    fetch_cost = [whole[t] for t in req.cached_tiers[engine:cached_end]]  # type: ignore[index]
    last_tokens = req.prompt_tokens - (n - 1) * b
    if cached_end > engine and cached_end == n and last_tokens != b:
        fetch_cost[-1] = req.tier_costs[str(req.cached_tiers[n - 1])].fetch_s(
            last_tokens * req.kv_bytes_per_token
        )
    loaded = np.zeros(cached_end + 1)
    np.cumsum(fetch_cost, out=loaded[engine + 1 :])  # a running sum, as itertools.accumulate
    a, half_c, step = req.prefill.a_s_per_token, req.prefill.c_s_per_token2 / 2, req.prefill.step_s
    # span(s, e) = a (e - s) + c (e^2 - s^2) / 2 + step, or 0 when e <= s, vectorised (this
    # runs on every Plan). Token counts as doubles are exact below 2^26 tokens, so these are
    # the values integer arithmetic gives. A split never goes past the cached run: only
    # its boundaries 0..cached_end are priced.
    bounds = tokens[: cached_end + 1]
    start, end = float(tokens[engine]), float(req.prompt_tokens)
    front = np.where(
        bounds > start,
        a * (bounds - start) + half_c * (bounds * bounds - start * start) + step,
        0.0,
    )
    tail = np.where(
        end > bounds, a * (end - bounds) + half_c * (end * end - bounds * bounds) + step, 0.0
    )
    return _Arrays(
        engine,
        cached_end,
        n,
        tokens,
        fetch_cost,
        loaded.tolist(),
        front.tolist(),
        tail.tolist(),
        loaded,
        front,
        tail,
    )


def split_cost(req: PlanRequest, arr: _Arrays, g: int, k: int) -> float:
    """Total time of: recompute [E, g), fetch [g, k), recompute [k, n) (E <= g <= k)."""
    load = arr.loaded[k] - arr.loaded[g] + (req.run_latency_s if k > g else 0.0)
    if req.overlap == "none":
        return arr.front[g] + load + arr.tail[k]
    if req.overlap == "layerwise":
        return arr.front[g] + max(load, arr.tail[k]) + load / req.layers
    return max(arr.front[g] + arr.tail[k], load + arr.tail[k] / req.layers)


def plan(req: PlanRequest) -> Plan:
    """The cheapest split of the chain under `req`'s costs (matches the brute-force oracle)."""
    arr = _arrays(req)
    e, n = arr.engine, arr.n
    loaded, front, tail = arr.loaded, arr.front, arr.tail
    inv = 1 / req.layers
    # Every candidate below with g < k fetches: each pays the run latency once. A candidate
    # with g == k is charged it too, which only makes it dearer than recompute-all (its
    # front and tail recompute the same tokens plus a step), so it never wins; and when
    # it is its region's best, every other g there is dearer still.
    run_s = req.run_latency_s
    best_total, best_g, best_k = split_cost(req, arr, e, e), e, e
    ks = range(e + 1, arr.cached_end + 1)
    if req.family == "prefix":
        if len(ks):
            best_total, best_k = _best_prefix(req, arr)
            best_g = e
    elif req.overlap == "none":
        # cost = (front[g] - loaded[g]) + loaded[k] + tail[k]: best g is a prefix minimum
        # (the first index holding it), best k the first with the least total.
        if len(ks):
            best_total, best_g, best_k = _best_split_none(
                arr.front_np[e:], arr.loaded_np[e:], arr.tail_np[e:], e, best_total, run_s
            )
    elif req.overlap == "bidirectional":
        # max(front[g] + tail[k], load(g, k) + tail[k]/layers): the first rises with g, the
        # second falls, so the best g is where front[g] + loaded[g] crosses a k-threshold.
        rising = [f + ld for f, ld in zip(front, loaded, strict=True)]
        for k in ks:
            cross = bisect.bisect_left(rising, loaded[k] + run_s - tail[k] * (1 - inv), e, k + 1)
            for g in (cross - 1, cross):
                if e <= g <= k:
                    total = max(front[g] + tail[k], loaded[k] + run_s - loaded[g] + tail[k] * inv)
                    if total < best_total:
                        best_total, best_g, best_k = total, g, k
    else:
        # layerwise: where load(g, k) >= tail[k] (g up to `split`) the cost is
        # front[g] - (1 + 1/layers) loaded[g] + const: a prefix minimum. Beyond it,
        # front[g] - loaded[g]/layers + const over the window (split, k], whose ends only
        # move right as k grows: a monotonic deque.
        over = [f - (1 + inv) * ld for f, ld in zip(front, loaded, strict=True)]
        under = [f - ld * inv for f, ld in zip(front, loaded, strict=True)]
        prefix_best, best_so_far = [], e
        for g in range(len(over)):
            if g >= e and over[g] < over[best_so_far]:
                best_so_far = g
            prefix_best.append(best_so_far)
        window: collections.deque[int] = collections.deque()
        added = e  # next g to push into the window
        for k in ks:
            split = bisect.bisect_right(loaded, loaded[k] + run_s - tail[k], e, k + 1) - 1
            while added <= k:
                while window and under[window[-1]] >= under[added]:
                    window.pop()
                window.append(added)
                added += 1
            while window and window[0] <= split:
                window.popleft()
            for g in (prefix_best[split] if split >= e else -1, window[0] if window else -1):
                if g >= e:
                    load = loaded[k] + run_s - loaded[g]
                    total = front[g] + (load if load > tail[k] else tail[k]) + load * inv
                    if total < best_total:
                        best_total, best_g, best_k = total, g, k
    recompute_all = split_cost(req, arr, e, e)
    fetch_all = split_cost(req, arr, e, arr.cached_end)
    if best_k == best_g:  # nothing fetched: everything after the engine's is recomputed
        best_g = best_k = e
    return Plan(
        overlap=req.overlap,
        total_s=best_total,
        engine_blocks=e,
        fetch_start=best_g,
        fetch_end=best_k,
        recompute_all_s=recompute_all,
        fetch_all_s=fetch_all,
        reason=_reason(
            req.overlap,
            e,
            best_g,
            best_k,
            arr.cached_end,
            n,
            best_total,
            recompute_all,
            fetch_all,
            req.family,
        ),
        _req=req,
        _arrays=arr,
    )


def _best_prefix(req: PlanRequest, arr: _Arrays) -> tuple[float, int]:
    """(total, k) of the cheapest split with g = E: every k in E..cached_end priced at once
    (k = E is recompute-all, and the first k holding the least total wins, so a tie goes
    to fetching less, as in the other searches). The same formulas as `split_cost`."""
    e = arr.engine
    load = arr.loaded_np[e:] - arr.loaded_np[e]
    load[1:] += req.run_latency_s  # k = E fetches nothing
    tail = arr.tail_np[e:]
    front = arr.front_np[e]  # recompute [E, E): 0
    if req.overlap == "none":
        totals = front + load + tail
    elif req.overlap == "layerwise":
        totals = front + np.maximum(load, tail) + load / req.layers
    else:
        totals = np.maximum(front + tail, load + tail / req.layers)
    k = int(np.argmin(totals))
    return float(totals[k]), k + e


def _best_split_none(
    front: np.ndarray,
    loaded: np.ndarray,
    tail: np.ndarray,
    e: int,
    recompute_all_s: float,
    run_s: float = 0.0,
) -> tuple[float, int, int]:
    """(total, g, k) of the cheapest split with k > e under overlap "none", or
    (recompute_all_s, e, e) when none beats it; the arrays start at boundary e. The same
    choices, ties included, as scanning k upwards with a running prefix minimum."""
    x = front - loaded
    prefix_min = np.minimum.accumulate(x)
    new_min = np.empty(len(x), dtype=bool)
    new_min[0] = True
    new_min[1:] = x[1:] < prefix_min[:-1]
    g = np.maximum.accumulate(np.where(new_min, np.arange(len(x)), 0))[1:]
    totals = front[g] + loaded[1:] - loaded[g] + tail[1:]
    if run_s:
        totals += run_s
    k = int(np.argmin(totals))
    if totals[k] < recompute_all_s:
        return float(totals[k]), int(g[k]) + e, k + 1 + e
    return recompute_all_s, e, e


def oracle_total(req: PlanRequest) -> float:
    """The best total by brute force over every split (g, k) in `req.family`: what `plan`
    must equal."""
    arr = _arrays(req)
    return min(
        split_cost(req, arr, g, k)
        for k in range(arr.engine, arr.cached_end + 1)
        for g in (range(arr.engine, k + 1) if req.family == "any" else (arr.engine,))
    )


def _reason(
    overlap: Overlap,
    engine: int,
    g: int,
    k: int,
    cached_end: int,
    n: int,
    total: float,
    recompute_all: float,
    fetch_all: float,
    family: Family = "any",
) -> str:
    # A prefix-only plan says so: a reader comparing it with an "any" plan of the same
    # chain then knows why it did not recompute the front.
    only = "prefix-only plan: " if family == "prefix" else ""
    if k == g:
        return (
            f"{only}recompute all {n - engine} blocks: {recompute_all * 1e3:.1f} ms beats "
            f"fetching the {cached_end - engine} cached ones ({fetch_all * 1e3:.1f} ms)"
        )
    joiner = "while fetching" if overlap == "bidirectional" else "then fetch"
    front = f"recompute {g - engine} front blocks {joiner} " if g > engine else "fetch "
    return (
        f"{only}{front}blocks {g}..{k - 1} of {cached_end - engine} cached, recompute the last "
        f"{n - k}: {total * 1e3:.1f} ms vs fetch-all {fetch_all * 1e3:.1f} ms, "
        f"recompute-all {recompute_all * 1e3:.1f} ms"
    )


def cost_of(req: PlanRequest, fetch_start: int, fetch_end: int) -> float:
    """The total, under `req`'s costs, of a given split (e.g. one planned from estimates)."""
    arr = _arrays(req)
    g = min(max(fetch_start, arr.engine), arr.cached_end)
    k = min(max(fetch_end, g), arr.cached_end)
    return split_cost(req, arr, g, k)
