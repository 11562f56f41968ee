"""Residency: which blocks exist, where each lives, and what to keep where.

The catalog (kvtier/index/catalog.py: copies, pins, byte accounting, residency events)
together with the eviction orders (one per tenant arena, one for the shared NVMe tier),
admission, the NVMe quotas, the ghosts and each block's place in its chain. This is the
only code that changes an `Entry`: the store's flows ask it (`add`, `used`, `pin`,
`dram_victims`, `promoted`, `written`, ...) and get back what they must free or remove;
the drivers never see an entry. Pure: no I/O, no event loop, tested without a daemon.

Packed (issue 22): the eviction orders are kvtier/index/packed_policy.py's, over the
catalog's slots, and each block's place in its chain is three arrays by slot, so nothing
here is an object per block. A recovered record goes in by `add_recovered`, no `Entry`.

Lifecycle of an entry here:
    add (a put, a recovered record, a remote fetch) -> visible to lookups
    pin / unpin            -> a pinned entry is never a victim and its memory never reused
    start_move / end_move  -> a demotion or flush in progress: neither a victim nor freed
    dram_victims -> finish_dram_eviction / make_nvme_room / record_failed -> copies go
    remove                 -> gone from lookups; `release` hands back its copies once
                              nothing uses it (the store frees the extent, removes the record)
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.engine.results import Counters
from kvtier.index.catalog import BlockEventRun, Catalog, DramHook, Entry, RecordColumns
from kvtier.index.packed_policies import PackedPolicies
from kvtier.index.policy import AdmissionMode, BlockInfo, ValueModel
from kvtier.index.slot_policy import SlotPolicy, last_victim
from kvtier.index.slots import NO_SLOT, extend, headroom
from kvtier.keys import distinct_prefix, tenant_of
from kvtier.tiers.record import RecordHeader
from kvtier.types import BlockId, Extent, LookupResult, TierName

# A demotion batch's records (up to demoter.BATCH_RECORDS) enter the NVMe order on arrays
# from this many in a run, by `insert_run` below it: `PackedValue.insert_many`'s numpy
# calls (~0.1-0.25 ms a run, by the machine's day) broke even with `insert_run` (~2.7 µs
# a block, a third of one-by-one inserts) at ~32 blocks; at 64, 1.6 µs a block against 2.7.
BULK_INSERT_MIN = 32

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
        policies: PackedPolicies,
        catalog: Catalog,
        arena_capacities: dict[str, int],
        nvme_capacity_bytes: int,
        nvme_quota: Callable[[str], int],
        counters: Counters,
    ) -> None:
        """`policies` must key blocks by `catalog`'s slots (`digest_of=catalog.digest_of`):
        see `new_residency`."""
        self.catalog = catalog
        self.policies = policies
        self._counters = counters
        self._nvme_capacity_bytes = nvme_capacity_bytes
        self._nvme_quota = nvme_quota  # 0: no quota (read per call: reloadable)

        self.dram_order: dict[str, SlotPolicy] = {
            tenant: policies.new_dram_tier(capacity, catalog.digest_of)
            for tenant, capacity in arena_capacities.items()
        }
        self.nvme_order = policies.new_tier("nvme", None, nvme_capacity_bytes)
        self._orders = [*self.dram_order.values(), self.nvme_order]
        # Where each block sits in its chain, learned from the chains engines look up, by
        # slot: position (-1: never seen in a chain), blocks after it, the parent's slot
        # and the parent slot's era then (a parent whose slot was reused is no parent).
        self._pos = array("i")
        self._from_end = array("h")  # at most 32767 (the policies look at 0..3)
        self._parent = array("i")
        self._parent_era = bytearray()
        # The chains learned last, by (namespace, last key): (epoch, last index asked,
        # keys, slots, tiers, as asked; how many of its keys are distinct from the first).
        # A chain seen again with the same slots and tiers while nothing was relearned
        # or reused (the epoch) has nothing to learn: the common re-Plan of a waiting
        # prompt costs a few comparisons, not an array pass.
        self._learned: dict[
            tuple[str, bytes],
            tuple[int, int, tuple[bytes, ...], tuple[int, ...], tuple[object, ...], int],
        ] = {}
        self._learn_epoch = 0
        self._learned_blocks = 0  # keys held by _learned
        catalog.holds = self._named_as_parent
        catalog.on_reuse = self._slot_reused
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

    # ---- chain positions by slot ----------------------------------------------------------
    def _chain_room(self, slot: int) -> None:
        size = len(self._pos)
        if slot < size:
            return
        count = headroom(size, slot + 1) - size
        extend(self._pos, count, -1)
        extend(self._from_end, count, -1)
        extend(self._parent, count, NO_SLOT)
        self._parent_era.extend(bytes(count))

    def _slot_reused(self, slot: int) -> None:
        self._learn_epoch += 1  # a learned chain may name this slot: relearn it
        if slot < len(self._pos):
            self._pos[slot] = -1
            self._from_end[slot] = -1
            self._parent[slot] = NO_SLOT

    def _named_as_parent(self, slot: int) -> bool:
        return any(order.names_as_parent(slot) for order in self._orders)

    def _parent_of(self, slot: int) -> int:
        """The slot of the block before `slot`'s in its chain, if it is still catalogued."""
        if slot >= len(self._pos):
            return NO_SLOT
        parent = self._parent[slot]
        catalog = self.catalog
        if (
            parent == NO_SLOT
            or catalog.era_of(parent) != self._parent_era[slot]
            or not catalog.is_live_slot(parent)
        ):
            return NO_SLOT
        return parent

    def _position(self, slot: int) -> int:
        return max(self._pos[slot], 0) if slot < len(self._pos) else 0

    def _from_end_of(self, slot: int) -> int:
        return self._from_end[slot] if slot < len(self._from_end) else -1

    def _insert(self, order: SlotPolicy, slot: int) -> None:
        order.insert(slot, self.catalog.size_of(slot), self._position(slot), self._parent_of(slot))

    def _accessed(self, slot: int) -> None:
        self.policies.accessed(self.catalog.digest_of(slot), self._from_end_of(slot))

    # ---- reading --------------------------------------------------------------------------
    def get(self, block_id: BlockId) -> Entry | None:
        return self.catalog.get(block_id)

    def contains(self, block_id: BlockId) -> bool:
        """Whether `block_id` is catalogued (no handle made)."""
        return self.catalog.slot_of(block_id) != NO_SLOT

    def is_live(self, entry: Entry) -> bool:
        return self.catalog.is_live(entry)

    def entries(self) -> Iterator[Entry]:
        return self.catalog.entries()

    def info(self, entry: Entry) -> BlockInfo:
        """What the policy knows of a block; one never looked up as part of a chain is
        valued as if it were first in its chain."""
        slot = entry.slot
        if slot == NO_SLOT or slot >= len(self._pos) or self._pos[slot] < 0:
            return BlockInfo(entry.size_bytes)
        parent = self._parent_of(slot)
        return BlockInfo(
            entry.size_bytes,
            self._pos[slot],
            None if parent == NO_SLOT else self.catalog.block_id_of(parent),
            self._from_end[slot],
        )

    def admit_on_evict(self, entry: Entry) -> bool:
        """Whether a block leaving DRAM should be written to NVMe (admission)."""
        return self.policies.admission.admit_on_evict(
            self.catalog.digest_of(entry.slot), self._from_end_of(entry.slot)
        )

    def lookup(self, ns_id: str, keys: list[bytes]) -> LookupResult:
        """Where each key of a chain lives; learns the chain (positions, lost reuse)."""
        return LookupResult.of(self.lookup_chain(ns_id, keys)[1])

    def lookup_chain(
        self, ns_id: str, keys: list[bytes]
    ) -> tuple[list[int], list[TierName | None]]:
        """`lookup`, as each key's slot (NO_SLOT: not cached) and tier."""
        slots = self.catalog.slots_of(ns_id, keys)
        tiers = self.catalog.tiers_of(slots)
        self._learn_chain(ns_id, keys, slots, tiers)
        return slots, tiers

    def dram_entries(self, tenant: str) -> Iterator[Entry]:
        catalog = self.catalog
        for slot in catalog.dram_slots():
            if catalog.has_dram(slot) and catalog.tenant_of_slot(slot) == tenant:
                yield catalog.handle(slot)

    def dram_only_entries(self) -> list[Entry]:
        """The live blocks with a DRAM copy and no record, oldest put first (from the DRAM
        slots: no handle made for the millions of blocks on NVMe)."""
        catalog = self.catalog
        found = [
            catalog.handle(slot)
            for slot in catalog.dram_slots()
            if catalog.is_live_slot(slot) and not catalog.record_bytes_of(slot)
        ]
        found.sort(key=lambda entry: entry.generation)
        return found

    def dram_busy(self, tenant: str, arena_used_bytes: int) -> bool:
        """Whether some of `tenant`'s arena will free up by itself: bytes reserved for
        puts in flight (used beyond what the catalog holds), or blocks in use."""
        catalogued = 0
        catalog = self.catalog
        for slot in catalog.dram_slots():
            if catalog.tenant_of_slot(slot) != tenant:
                continue
            if not catalog.evictable_slot(slot):
                return True
            extent = catalog.handle(slot).dram_extent
            assert extent is not None
            catalogued += extent.size_bytes
        return arena_used_bytes > catalogued

    def evictable(self, block_id: BlockId) -> bool:
        slot = self.catalog.slot_of(block_id)
        return slot != NO_SLOT and self.catalog.evictable_slot(slot)

    # ---- uses -----------------------------------------------------------------------------
    def add(self, entry: Entry) -> None:
        """A new block: a put, a fetch from the remote tier (in DRAM), or a record
        recovered at start (on NVMe only; no use counted)."""
        self.catalog.add(entry)
        slot = entry.slot
        if entry.dram_extent is not None:
            self._accessed(slot)
            self._insert(self.dram_order[self.catalog.tenant_of_slot(slot)], slot)
        if entry.nvme_record_bytes:
            self._insert(self.nvme_order, slot)

    def add_new(
        self,
        block_id: BlockId,
        size_bytes: int,
        xxh3_64: int,
        generation: int,
        extent: Extent,
        published: bool = False,
    ) -> int:
        """`add` of a put's new block (in DRAM), without an `Entry`: its slot, or
        NO_SLOT (nothing added) if the key is catalogued already (`published`: see
        Catalog.add_block)."""
        catalog = self.catalog
        slot = catalog.add_block(block_id, size_bytes, xxh3_64, generation, extent, published)
        if slot == NO_SLOT:
            return slot
        self._accessed(slot)
        self._insert(self.dram_order[catalog.tenant_of_slot(slot)], slot)
        return slot

    def add_recovered(
        self,
        block_id: BlockId,
        size_bytes: int,
        xxh3_64: int,
        generation: int,
        record_bytes: int,
        location: int = 0,
    ) -> None:
        """A record recovered at start: on NVMe only, no use counted, no `Entry` made."""
        slot = self.catalog.add_record(
            block_id, size_bytes, xxh3_64, generation, record_bytes, location
        )
        self._insert(self.nvme_order, slot)

    def add_recovered_many(self, cols: RecordColumns) -> np.ndarray:
        """`add_recovered` of each row in order, in bulk (Catalog.add_records, then the NVMe
        order's insert_many); returns each row's slot, NO_SLOT for a block catalogued
        already (not added)."""
        slots = self.catalog.add_records(cols)
        added = slots[slots >= 0]
        if len(added):
            self.nvme_order.insert_many(
                added, self.catalog.sizes_of(added), self.catalog.digests_of(added)
            )
        return slots

    def records_held(self, headers: Sequence[RecordHeader], locations: Sequence[int]) -> list[bool]:
        """Which of these NVMe records the catalog still holds at those locations (the
        segment layout's reclaim asks before it copies or deletes)."""
        held = self.catalog.holds_record
        return [
            held((h.ns_id, h.key), h.generation, loc)
            for h, loc in zip(headers, locations, strict=True)
        ]

    def records_moved(
        self, headers: Sequence[RecordHeader], old: Sequence[int], new: Sequence[int]
    ) -> list[bool]:
        """Reclaim copied these records: each takes its new location where the catalog
        still has it at the old one."""
        move = self.catalog.move_record
        return [
            move((h.ns_id, h.key), h.generation, o, n)
            for h, o, n in zip(headers, old, new, strict=True)
        ]

    def used(self, entry: Entry) -> None:
        """A block was asked for and is here."""
        if self.on_use is not None:
            self.on_use(entry.block_id)
        slot = entry.slot
        self._accessed(slot)
        if entry.dram_extent is not None:
            self.dram_order[self.catalog.tenant_of_slot(slot)].hit(slot)
        if entry.nvme_record_bytes:
            if entry.dram_extent is None:  # served from NVMe: its order's net counts it
                self.nvme_order.reached(self.catalog.digest_of(slot), True)
            self.nvme_order.hit(slot)

    def missed(self, block_id: BlockId) -> None:
        self._counters.misses += 1
        digest = self.catalog.digest(block_id)
        self.nvme_order.reached(digest, False)
        if self.policies.ghosts.take(digest):
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
            slot = entry.slot
            self._insert(self.dram_order[self.catalog.tenant_of_slot(slot)], slot)
        self._counters.promotions += 1

    def written(self, entry: Entry, record_bytes: int, location: int = 0) -> None:
        """A block's record reached NVMe (at `location`, for the layouts that say)."""
        self.catalog.set_nvme(entry, record_bytes, location)
        if self.catalog.is_live(entry):
            self._insert(self.nvme_order, entry.slot)

    def dram_victims(self, tenant: str, shortfall_bytes: int, most: int) -> list[Entry]:
        """Blocks to evict from `tenant`'s arena for `shortfall_bytes` (at least one: free
        bytes may be too fragmented to use), at most `most`; each is claimed (demoting)
        until `finish_dram_eviction`."""
        victims: list[Entry] = []
        freed = 0
        order = self.dram_order[tenant]
        catalog = self.catalog
        evictable = catalog.evictable_slot
        # With nothing protected (no queue prefetch) the first choice is the fallback's:
        # skip asking, per candidate, for a block id nobody looks at (the same victims).
        first = evictable if self.protected is _nothing_protected else self._unprotected_slot
        claim = catalog.claim
        while (freed < shortfall_bytes or not victims) and len(victims) < most:
            slot = order.victim(first)
            if slot is None and first is not evictable:
                # Protection is a preference, never why a put or read finds no room.
                slot = order.victim(evictable)
            if slot is None:  # nor are the order's own rules (leaves first)
                slot = order.last_resort(evictable)
            if slot is None:
                break
            claimed = claim(slot)  # demoting now: the next victim() must skip it
            if claimed is None:
                continue  # stale: the policy's view lagged the catalog
            entry, extent = claimed
            victims.append(entry)
            freed += extent.size_bytes
        return victims

    def finish_dram_eviction(self, entry: Entry) -> tuple[Extent | None, Released | None]:
        """A victim's demotion (if any) is over: drop its DRAM copy unless a reader pinned
        it meanwhile (then it stays, now perhaps also on NVMe, and None is returned).
        Returns the extent to free and, for a removed block, its copies."""
        entry.demoting = False
        if entry.pins:
            if self.catalog.is_live(entry):
                slot = entry.slot
                self._insert(self.dram_order[self.catalog.tenant_of_slot(slot)], slot)
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

    def finish_dram_evictions(
        self, entries: Sequence[Entry]
    ) -> tuple[list[Extent], list[tuple[Entry, Released]]]:
        """`finish_dram_eviction` for a demotion batch in one pass (its counters added
        once): the extents to free, and the removed blocks' copies to release."""
        catalog, counters = self.catalog, self._counters
        is_live, drop_dram, release = catalog.is_live, catalog.drop_dram, self.release
        unclaim = catalog.unclaim
        extents: list[Extent] = []
        released: list[tuple[Entry, Released]] = []
        evicted = dropped = 0
        for entry in entries:
            if unclaim(entry):  # a reader pinned it meanwhile: it keeps its DRAM copy
                if is_live(entry):
                    slot = entry.slot
                    self._insert(self.dram_order[catalog.tenant_of_slot(slot)], slot)
                continue
            evicted += 1
            live = is_live(entry)
            extent = drop_dram(entry)
            if live and not is_live(entry):
                dropped += 1
                self._dropped(entry)
            if extent is not None:
                extents.append(extent)
            gone = release(entry)
            if gone is not None:
                released.append((entry, gone))
        counters.evictions["dram"] += evicted
        if dropped:
            counters.eviction_reasons["dram", "dropped"] += dropped
        if evicted - dropped:
            counters.eviction_reasons["dram", "demoted"] += evicted - dropped
        return extents, released

    def written_many(
        self, entries: Sequence[Entry], record_bytes: Sequence[int], locations: Sequence[int]
    ) -> None:
        """`written` for a batch's records (record_bytes 0: that one was not written).
        Blocks no chain has placed (position 0, no parent: a stream's, say) go into the
        NVMe order in runs, by `insert_many` where a run is long enough to pay for its
        arrays: the same order as one by one (recording a copy does not touch it)."""
        catalog, order = self.catalog, self.nvme_order
        set_nvme, is_live = catalog.set_nvme, catalog.is_live
        run: list[int] = []
        for entry, size, location in zip(entries, record_bytes, locations, strict=True):
            if not size:
                continue
            set_nvme(entry, size, location)
            if not is_live(entry):
                continue
            slot = entry.slot
            position, parent = self._position(slot), self._parent_of(slot)
            if position or parent != NO_SLOT:
                self._insert_unplaced(run)  # those before it go first, as one by one
                order.insert(slot, catalog.size_of(slot), position, parent)
            else:
                run.append(slot)
        self._insert_unplaced(run)

    def _insert_unplaced(self, slots: list[int]) -> None:
        """Blocks at position 0 with no parent into the NVMe order, in order; `slots` is
        emptied. On arrays (`insert_many`) from BULK_INSERT_MIN of them."""
        order, catalog = self.nvme_order, self.catalog
        if len(slots) >= BULK_INSERT_MIN:
            at = np.array(slots, dtype=np.int64)
            order.insert_many(at, catalog.sizes_of(at), catalog.digests_of(at))
        elif slots:
            order.insert_run(slots, [catalog.size_of(slot) for slot in slots])
        slots.clear()

    def reserve_nvme(self, entry: Entry, need_bytes: int) -> tuple[bool, list[Entry]]:
        """Room on NVMe for `need_bytes` of a write of `entry`, held until `unreserve_nvme`:
        first within its tenant's quota (evicting its own blocks), then in the shared tier
        (evicting anyone's, by the policy). Returns whether there is room, and the blocks
        whose records were dropped trying (the store removes them from disk either way)."""
        tenant = self._tenant(entry)
        room, dropped = self.make_nvme_room(need_bytes, tenant)
        if room:
            self._nvme_reserved_bytes += need_bytes
            self._nvme_reserved_by_tenant[tenant] = (
                self._nvme_reserved_by_tenant.get(tenant, 0) + need_bytes
            )
        return room, dropped

    def unreserve_nvme(self, entry: Entry, need_bytes: int) -> None:
        tenant = self._tenant(entry)
        self._nvme_reserved_bytes -= need_bytes
        self._nvme_reserved_by_tenant[tenant] -= need_bytes

    @staticmethod
    def _tenant(entry: Entry) -> str:
        return tenant_of(entry.block_id[0])

    def make_nvme_room(
        self, need_bytes: int, tenant: str | None = None
    ) -> tuple[bool, list[Entry]]:
        """Evict NVMe records until `need_bytes` more fit (see `reserve_nvme`)."""
        dropped: list[Entry] = []
        capacity = self._nvme_capacity_bytes
        quota = self._nvme_quota(tenant) if tenant is not None else 0
        if need_bytes > capacity or (quota and need_bytes > quota):
            return False, dropped
        catalog = self.catalog
        if quota:
            assert tenant is not None

            def own(slot: int) -> bool:
                return catalog.evictable_slot(slot) and catalog.tenant_of_slot(slot) == tenant

            used = catalog.nvme_used_by_tenant
            reserved = self._nvme_reserved_by_tenant.get(tenant, 0)
            while used[tenant] + reserved + need_bytes > quota:
                if not self._evict_nvme(own, dropped):
                    return False, dropped
        unindexed = self.nvme_unindexed_bytes
        if unindexed and self._nvme_reserved_bytes + unindexed + need_bytes > capacity:
            return False, dropped  # no room even with every indexed record evicted
        while catalog.nvme_used_bytes + self._nvme_reserved_bytes + unindexed + need_bytes > (
            capacity
        ):
            if not self._evict_nvme(catalog.evictable_slot, dropped):
                return False, dropped
        return True, dropped

    def _evict_nvme(self, evictable: Callable[[int], bool], dropped: list[Entry]) -> bool:
        """Drop one NVMe record chosen by the policy; False when none may go."""
        catalog = self.catalog
        while True:
            slot = last_victim(self.nvme_order, evictable)
            if slot is None:
                return False
            if not catalog.is_live_slot(slot) or not catalog.record_bytes_of(slot):
                continue
            victim = catalog.handle(slot)
            catalog.drop_nvme(victim)
            self._counters.evictions["nvme"] += 1
            self._counters.eviction_reasons["nvme", "capacity"] += 1
            if not catalog.is_live(victim):
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
            self.nvme_order.remove(entry.slot)
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
    def _learn_chain(
        self, ns_id: str, keys: list[bytes], slots: list[int], tiers: list[TierName | None]
    ) -> None:
        """A chain an engine asked about: where each cached block sits in it. On every
        Plan, so the common case — the same chain again, nothing relearned or reused
        since — is a few tuple comparisons (`_learned`), and otherwise one array
        comparison over the chain, Python only for the blocks that moved. `tiers`: each
        slot's tier (None: not cached)."""
        if not keys:
            return
        last = len(keys) - 1
        memo_key = (ns_id, keys[-1])
        seen_now = (last, tuple(keys), tuple(slots), tuple(tiers))
        learned = self._learned
        was = learned.pop(memo_key, None)
        if was is not None:
            self._learned_blocks -= len(was[2])
            if was[0] != self._learn_epoch or was[1:5] != seen_now:
                was = None
        # A chain that names a block twice is not a chain past that point: a block must
        # never become its own ancestor (the policy walks parents).
        cut = was[5] if was is not None else distinct_prefix(keys)
        if cut < len(keys):
            keys, slots, tiers = keys[:cut], slots[:cut], tiers[:cut]
        catalog, ghosts, reached = self.catalog, self.policies.ghosts, self.nvme_order.reached
        # An empty ghost table takes nothing, and no block has left every tier for the NVMe
        # order's net to count a miss of: skip a digest per miss.
        if len(ghosts):
            for i in [i for i, t in enumerate(tiers) if t is None]:
                digest = catalog.digest((ns_id, keys[i]))
                reached(digest, False)
                if ghosts.take(digest):
                    self._counters.lost_reuse += 1
        if was is None:
            cached = np.fromiter((t is not None for t in tiers), dtype=bool, count=len(tiers))
            self._learn_positions(last, slots, cached)
            was = (self._learn_epoch, *seen_now, cut)
        learned[memo_key] = was  # now the most recently planned
        self._learned_blocks += len(seen_now[1])
        # Bounded by blocks, not chains (a chain may be max_plan_blocks long).
        while self._learned_blocks > LEARNED_BLOCKS_KEPT:
            oldest = learned.pop(next(iter(learned)))
            self._learned_blocks -= len(oldest[2])

    def _learn_positions(self, last: int, slots: list[int], cached: np.ndarray) -> None:
        """Write each cached block's position, blocks after it (`last`: the chain's last
        index as asked) and parent where they differ from what is learned (bumping the
        epoch when anything is written)."""
        catalog = self.catalog
        n = len(slots)
        where = np.flatnonzero(cached)
        if not len(where):
            return
        slot_np = np.array(slots, dtype=np.int64)
        top = int(slot_np[where].max())
        if top >= len(self._pos):
            self._chain_room(top)
        # The parent of block i is block i-1's slot if that one is cached (else none).
        parent_np = np.full(n, NO_SLOT, dtype=np.int64)
        parent_np[1:] = np.where(cached[:-1], slot_np[:-1], NO_SLOT)
        at = slot_np[where]
        want_pos = where
        want_end = np.minimum(last - where, 0x7FFF)
        want_parent = parent_np[where]
        # Zero-copy views of the position arrays (released on return, before any resize).
        pos_np = np.frombuffer(self._pos, dtype=np.int32)
        end_np = np.frombuffer(self._from_end, dtype=np.int16)
        par_np = np.frombuffer(self._parent, dtype=np.int32)
        moved = (pos_np[at] != want_pos) | (end_np[at] != want_end) | (par_np[at] != want_parent)
        if not moved.any():
            return
        self._learn_epoch += 1
        pos, from_end, parents, parent_eras = (
            self._pos,
            self._from_end,
            self._parent,
            self._parent_era,
        )
        for j in np.flatnonzero(moved).tolist():
            slot, parent = int(at[j]), int(want_parent[j])
            pos[slot] = int(want_pos[j])
            from_end[slot] = int(want_end[j])
            parents[slot] = parent
            if parent != NO_SLOT:
                parent_eras[slot] = catalog.era_of(parent)

    def _dropped(self, entry: Entry) -> None:
        """Evicted from every tier: remember the key to count reuse lost to it."""
        self._counters.dropped_blocks += 1
        self.policies.ghosts.add(self.catalog.digest_of(entry.slot))
        self._forget(entry)

    def _forget(self, entry: Entry) -> None:
        slot = entry.slot
        if slot == NO_SLOT:
            return
        for order in self._orders:
            order.remove(slot)

    def _unprotected_slot(self, slot: int) -> bool:
        catalog = self.catalog
        return catalog.evictable_slot(slot) and not self.protected(catalog.block_id_of(slot))


def _nothing_protected(block_id: BlockId) -> bool:
    return False


READ_ERRORS_BEFORE_DROP = 3
# Keys of the chains remembered for the re-Plan fast path (_learn_chain): ~100 B each.
LEARNED_BLOCKS_KEPT = 1 << 17


def new_residency(
    name: str,
    admission: AdmissionMode,
    model: ValueModel,
    ghost_capacity: int,
    arena_capacities: dict[str, int],
    nvme_capacity_bytes: int,
    nvme_quota: Callable[[str], int],
    counters: Counters,
    on_change: BlockEvents | None = None,
    min_p_reuse: float = 0.1,
    on_dram: DramHook | None = None,
    on_changes: BlockEventRun | None = None,
) -> Residency:
    """A residency over a new packed catalog, its policies keyed by that catalog's slots
    (`on_change`: each block's change of tiers, `on_changes` a run of them with one set;
    `on_dram`: a DRAM copy come or gone)."""
    catalog = Catalog(on_change, on_dram=on_dram, on_changes=on_changes)
    policies = PackedPolicies(
        name,
        admission,
        model,
        ghost_capacity,
        catalog.digest_of,
        min_p_reuse,
    )
    return Residency(policies, catalog, arena_capacities, nvme_capacity_bytes, nvme_quota, counters)
