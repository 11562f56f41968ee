"""Fleet replay: a request trace over N simulated kvtier nodes, under a routing policy.

Each node is a `Replay` (its own DRAM and NVMe tiers and policy) in front of one engine
that prefills one request at a time. A request is routed when it arrives:

- sticky: by conversation (its first block id: every turn of a conversation starts with
  it), hashed to a node, as session-affinity load balancers do;
- round-robin: the next node in turn;
- prefix-aware: `kvtier.index.routing.choose_node` — the node where queue wait + the planner's
  fetch-or-recompute total is smallest.

The request then waits for its node's engine and prefills for the planned total (fetch what
that node holds, recompute the rest); its time to first token is that wait plus that total
(decode is not modelled: it would add the same to every policy). Reported: goodput (the
share of requests whose TTFT meets the SLO), TTFT percentiles, each node's prefill work
and the max/mean of it, the hit ratio and prefill seconds saved, and per-node utilization
over time for the plot.

With a remote tier (`FleetConfig.remote_blocks` > 0): one `SharedRemote` store, LRU over
a block count, behind every node's NVMe. Each block a node prefills is written through to
it and becomes readable to every node when that prefill ends (not before: a node cannot
fetch what another is still computing); a node plans blocks it lacks but the store holds
as tier `remote` at `ReplayConfig.remote`'s cost, and stores what it fetches locally. The
prefix-aware router sees the same residency, so a prefix held remotely is fetchable on
every node. Not modelled: contention for the store's own bandwidth (each node's path is
priced alone), and the nodes' eviction policy does not yet value the remote as a
fallback (a block leaving NVMe is priced as recomputed).
"""

from __future__ import annotations

import statistics
import zlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.index.planner import TierCost
from kvtier.index.routing import NodeState, choose_node
from kvtier.sim.replay import ORACLE, Replay, ReplayConfig, Request

Routing = Literal["sticky", "round-robin", "prefix-aware"]
ROUTINGS: tuple[Routing, ...] = ("sticky", "round-robin", "prefix-aware")


@dataclass(frozen=True, slots=True)
class FleetConfig:
    nodes: int
    routing: Routing
    ttft_slo_s: float = 2.0
    speedup: float = 1.0  # arrivals this many times faster than the trace's
    samples: int = 100  # windows of the utilization series
    remote_blocks: int = 0  # capacity of the shared remote tier (0: no remote tier)
    utilization_window_s: float = 60.0  # how far back a node's busy fraction looks


class SharedRemote:
    """One remote store shared by every node (e.g. Mooncake Store), LRU over a block count.

    Per request: the fleet sets `now_s` (the routing decision at arrival, then the plan at
    the node's start), the serving node's `NodeRemote` asks `holds` and `read`s what its
    plan fetches (refreshing it) and queues its `write`s; once that node's prefill end is
    known the fleet `commit`s them, readable from then on. Never holds more than
    `capacity_blocks`: a commit evicts the least recently written or read first."""

    def __init__(self, capacity_blocks: int, block_bytes: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be > 0")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.now_s = 0.0
        self._ready_s: OrderedDict[bytes, float] = OrderedDict()  # key -> readable from
        self.hits = 0
        self.blocks_written = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._ready_s)

    def holds(self, key: bytes) -> bool:
        ready_s = self._ready_s.get(key)
        return ready_s is not None and ready_s <= self.now_s

    def read(self, key: bytes) -> None:
        self._ready_s.move_to_end(key)
        self.hits += 1

    def commit(self, keys: Sequence[bytes], ready_s: float) -> None:
        """Store `keys` (written through by a node), readable from `ready_s`."""
        for key in keys:
            old_s = self._ready_s.get(key)
            if old_s is None:
                self.blocks_written += 1
            self._ready_s[key] = ready_s if old_s is None else min(old_s, ready_s)
            self._ready_s.move_to_end(key)
        while len(self._ready_s) > self.capacity_blocks:
            self._ready_s.popitem(last=False)
            self.evictions += 1

    def report(self, cost: TierCost) -> dict[str, Any]:
        return {
            "capacity_blocks": self.capacity_blocks,
            "bandwidth_bytes_per_s": cost.bandwidth_bytes_per_s,
            "latency_s": cost.latency_s,
            "hits": self.hits,
            "bytes_read": self.hits * self.block_bytes,
            "blocks_written": self.blocks_written,
            "bytes_written": self.blocks_written * self.block_bytes,
            "evictions": self.evictions,
            "blocks_held": len(self._ready_s),
        }


class NodeRemote:
    """One node's view of the `SharedRemote` (a `kvtier.sim.replay.RemoteTier`): reads
    go through, writes wait in `pending` for the fleet to commit with their ready time."""

    def __init__(self, shared: SharedRemote) -> None:
        self.shared = shared
        self.pending: list[bytes] = []

    def holds(self, key: bytes) -> bool:
        return self.shared.holds(key)

    def read(self, key: bytes) -> None:
        self.shared.read(key)

    def write(self, key: bytes) -> None:
        self.pending.append(key)

    def commit(self, ready_s: float) -> None:
        self.shared.commit(self.pending, ready_s)
        self.pending = []


def sticky_node(request: Request, nodes: int) -> int:
    """The node a session-affinity router pins this conversation to."""
    conversation = request.hash_ids[0] if request.hash_ids else 0
    return zlib.crc32(conversation.to_bytes(8, "little", signed=True)) % nodes


def fleet_replay(
    node_config: ReplayConfig, fleet: FleetConfig, requests: Sequence[Request]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Replay `requests` over `fleet.nodes` nodes; (report, utilization series)."""
    if fleet.nodes <= 0:
        raise ValueError("nodes must be > 0")
    if node_config.policy == ORACLE:
        raise ValueError("the oracle policy needs the whole future of one node; not in a fleet")
    if fleet.routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}")
    if fleet.remote_blocks < 0:
        raise ValueError("remote_blocks must be >= 0")
    cfg = node_config
    shared = SharedRemote(fleet.remote_blocks, cfg.block_bytes) if fleet.remote_blocks else None
    views = [NodeRemote(shared) if shared is not None else None for _ in range(fleet.nodes)]
    sims = [Replay(cfg, list(requests), view) for view in views]
    free_at_s = [0.0] * fleet.nodes
    work_s = [0.0] * fleet.nodes
    busy: list[tuple[int, float, float]] = []  # (node, start, seconds)
    recent: list[deque[tuple[float, float]]] = [deque() for _ in range(fleet.nodes)]
    ttft_s: list[float] = []
    for index, request in enumerate(requests):
        now_s = request.timestamp_ms / 1e3 / fleet.speedup
        if shared is not None:
            shared.now_s = now_s
        if fleet.routing == "sticky":
            node = sticky_node(request, fleet.nodes)
        elif fleet.routing == "round-robin":
            node = index % fleet.nodes
        else:
            states = [
                NodeState(
                    name=str(i),
                    wait_s=max(free_at_s[i] - now_s, 0.0),
                    tier_costs=sim.tier_costs,
                    prefill=cfg.prefill,
                    cached_tiers=sim.residency,
                    load_s=work_s[i],
                    utilization=_busy_fraction(recent[i], now_s, fleet.utilization_window_s),
                )
                for i, sim in enumerate(sims)
            ]
            keys = [Replay._bid(b)[1] for b in request.hash_ids]
            node = int(
                choose_node(
                    states,
                    keys,
                    max(request.input_tokens, 1),
                    cfg.tokens_per_block,
                    cfg.kv_bytes_per_token,
                    cfg.overlap,
                ).node
            )
        start_s = max(now_s, free_at_s[node])
        if shared is not None:
            shared.now_s = start_s  # the node plans when its engine starts the request
        prefill_s = sims[node].step(index, request)
        view = views[node]
        if view is not None:
            view.commit(start_s + prefill_s)
        free_at_s[node] = start_s + prefill_s
        work_s[node] += prefill_s
        busy.append((node, start_s, prefill_s))
        recent[node].append((start_s, start_s + prefill_s))
        ttft_s.append(start_s - now_s + prefill_s)
    report = _report(cfg, fleet, sims, work_s, ttft_s)
    report["remote"] = shared.report(cfg.remote) if shared is not None else None
    return report, _utilization(fleet, busy)


def _busy_fraction(intervals: deque[tuple[float, float]], now_s: float, window_s: float) -> float:
    """Share of the last `window_s` a node's engine spent prefilling (what a router reads
    from a node's metrics); forgets intervals that ended before the window."""
    low_s = now_s - window_s
    while intervals and intervals[0][1] <= low_s:
        intervals.popleft()
    spent_s = sum(max(0.0, min(end, now_s) - max(start, low_s)) for start, end in intervals)
    return spent_s / window_s


def _report(
    cfg: ReplayConfig,
    fleet: FleetConfig,
    sims: list[Replay],
    work_s: list[float],
    ttft_s: list[float],
) -> dict[str, Any]:
    refs = sum(s.totals.block_refs for s in sims)
    hits = sum(s.totals.prefix_hits for s in sims)
    mean_work = statistics.fmean(work_s) if work_s else 0.0
    ordered = sorted(ttft_s)

    def pct(q: float) -> float:
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else 0.0

    return {
        "routing": fleet.routing,
        "nodes": fleet.nodes,
        "policy": cfg.policy,
        "requests": len(ttft_s),
        "speedup": fleet.speedup,
        "ttft_slo_s": fleet.ttft_slo_s,
        "goodput": sum(t <= fleet.ttft_slo_s for t in ttft_s) / max(len(ttft_s), 1),
        "ttft_p50_s": pct(0.5),
        "ttft_p99_s": pct(0.99),
        "block_hit_ratio": hits / max(refs, 1),
        "prefill_seconds_saved": sum(s.totals.saved_s for s in sims),
        "prefill_seconds_without_cache": sum(s.totals.recompute_all_s for s in sims),
        "fetch_regret_seconds": sum(s.totals.regret_s for s in sims),
        "node_prefill_seconds": work_s,
        "load_max_over_mean": max(work_s) / mean_work if mean_work > 0 else 1.0,
        "dram_blocks_per_node": cfg.dram_blocks,
        "nvme_blocks_per_node": cfg.nvme_blocks,
        "tiers": {
            name: {
                "hits": sum(s.totals.tiers[name].hits for s in sims),
                "bytes_read": sum(s.totals.tiers[name].bytes_read for s in sims),
            }
            for name in sims[0].totals.tiers
        },
    }


def _utilization(fleet: FleetConfig, busy: list[tuple[int, float, float]]) -> list[dict[str, Any]]:
    """Per window of the run: each node's busy fraction (its engine prefilling)."""
    if not busy:
        return []
    end_s = max(start + seconds for _, start, seconds in busy)
    width_s = max(end_s / max(fleet.samples, 1), 1e-9)
    windows = [[0.0] * fleet.nodes for _ in range(fleet.samples)]
    last = fleet.samples - 1
    for node, start, seconds in busy:
        stop = start + seconds
        for w in range(min(int(start / width_s), last), min(int(stop / width_s), last) + 1):
            high = stop if w == last else min(stop, (w + 1) * width_s)
            windows[w][node] += max(high - max(start, w * width_s), 0.0)
    return [
        {"t_s": (w + 0.5) * width_s, "busy": [b / width_s for b in row]}
        for w, row in enumerate(windows)
    ]
