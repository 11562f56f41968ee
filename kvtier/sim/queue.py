"""The replay with an engine's queue in front of it, and queue prefetch (`kvtier replay
--queue [--prefetch]`).

One node (a `Replay`: the real catalog, policy and planner) behind one engine that
prefills one request at a time, first come first served. Request i arrives at its trace
timestamp divided by `speedup`, waits until the engine is free, then prefills for the
planner's total for it (fetch what the tiers hold, recompute the rest); its time to first
token is that wait plus that total (decode is not modelled: the same for both arms).

With prefetch on, a request announces its chain into a `HintTable` (kvtier/index/hints.py,
the daemon's own) when it arrives, as vLLM's scheduler asks the connector about waiting
requests. One promotion channel then reads the hinted blocks that sit on NVMe only into
DRAM, nearest deadline first, one block at a time at the NVMe path's modelled cost
(latency + bytes / bandwidth): a promotion that has not finished when its request starts
is no help to it. A promotion only takes DRAM from unprotected blocks (a hinted block is
kept for the request waiting for it; the prefill being served may still evict one, as
protection is a preference, never a refusal). A request's hint is dropped when it starts.

Not modelled: the promotions' NVMe reads competing with the engine's own fetches (the
engine's are priced alone, as without prefetch), and remote-tier prefetch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.index.catalog import TierName
from kvtier.index.hints import HintTable
from kvtier.sim.replay import Replay, ReplayConfig, Request


@dataclass(frozen=True, slots=True)
class QueueConfig:
    speedup: float = 1.0  # arrivals this many times faster than the trace's
    prefetch: bool = False
    hint_ttl_s: float = 300.0  # how long an announced chain stays protected, unserved
    max_hints: int = 4096  # waiting requests the hint table tracks (the daemon's bound)
    max_hint_keys: int = 1 << 20


def _pct(ordered: Sequence[float], q: float) -> float:
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else 0.0


class QueueReplay:
    def __init__(
        self, config: ReplayConfig, queue: QueueConfig, requests: Sequence[Request]
    ) -> None:
        if queue.speedup <= 0:
            raise ValueError("speedup must be > 0")
        self.config = config
        self.queue = queue
        self.requests = list(requests)
        self.sim = Replay(config, self.requests)
        self.hints: HintTable[int] = HintTable(queue.max_hints, queue.max_hint_keys)
        self._clock_s = 0.0  # the promotion channel's
        self._in_flight: tuple[int, float] | None = None  # (block, done at)
        self._announced = 0  # requests [0, _announced) have announced their chain
        self._hint_of: dict[int, int] = {}
        self._no_room: set[int] = set()  # promotions refused since the last prefill
        self.promotion_s = config.nvme.fetch_s(config.block_bytes)
        self.prefetched = 0
        self.prefetched_used = 0
        self._prefetched: set[int] = set()
        if queue.prefetch:
            self.sim.protected = lambda block: self.hints.protected(block, self._clock_s)

    def arrival_s(self, index: int) -> float:
        return self.requests[index].timestamp_ms / 1e3 / self.queue.speedup

    # ---- the promotion channel --------------------------------------------------------------
    def _wanted(self, block: int) -> bool:
        if block in self._no_room:
            return False
        entry = self.sim._entry(block)
        return entry is not None and entry.dram_extent is None and bool(entry.nvme_record_bytes)

    def _announce_until(self, until_s: float) -> None:
        while self._announced < len(self.requests) and self.arrival_s(self._announced) <= until_s:
            index = self._announced
            added = self.hints.add(
                self.requests[index].hash_ids, self.arrival_s(index), self.queue.hint_ttl_s
            )
            self._hint_of[index] = added.hint_id
            self._announced += 1

    def _finish(self, block: int) -> None:
        entry = self.sim._entry(block)
        if entry is None or entry.dram_extent is not None or not entry.nvme_record_bytes:
            return  # served, dropped or promoted by a prefill meanwhile
        if not self.hints.protected(block, self._clock_s):
            return  # its request started (or its hint expired) before the read ended
        if self.sim._put_dram(block, entry, strict=True):
            self.prefetched += 1
            self._prefetched.add(block)
        else:
            self._no_room.add(block)

    def _advance(self, until_s: float) -> None:
        """Run the promotion channel up to `until_s` (when the engine takes the next
        request); a read still going on then finishes later."""
        while True:
            if self._in_flight is not None:
                block, done_s = self._in_flight
                if done_s > until_s:
                    return
                self._clock_s = done_s
                self._in_flight = None
                self._finish(block)
            self._announce_until(self._clock_s)
            self.hints.expire(self._clock_s)
            picked = self.hints.to_promote(self._clock_s, self._wanted, 1)
            if picked:
                self._in_flight = (picked[0], self._clock_s + self.promotion_s)
                continue
            if self._announced < len(self.requests):
                next_s = self.arrival_s(self._announced)
                if next_s < until_s:
                    self._clock_s = max(self._clock_s, next_s)
                    continue
            self._clock_s = max(self._clock_s, until_s)
            self._announce_until(until_s)
            return

    # ---- the engine ----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        free_at_s = 0.0
        ttft_s: list[float] = []
        wait_s: list[float] = []
        busy_s = 0.0
        for index, request in enumerate(self.requests):
            arrival = self.arrival_s(index)
            start_s = max(arrival, free_at_s)
            if self.queue.prefetch:
                self._advance(start_s)
                hint_id = self._hint_of.pop(index, 0)
                if hint_id:
                    self.hints.drop(hint_id)  # served now: its blocks are the prefill's
                for block in request.hash_ids:
                    if block in self._prefetched:
                        self._prefetched.discard(block)
                        entry = self.sim._entry(block)
                        if entry is not None and entry.dram_extent is not None:
                            self.prefetched_used += 1
                self._no_room.clear()
            prefill_s = self.sim.step(index, request)
            free_at_s = start_s + prefill_s
            busy_s += prefill_s
            wait_s.append(start_s - arrival)
            ttft_s.append(free_at_s - arrival)
        return self.report(ttft_s, wait_s, busy_s)

    def report(self, ttft_s: list[float], wait_s: list[float], busy_s: float) -> dict[str, Any]:
        base = self.sim.report()
        span_s = max(self.arrival_s(len(self.requests) - 1), 1e-9) if self.requests else 1e-9
        ordered, waits = sorted(ttft_s), sorted(wait_s)
        return {
            **base,
            "speedup": self.queue.speedup,
            "prefetch": self.queue.prefetch,
            "server_busy": busy_s / span_s,
            "ttft_p50_s": _pct(ordered, 0.5),
            "ttft_p99_s": _pct(ordered, 0.99),
            "ttft_mean_s": sum(ttft_s) / max(len(ttft_s), 1),
            "wait_p50_s": _pct(waits, 0.5),
            "wait_p99_s": _pct(waits, 0.99),
            "prefetched_blocks": self.prefetched,
            "prefetched_used": self.prefetched_used,
            "promotion_s_per_block": self.promotion_s,
            "dram_blocks_held": self.sim.catalog.count(TierName.DRAM),
        }


def queue_replay(
    config: ReplayConfig, queue: QueueConfig, requests: Sequence[Request]
) -> dict[str, Any]:
    return QueueReplay(config, queue, requests).run()


def speedup_for_busy(config: ReplayConfig, requests: Sequence[Request], busy: float) -> float:
    """The arrival speedup at which the engine, prefetch off, is busy `busy` of the trace's
    span. Exact: without prefetch what the tiers hold does not depend on timing, so the
    prefill seconds are the plain replay's whatever the arrival rate."""
    if busy <= 0:
        raise ValueError("busy must be > 0")
    if len(requests) < 2:
        return 1.0
    sim = Replay(config, list(requests))
    work_s = sum(sim.step(i, r) for i, r in enumerate(requests))
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1e3
    if work_s <= 0 or span_s <= 0:
        return 1.0
    return busy * span_s / work_s
