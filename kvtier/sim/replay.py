"""A request trace through the real catalog, policy and planner (`kvtier replay TRACE.jsonl`,
whose flags, tables and plots are kvtier/bench/replay_cli.py).

A simulated clock and no bytes: each request of a Mooncake-format trace (`timestamp` ms,
`input_length`, `output_length`, `hash_ids` = chained ids of 512-token blocks) is
1. looked up in the catalog: which of its blocks each tier holds (a miss on a recently
   dropped block counts as lost reuse);
2. planned: the planner decides, with the path costs and the model's prefill profile,
   which cached blocks are worth fetching; `recompute-all − plan total` is the prefill
   time the cache saved (a hit the planner would not fetch saves nothing);
3. written back: every block of the prompt is now in the engine, so the ones kvtier lacks
   are put into DRAM and NVMe-only ones promoted, evicting by the policy; blocks leaving
   DRAM go to NVMe if admission lets them (bytes written counted), blocks leaving the
   last tier become ghosts.

Policies: `lru`, `s3fifo`, `kvtier` (kvtier/index/policy.py) and `oracle`: Belady with
the future known (evict the block used again farthest in the future, among the farthest
few the one saving least; admit to NVMe only blocks used again), the upper bound.

In a fleet (kvtier/sim/fleet.py) a node may also have a `RemoteTier` behind its NVMe,
shared with the other nodes: blocks it lacks but the remote holds are planned as tier
`remote` at the remote path's cost, fetched ones are then stored locally like any other,
and blocks it prefilled are written through to the remote.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from kvtier.index.catalog import Catalog, Entry, TierName
from kvtier.index.planner import Overlap, PlanRequest, PrefillCost, TierCost, plan
from kvtier.index.policy import (
    AdmissionMode,
    BlockInfo,
    Key,
    Policies,
    TierPolicy,
    ValueModel,
)
from kvtier.index.reclaim import SegmentSpace
from kvtier.profiles import MODELS

# The simulator only decides: its DRAM extents are bookkeeping, so the vocabulary type,
# not the allocator that owns real arenas.
from kvtier.types import Extent

NS = "replay|trace"
NEVER = float("inf")
ORACLE = "oracle"
ORACLE_CANDIDATES = 16
REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class Request:
    timestamp_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: list[int]


def read_trace(path: Path) -> list[Request]:
    requests = []
    with path.open() as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                requests.append(
                    Request(
                        float(row["timestamp"]),
                        int(row["input_length"]),
                        int(row.get("output_length", 0)),
                        [int(h) for h in row["hash_ids"]],
                    )
                )
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{path}:{line_no}: not a trace record (needs timestamp, input_length, "
                    f"hash_ids): {err}"
                ) from None
    return requests


_RECORD_HEADER_BYTES = 4096  # a record's header page (kvtier/tiers/record.py), short keys


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    dram_blocks: int
    nvme_blocks: int
    policy: str = "kvtier"
    admission: AdmissionMode = "selective"
    tokens_per_block: int = 512
    kv_bytes_per_token: int = MODELS["llama3-8b"].kv_bytes_per_token
    prefill: PrefillCost = field(
        default_factory=lambda: PrefillCost(
            MODELS["llama3-8b"].a_s_per_token, MODELS["llama3-8b"].c_s_per_token2
        )
    )
    dram: TierCost = field(default_factory=lambda: TierCost(50e9, 10e-6))
    nvme: TierCost = field(default_factory=lambda: TierCost(7e9, 100e-6))
    # remote -> engine, used only with a RemoteTier: one 100 Gb/s RDMA NIC, effective (as
    # --remote-bandwidth/--remote-latency default); ~6.8 ms a 64 MiB block
    remote: TierCost = field(default_factory=lambda: TierCost(10e9, 50e-6))
    overlap: Overlap = "none"
    gpu_hour_usd: float = 2.0
    samples: int = 200  # points of the over-time series (for --plot)

    @property
    def block_bytes(self) -> int:
        return self.tokens_per_block * self.kv_bytes_per_token


@dataclass(slots=True)
class _TierFigures:
    hits: int = 0
    bytes_read: int = 0


@dataclass(slots=True)
class _Totals:
    block_refs: int = 0
    prefix_hits: int = 0
    tokens_hit: int = 0
    saved_s: float = 0.0
    recompute_all_s: float = 0.0
    regret_s: float = 0.0
    lost_reuse: int = 0
    nvme_bytes_written: int = 0
    promotions: int = 0
    tiers: dict[str, _TierFigures] = field(
        default_factory=lambda: {"dram": _TierFigures(), "nvme": _TierFigures()}
    )


class RemoteTier(Protocol):
    """A tier shared by every node of a fleet, behind this node's NVMe, as this node sees it.

    During `Replay.step`: `holds` for each block the node lacks (readable now?), then
    `read` for each block the plan fetches from it, then `write` for each block the node
    prefilled (write-through). The fleet owns when written blocks become readable."""

    def holds(self, key: bytes) -> bool: ...

    def read(self, key: bytes) -> None: ...

    def write(self, key: bytes) -> None: ...


class _Future:
    """For the oracle: the index of each block's next use after the current request."""

    def __init__(self, requests: list[Request]) -> None:
        self._uses: dict[int, list[int]] = {}
        for index, request in enumerate(requests):
            for block in request.hash_ids:
                self._uses.setdefault(block, []).append(index)
        self._cursor: dict[int, int] = {}
        self.now = 0

    def advance(self, index: int) -> None:
        self.now = index

    def next_use(self, block: int) -> float:
        uses = self._uses.get(block, [])
        i = self._cursor.get(block, 0)
        while i < len(uses) and uses[i] <= self.now:
            i += 1
        self._cursor[block] = i
        return uses[i] if i < len(uses) else NEVER


class OraclePolicy(TierPolicy):
    """Farthest next use first; among the farthest few, the one that saves least."""

    def __init__(self, future: _Future, saving: Callable[[BlockInfo], float]) -> None:
        self._future = future
        self._saving = saving
        self._next: dict[Key, float] = {}
        self._info: dict[Key, BlockInfo] = {}
        self._heap: list[tuple[float, Key]] = []  # (-next use, key)

    def _push(self, key: Key) -> None:
        assert isinstance(key, int)
        nxt = self._future.next_use(key)
        self._next[key] = nxt
        heapq.heappush(self._heap, (-nxt, key))

    def insert(self, key: Key, info: BlockInfo) -> None:
        self._info[key] = info
        self._push(key)

    def hit(self, key: Key) -> None:
        if key in self._info:
            self._push(key)

    def remove(self, key: Key) -> None:
        self._info.pop(key, None)
        self._next.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        candidates: list[tuple[float, Key]] = []
        while self._heap and len(candidates) < ORACLE_CANDIDATES:
            neg_next, key = heapq.heappop(self._heap)
            if self._next.get(key) != -neg_next:
                continue
            if not evictable(key):
                candidates.append((neg_next, key))  # put back below
                continue
            if -neg_next == NEVER:
                for item in candidates:
                    heapq.heappush(self._heap, item)
                self.remove(key)
                return key
            candidates.append((neg_next, key))
        usable = [c for c in candidates if evictable(c[1])]
        if not usable:
            for item in candidates:
                heapq.heappush(self._heap, item)
            return None
        now = self._future.now

        def value_per_request(candidate: tuple[float, Key]) -> float:
            distance = -candidate[0] - now
            # Distance 0: the request being served uses it and has not reached it yet (its
            # next use moves on when it does). Needed now, so the last to go; dividing by
            # it was a ZeroDivisionError whenever DRAM was smaller than a chain.
            if distance <= 0:
                return math.inf
            return self._saving(self._info[candidate[1]]) / distance

        chosen = min(usable, key=value_per_request)
        for item in candidates:
            if item is not chosen:
                heapq.heappush(self._heap, item)
        self.remove(chosen[1])
        return chosen[1]

    def __contains__(self, key: object) -> bool:
        return key in self._info

    def __len__(self) -> int:
        return len(self._info)


class Replay:
    """The two tiers of one daemon (in a fleet, and its view of a shared remote), driven by
    a trace."""

    def __init__(
        self, config: ReplayConfig, requests: list[Request], remote: RemoteTier | None = None
    ) -> None:
        self.config = config
        self.requests = requests
        self.remote = remote
        self.tier_costs = {"dram": config.dram, "nvme": config.nvme}
        if remote is not None:
            self.tier_costs[REMOTE] = config.remote
        self.catalog = Catalog()
        self.model = ValueModel(
            config.tokens_per_block,
            config.kv_bytes_per_token,
            config.prefill,
            {"dram": config.dram, "nvme": config.nvme},
        )
        bb = config.block_bytes
        ghosts = max(config.dram_blocks + config.nvme_blocks, 1)
        # The oracle decides with the future; the rest of its bookkeeping is kvtier's.
        name = "kvtier" if config.policy == ORACLE else config.policy
        self.policies = Policies(name, config.admission, self.model, ghosts)
        self.future: _Future | None = None
        if config.policy == ORACLE:
            self.future = _Future(requests)
            future = self.future
            self.dram: TierPolicy = OraclePolicy(
                future, lambda info: self.model.saving_s("dram", "nvme", info)
            )
            self.nvme: TierPolicy = OraclePolicy(
                future, lambda info: self.model.saving_s("nvme", None, info)
            )
        else:
            self.dram = self.policies.new_tier("dram", "nvme", config.dram_blocks * bb)
            self.nvme = self.policies.new_tier("nvme", None, config.nvme_blocks * bb)
        self.admission = self.policies.admission
        self.ghosts = self.policies.ghosts
        self.totals = _Totals()
        if remote is not None:
            self.totals.tiers[REMOTE] = _TierFigures()
        self.series: list[dict[str, float]] = []
        self._infos: dict[int, BlockInfo] = {}
        # Blocks a waiting request announced (kvtier/sim/queue.py): DRAM evicts others first.
        self.protected: Callable[[int], bool] | None = None
        # The NVMe tier's segment layout, modelled for its write amplification: each block
        # a record (its header page and payload) appended at admission, dead at eviction.
        self.segments: SegmentSpace | None = None
        self._record_bytes = _RECORD_HEADER_BYTES + config.block_bytes
        if config.nvme_blocks > 0:
            self.segments = SegmentSpace.for_store(config.nvme_blocks * self._record_bytes)

    # ---- residency --------------------------------------------------------------------
    @staticmethod
    def _bid(block: int) -> tuple[str, bytes]:
        return NS, block.to_bytes(8, "little")

    def _entry(self, block: int) -> Entry | None:
        return self.catalog.get(self._bid(block))

    def _nvme_admits(self, block: int) -> bool:
        if self.future is not None:
            return self.future.next_use(block) != NEVER
        return self.admission.admit_on_evict(block, self._infos[block])

    def _make_room_nvme(self) -> None:
        while self.catalog.count(TierName.NVME) >= self.config.nvme_blocks:
            victim = self.nvme.victim(lambda k: True)
            if victim is None:  # the order's rules held every block (leaves first)
                victim = self.nvme.last_resort(lambda k: True)
            if victim is None:
                return
            assert isinstance(victim, int)
            entry = self._entry(victim)
            assert entry is not None
            self.catalog.drop_nvme(entry)
            if self.segments is not None:
                self.segments.remove(victim)
            if not self.catalog.is_live(entry):
                self.ghosts.add(victim)

    def _write_nvme(self, block: int, entry: Entry) -> None:
        if self.config.nvme_blocks <= 0:
            return
        self._make_room_nvme()
        self.catalog.set_nvme(entry, self.config.block_bytes)
        self.nvme.insert(block, self._infos[block])
        self.totals.nvme_bytes_written += self.config.block_bytes
        if self.segments is not None:
            self.segments.append(block, self._record_bytes)

    def _may_evict(self, key: Key) -> bool:
        return self.protected is None or not self.protected(cast(int, key))

    def _make_room_dram(self, strict: bool = False) -> bool:
        """Room for one more DRAM block; `strict` (a prefetch): only by evicting unprotected
        blocks, so a prefetch never pushes out what another waiting request asked for."""
        while self.catalog.count(TierName.DRAM) >= self.config.dram_blocks:
            victim = self.dram.victim(self._may_evict)
            if victim is None and self.protected is not None and not strict:
                # Protection is a preference: the prefill being served still gets room.
                victim = self.dram.victim(lambda k: True)
            if victim is None and not strict:  # and so are the order's (leaves first)
                victim = self.dram.last_resort(lambda k: True)
            if victim is None:
                return False
            assert isinstance(victim, int)
            entry = self._entry(victim)
            assert entry is not None
            if not entry.nvme_record_bytes and self._nvme_admits(victim):
                self._write_nvme(victim, entry)
            self.catalog.drop_dram(entry)
            if not self.catalog.is_live(entry):
                self.ghosts.add(victim)
        return True

    def _put_dram(self, block: int, entry: Entry | None, strict: bool = False) -> bool:
        if self.config.dram_blocks <= 0 or not self._make_room_dram(strict):
            return False
        extent = Extent(0, self.config.block_bytes)
        if entry is None or not self.catalog.is_live(entry):
            entry = Entry(self._bid(block), self.config.block_bytes, 0, 0, dram_extent=extent)
            self.catalog.add(entry)
            if self.admission.on_insert and self.future is None:
                self._write_nvme(block, entry)
        else:
            self.catalog.set_dram(entry, extent)
        self.dram.insert(block, self._infos[block])
        return True

    def residency(self, keys: Sequence[bytes]) -> list[str | None]:
        """Per key: the tier this node would fetch it from (its own first, then the
        remote), or None."""
        return self._with_remote(self.catalog.lookup(NS, list(keys)).tiers, keys)

    def _with_remote(self, local: Sequence[str | None], keys: Sequence[bytes]) -> list[str | None]:
        remote = self.remote
        if remote is None:
            return list(local)
        return [
            tier if tier is not None or not remote.holds(key) else REMOTE
            for tier, key in zip(local, keys, strict=True)
        ]

    # ---- one request ----------------------------------------------------------------
    def step(self, index: int, request: Request) -> float:
        """Serve one request; returns its planned prefill seconds (fetch + recompute)."""
        cfg, t = self.config, self.totals
        if self.future is not None:
            self.future.advance(index)
        chain = request.hash_ids
        keys = [self._bid(b)[1] for b in chain]
        local = self.catalog.lookup(NS, keys).tiers
        tiers = self._with_remote(local, keys)
        t.block_refs += len(chain)
        for block, local_tier, tier in zip(chain, local, tiers, strict=True):
            if local_tier is None:
                self.nvme.reached(block, False)
                if self.ghosts.take(block) and tier is None:
                    t.lost_reuse += 1
        prompt_tokens = max(request.input_tokens, 1)
        result = plan(
            PlanRequest(
                prompt_tokens=prompt_tokens,
                tokens_per_block=cfg.tokens_per_block,
                kv_bytes_per_token=cfg.kv_bytes_per_token,
                cached_tiers=tiers,
                tier_costs=self.tier_costs,
                prefill=cfg.prefill,
                overlap=cfg.overlap,
            )
        )
        prefix = next((i for i, tier in enumerate(tiers) if tier is None), len(tiers))
        t.prefix_hits += prefix
        t.tokens_hit += min(prefix * cfg.tokens_per_block, prompt_tokens)
        t.saved_s += result.recompute_all_s - result.total_s
        t.recompute_all_s += result.recompute_all_s
        block_tiers, fetch_s, recompute_s = result.block_costs()
        for i in range(result.fetch_start, result.fetch_end):
            tier = block_tiers[i]
            assert tier is not None
            figures = t.tiers[tier]
            figures.hits += 1
            figures.bytes_read += cfg.block_bytes
            t.regret_s += max(fetch_s[i] - recompute_s[i], 0.0)
            if tier == "nvme":
                self.nvme.reached(chain[i], True)
            elif tier == REMOTE:
                assert self.remote is not None
                self.remote.read(keys[i])
        # The engine now holds the whole prompt: store what is missing, refresh the rest.
        for i, block in enumerate(chain):
            if block not in self._infos:
                parent = chain[i - 1] if i else None
                self._infos[block] = BlockInfo(cfg.block_bytes, i, parent, len(chain) - 1 - i)
            self.policies.accessed(block, self._infos[block])
            prefilled = local[i] is None and not result.fetch_start <= i < result.fetch_end
            if self.remote is not None and prefilled:
                self.remote.write(keys[i])  # write-through
            entry = self._entry(block)
            if entry is None:
                self._put_dram(block, None)
                continue
            if entry.dram_extent is not None:
                self.dram.hit(block)
            if entry.nvme_record_bytes:
                self.nvme.hit(block)
            if entry.dram_extent is None:
                t.promotions += 1
                self._put_dram(block, entry)
        return result.total_s

    def run(self) -> dict[str, Any]:
        every = max(len(self.requests) // max(self.config.samples, 1), 1)
        for index, request in enumerate(self.requests):
            self.step(index, request)
            if index % every == 0 or index == len(self.requests) - 1:
                t = self.totals
                self.series.append(
                    {
                        "t_s": request.timestamp_ms / 1e3,
                        "block_hit_ratio": t.prefix_hits / max(t.block_refs, 1),
                        "dram_blocks": self.catalog.count(TierName.DRAM),
                        "nvme_blocks": self.catalog.count(TierName.NVME),
                    }
                )
        return self.report()

    def report(self) -> dict[str, Any]:
        cfg, t = self.config, self.totals
        gpu_hours = t.saved_s / 3600
        return {
            "policy": cfg.policy,
            "admission": "oracle" if cfg.policy == ORACLE else cfg.admission,
            "requests": len(self.requests),
            "block_refs": t.block_refs,
            "dram_blocks": cfg.dram_blocks,
            "nvme_blocks": cfg.nvme_blocks,
            "block_bytes": cfg.block_bytes,
            "block_hit_ratio": t.prefix_hits / max(t.block_refs, 1),
            "tokens_hit": t.tokens_hit,
            "prefill_seconds_saved": t.saved_s,
            "prefill_seconds_without_cache": t.recompute_all_s,
            "fetch_regret_seconds": t.regret_s,
            "lost_reuse": t.lost_reuse,
            "nvme_bytes_written": t.nvme_bytes_written,
            # nvme.layout "segments": bytes written to segments per byte admitted (None:
            # no NVMe tier)
            "nvme_write_amplification": (
                None if self.segments is None else self.segments.write_amplification
            ),
            "promotions": t.promotions,
            "gpu_hours_saved": gpu_hours,
            "usd_saved": gpu_hours * cfg.gpu_hour_usd,
            "tiers": {
                name: {
                    "hits": f.hits,
                    "hit_ratio": f.hits / max(t.block_refs, 1),
                    "bytes_read": f.bytes_read,
                    # the remote's is the fleet's (kvtier.sim.fleet.SharedRemote)
                    "capacity_blocks": {"dram": cfg.dram_blocks, "nvme": cfg.nvme_blocks}.get(name),
                }
                for name, f in t.tiers.items()
            },
        }


def replay(
    config: ReplayConfig, requests: list[Request]
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    sim = Replay(config, requests)
    report = sim.run()
    return report, sim.series
