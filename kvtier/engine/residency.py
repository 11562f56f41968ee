"""Residency: which blocks exist, where each lives, and what to keep where.

The catalog (kvtier/index/catalog.py: copies, pins, byte accounting, residency events)
together with the eviction orders (one per tenant arena, one for the shared NVMe tier),
admission, the NVMe quotas, the ghosts and each block's place in its chain. This is the
only code that changes an `Entry`: the store's flows ask it (`add`, `used`, `pin`,
`dram_victims`, `promoted`, `written`, ...) and get back what they must free or remove;
the drivers never see an entry. Pure: no I/O, no event loop, tested without a daemon.

Lifecycle of an entry here:
    add (a put, a recovered record, a remote fetch) -> visible to lookups
    pin / unpin            -> a pinned entry is never a victim and its memory never reused
    start_move / end_move  -> a demotion or flush in progress: neither a victim nor freed
    dram_victims -> finish_dram_eviction / make_nvme_room / record_failed -> copies go
    remove                 -> gone from lookups; `release` hands back its copies once
                              nothing uses it (the store frees the extent, removes the record)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

from kvtier.engine.results import Counters
from kvtier.index.catalog import Catalog, Entry
from kvtier.index.policy import BlockInfo, Policies, TierPolicy
from kvtier.keys import tenant_of
from kvtier.types import BlockId, Extent, LookupResult, TierName

BlockEvents = Callable[[BlockId, list[TierName]], None]
_DRAM, _NVME = TierName.DRAM, TierName.NVME


@dataclass(frozen=True, slots=True)
class Released:
    """The copies of a removed block that nothing uses any more: free them."""

    extent: Extent | None
    had_record: bool


class Residency:
    def __init__(
        self,
        policies: Policies,
        arena_capacities: dict[str, int],
        nvme_capacity_bytes: int,
        nvme_quota: Callable[[str], int],
        counters: Counters,
        on_change: BlockEvents | None = None,
    ) -> None:
        self.catalog = Catalog(on_change)
        self.policies = policies
        self._counters = counters
        self._nvme_capacity_bytes = nvme_capacity_bytes
        self._nvme_quota = nvme_quota  # 0: no quota (read per call: reloadable)
        self.dram_order: dict[str, TierPolicy] = {
            tenant: policies.new_tier("dram", "nvme", capacity)
            for tenant, capacity in arena_capacities.items()
        }
        self.nvme_order = policies.new_tier("nvme", None, nvme_capacity_bytes)
        # Where each block sits in its chain, learned from the chains engines look up.
        self._infos: dict[BlockId, BlockInfo] = {}
        # NVMe bytes promised to writes in flight (not yet in the catalog), for room.
        self._nvme_reserved_bytes = 0
        self._nvme_reserved_by_tenant: dict[str, int] = {}
        # Records on disk not in the catalog yet (an estimate, while the index fills in the
        # background: engine/recovery.py), counted against the tier's capacity.
        self.nvme_unindexed_bytes = 0
        # Queue prefetch (engine/prefetch.py): blocks announced for waiting requests are
        # DRAM's last victims, and a use of a block is reported to it.
        self.protected: Callable[[BlockId], bool] = _nothing_protected
        self.on_use: Callable[[BlockId], None] | None = None

    # ---- reading --------------------------------------------------------------------------
    def get(self, block_id: BlockId) -> Entry | None:
        return self.catalog.get(block_id)

    def is_live(self, entry: Entry) -> bool:
        return self.catalog.is_live(entry)

    def entries(self) -> Iterator[Entry]:
        return self.catalog.entries()

    def info(self, entry: Entry) -> BlockInfo:
        """What the policy knows of a block; one never looked up as part of a chain is
        valued as if it were first in its chain."""
        return self._infos.get(entry.block_id) or BlockInfo(entry.size_bytes)

    def lookup(self, ns_id: str, keys: list[bytes]) -> LookupResult:
        """Where each key of a chain lives; learns the chain (positions, lost reuse)."""
        found = self.catalog.find(ns_id, keys)
        self._learn_chain(ns_id, keys, found)
        return LookupResult.of(
            [
                None
                if e is None
                else _DRAM
                if e.dram_extent is not None
                else _NVME
                if e.nvme_record_bytes
                else None
                for e in found
            ]
        )

    def dram_entries(self, tenant: str) -> Iterator[Entry]:
        for entry in self.catalog.entries():
            if entry.dram_extent is not None and tenant_of(entry.block_id[0]) == tenant:
                yield entry

    def dram_busy(self, tenant: str, arena_used_bytes: int) -> bool:
        """Whether some of `tenant`'s arena will free up by itself: bytes reserved for
        puts in flight (used beyond what the catalog holds), or blocks in use."""
        catalogued = 0
        for entry in self.dram_entries(tenant):
            if entry.pins or entry.demoting:
                return True
            assert entry.dram_extent is not None
            catalogued += entry.dram_extent.size_bytes
        return arena_used_bytes > catalogued

    def evictable(self, block_id: BlockId) -> bool:
        entry = self.catalog.get(block_id)
        return entry is not None and entry.pins == 0 and not entry.demoting

    # ---- uses -----------------------------------------------------------------------------
    def add(self, entry: Entry) -> None:
        """A new block: a put, a fetch from the remote tier (in DRAM), or a record
        recovered at start (on NVMe only; no use counted)."""
        self.catalog.add(entry)
        info = self.info(entry)
        if entry.dram_extent is not None:
            self.policies.accessed(entry.block_id, info)
            self.dram_order[tenant_of(entry.block_id[0])].insert(entry.block_id, info)
        if entry.nvme_record_bytes:
            self.nvme_order.insert(entry.block_id, info)

    def used(self, entry: Entry) -> None:
        """A block was asked for and is here."""
        if self.on_use is not None:
            self.on_use(entry.block_id)
        self.policies.accessed(entry.block_id, self.info(entry))
        if entry.dram_extent is not None:
            self.dram_order[tenant_of(entry.block_id[0])].hit(entry.block_id)
        if entry.nvme_record_bytes:
            self.nvme_order.hit(entry.block_id)

    def missed(self, block_id: BlockId) -> None:
        self._counters.misses += 1
        if self.policies.ghosts.take(block_id):
            self._counters.lost_reuse += 1

    @staticmethod
    def pin(entry: Entry) -> None:
        Catalog.pin(entry)

    def unpin(self, entry: Entry) -> Released | None:
        """Let go of a pin; the block's copies if that was the last use of a removed one."""
        Catalog.unpin(entry)
        return self.release(entry)

    def start_move(self, entry: Entry) -> bool:
        """Claim a DRAM-only block to write it to NVMe (a flush, write-through); False if
        it is gone, already moving or already there."""
        if not self.catalog.is_live(entry) or entry.demoting or entry.nvme_record_bytes:
            return False
        entry.demoting = True
        return True

    @staticmethod
    def end_move(entry: Entry) -> None:
        entry.demoting = False

    def set_in_remote(self, entry: Entry, held: bool) -> None:
        """This node put it in (or is putting it in) the remote tier: an eviction need not
        put it again."""
        entry.in_remote = held

    # ---- copies come and go ---------------------------------------------------------------
    def promoted(self, entry: Entry, extent: Extent) -> None:
        """An NVMe-only block was read into `extent` of its arena."""
        self.catalog.set_dram(entry, extent)
        if self.catalog.is_live(entry):
            self.dram_order[tenant_of(entry.block_id[0])].insert(entry.block_id, self.info(entry))
        self._counters.promotions += 1

    def written(self, entry: Entry, record_bytes: int) -> None:
        """A block's record reached NVMe."""
        self.catalog.set_nvme(entry, record_bytes)
        if self.catalog.is_live(entry):
            self.nvme_order.insert(entry.block_id, self.info(entry))

    def dram_victims(self, tenant: str, shortfall_bytes: int, most: int) -> list[Entry]:
        """Blocks to evict from `tenant`'s arena for `shortfall_bytes` (at least one: free
        bytes may be too fragmented to use), at most `most`; each is claimed (demoting)
        until `finish_dram_eviction`."""
        victims: list[Entry] = []
        freed = 0
        order = self.dram_order[tenant]
        while (freed < shortfall_bytes or not victims) and len(victims) < most:
            block_id = cast(BlockId | None, order.victim(self._unprotected_key))
            if block_id is None:
                # Protection is a preference, never why a put or read finds no room.
                block_id = cast(BlockId | None, order.victim(self._evictable_key))
            if block_id is None:
                break
            entry = self.catalog.get(block_id)
            if entry is None or entry.dram_extent is None:
                continue  # stale: the policy's view lagged the catalog
            victims.append(entry)
            freed += entry.dram_extent.size_bytes
        for entry in victims:
            entry.demoting = True
        return victims

    def finish_dram_eviction(self, entry: Entry) -> tuple[Extent | None, Released | None]:
        """A victim's demotion (if any) is over: drop its DRAM copy unless a reader pinned
        it meanwhile (then it stays, now perhaps also on NVMe, and None is returned).
        Returns the extent to free and, for a removed block, its copies."""
        entry.demoting = False
        if entry.pins:
            if self.catalog.is_live(entry):
                self.dram_order[tenant_of(entry.block_id[0])].insert(
                    entry.block_id, self.info(entry)
                )
            return None, None
        self._counters.evictions["dram"] += 1
        live = self.catalog.is_live(entry)
        extent = self.catalog.drop_dram(entry)
        if live and not self.catalog.is_live(entry):
            self._counters.eviction_reasons["dram", "dropped"] += 1
            self._dropped(entry)
        else:
            self._counters.eviction_reasons["dram", "demoted"] += 1
        return extent, self.release(entry)

    def reserve_nvme(self, entry: Entry, need_bytes: int) -> tuple[bool, list[Entry]]:
        """Room on NVMe for `need_bytes` of a write of `entry`, held until `unreserve_nvme`:
        first within its tenant's quota (evicting its own blocks), then in the shared tier
        (evicting anyone's, by the policy). Returns whether there is room, and the blocks
        whose records were dropped trying (the store removes them from disk either way)."""
        tenant = tenant_of(entry.block_id[0])
        room, dropped = self.make_nvme_room(need_bytes, tenant)
        if room:
            self._nvme_reserved_bytes += need_bytes
            self._nvme_reserved_by_tenant[tenant] = (
                self._nvme_reserved_by_tenant.get(tenant, 0) + need_bytes
            )
        return room, dropped

    def unreserve_nvme(self, entry: Entry, need_bytes: int) -> None:
        tenant = tenant_of(entry.block_id[0])
        self._nvme_reserved_bytes -= need_bytes
        self._nvme_reserved_by_tenant[tenant] -= need_bytes

    def make_nvme_room(
        self, need_bytes: int, tenant: str | None = None
    ) -> tuple[bool, list[Entry]]:
        """Evict NVMe records until `need_bytes` more fit (see `reserve_nvme`)."""
        dropped: list[Entry] = []
        capacity = self._nvme_capacity_bytes
        quota = self._nvme_quota(tenant) if tenant is not None else 0
        if need_bytes > capacity or (quota and need_bytes > quota):
            return False, dropped
        if quota:
            assert tenant is not None

            def own(block_id: BlockId) -> bool:
                return self.evictable(block_id) and tenant_of(block_id[0]) == tenant

            used = self.catalog.nvme_used_by_tenant
            reserved = self._nvme_reserved_by_tenant.get(tenant, 0)
            while used[tenant] + reserved + need_bytes > quota:
                if not self._evict_nvme(own, dropped):
                    return False, dropped
        unindexed = self.nvme_unindexed_bytes
        if unindexed and self._nvme_reserved_bytes + unindexed + need_bytes > capacity:
            return False, dropped  # no room even with every indexed record evicted
        while self.catalog.nvme_used_bytes + self._nvme_reserved_bytes + unindexed + need_bytes > (
            capacity
        ):
            if not self._evict_nvme(self.evictable, dropped):
                return False, dropped
        return True, dropped

    def _evict_nvme(self, evictable: Callable[[BlockId], bool], dropped: list[Entry]) -> bool:
        """Drop one NVMe record chosen by the policy; False when none may go."""
        while True:
            block_id = cast(
                BlockId | None, self.nvme_order.victim(lambda k: evictable(cast(BlockId, k)))
            )
            if block_id is None:
                return False
            victim = self.catalog.get(block_id)
            if victim is None or not victim.nvme_record_bytes:
                continue
            self.catalog.drop_nvme(victim)
            self._counters.evictions["nvme"] += 1
            self._counters.eviction_reasons["nvme", "capacity"] += 1
            if not self.catalog.is_live(victim):
                self._dropped(victim)
            dropped.append(victim)
            return True

    def record_failed(self, entry: Entry, transient: bool) -> bool:
        """Reading a block's record failed: checksum or missing file (`transient` False),
        or an I/O error (True: kept until it has failed READ_ERRORS_BEFORE_DROP times).
        True when the record is dropped (the store removes it from disk)."""
        if transient:
            entry.read_errors += 1
            if entry.read_errors < READ_ERRORS_BEFORE_DROP:
                return False
        if self.catalog.is_live(entry) and entry.nvme_record_bytes:
            self.catalog.drop_nvme(entry)
            self._counters.eviction_reasons["nvme", "corrupt"] += 1
            self.nvme_order.remove(entry.block_id)
            if not self.catalog.is_live(entry):
                self._counters.dropped_blocks += 1
                self._forget(entry)
        return True

    def remove(self, entry: Entry) -> Released | None:
        """Out of lookups now (a delete, an overwrite); its copies if nothing uses it."""
        self.catalog.remove(entry)
        self._forget(entry)
        return self.release(entry)

    def release(self, entry: Entry) -> Released | None:
        """A removed block's copies, once nothing uses it (handed over once)."""
        if not entry.doomed or entry.pins or entry.demoting:
            return None
        extent, entry.dram_extent = entry.dram_extent, None
        had_record, entry.nvme_record_bytes = bool(entry.nvme_record_bytes), 0
        if extent is None and not had_record:
            return None
        return Released(extent, had_record)

    # ---- chains and ghosts ------------------------------------------------------------------
    def _learn_chain(self, ns_id: str, keys: list[bytes], found: list[Entry | None]) -> None:
        """A chain an engine asked about: where each cached block sits in it (on every
        Plan, so the common case — nothing changed since the last one — is a dict probe)."""
        last = len(keys) - 1
        if len(set(keys)) != len(keys):
            # A chain that names a block twice is not a chain past that point: a block
            # must never become its own ancestor (the policy walks parents).
            seen: set[bytes] = set()
            for i, key in enumerate(keys):
                if key in seen:
                    keys, found = keys[:i], found[:i]
                    break
                seen.add(key)
        infos, ghosts = self._infos, self.policies.ghosts
        parent: BlockId | None = None
        for i, entry in enumerate(found):
            if entry is None or (entry.dram_extent is None and not entry.nvme_record_bytes):
                block_id = (ns_id, keys[i])
                if ghosts.take(block_id):
                    self._counters.lost_reuse += 1
            else:
                block_id = entry.block_id
                known = infos.get(block_id)
                if known is None or known.position != i or known.from_end != last - i:
                    infos[block_id] = BlockInfo(entry.size_bytes, i, parent, last - i)
            parent = block_id

    def _dropped(self, entry: Entry) -> None:
        """Evicted from every tier: remember the key to count reuse lost to it."""
        self._counters.dropped_blocks += 1
        self.policies.ghosts.add(entry.block_id)
        self._forget(entry)

    def _forget(self, entry: Entry) -> None:
        self.dram_order[tenant_of(entry.block_id[0])].remove(entry.block_id)
        self.nvme_order.remove(entry.block_id)
        self._infos.pop(entry.block_id, None)

    def _evictable_key(self, key: object) -> bool:
        return self.evictable(cast(BlockId, key))

    def _unprotected_key(self, key: object) -> bool:
        return self.evictable(cast(BlockId, key)) and not self.protected(cast(BlockId, key))


def _nothing_protected(block_id: BlockId) -> bool:
    return False


READ_ERRORS_BEFORE_DROP = 3
