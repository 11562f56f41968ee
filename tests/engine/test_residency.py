"""Residency without a daemon: the one place that changes entries keeps its promises under
any sequence of flows (victims never in use, copies handed back once, quotas, bytes)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from kvtier.engine.residency import (
    BULK_INSERT_MIN,
    READ_ERRORS_BEFORE_DROP,
    Residency,
    new_residency,
)
from kvtier.engine.results import Counters
from kvtier.index.catalog import Entry
from kvtier.index.policy import ValueModel
from kvtier.types import Extent, PrefillCost, TierCost

NS_A = "a|m/l"
NS_B = "b|m/l"
PAGE = 4096


def make(
    policy: str = "lru", nvme_capacity_bytes: int = 1 << 30, quotas: dict[str, int] | None = None
) -> tuple[Residency, Counters]:
    counters = Counters()
    costs = {"dram": TierCost(10e9, 1e-5), "nvme": TierCost(1e9, 1e-4)}
    residency = new_residency(
        policy,
        "write_back",
        ValueModel(0, 1024, PrefillCost(1e-4, 0.0), costs),
        64,
        {"a": 1 << 30, "b": 1 << 30},
        nvme_capacity_bytes,
        lambda tenant: (quotas or {}).get(tenant, 0),
        counters,
    )
    return residency, counters


def put(residency: Residency, ns: str, key: bytes, offset: int, generation: int = 1) -> Entry:
    entry = Entry((ns, key), PAGE, 0, generation, dram_extent=Extent(offset, PAGE))
    residency.add(entry)
    return entry


def test_dram_victims_follow_uses_and_skip_blocks_in_use() -> None:
    residency, _ = make("lru")
    entries = [put(residency, NS_A, bytes([i]), i * PAGE) for i in range(4)]
    residency.used(entries[0])
    residency.pin(entries[1])
    victims = residency.dram_victims("a", 3 * PAGE, most=8)
    assert [v.block_id[1] for v in victims] == [b"\2", b"\3", b"\0"]
    assert all(v.demoting for v in victims)
    # Claimed victims are not handed out twice.
    assert residency.dram_victims("a", PAGE, most=8) == []


def test_a_victim_pinned_during_its_demotion_keeps_its_dram_copy() -> None:
    residency, counters = make()
    entry = put(residency, NS_A, b"k", 0)
    (victim,) = residency.dram_victims("a", PAGE, most=1)
    residency.pin(victim)  # a reader arrived while it was being written out
    extent, released = residency.finish_dram_eviction(victim)
    assert extent is None and released is None and entry.dram_extent is not None
    assert counters.evictions["dram"] == 0
    assert residency.unpin(entry) is None  # still live: nothing to free
    (again,) = residency.dram_victims("a", PAGE, most=1)
    assert again is entry


def test_a_dram_only_victim_is_dropped_and_remembered_as_a_ghost() -> None:
    residency, counters = make()
    entry = put(residency, NS_A, b"k", 0)
    (victim,) = residency.dram_victims("a", PAGE, most=1)
    extent, _ = residency.finish_dram_eviction(victim)
    assert extent == Extent(0, PAGE)
    assert residency.get(entry.block_id) is None
    assert counters.dropped_blocks == 1 and counters.eviction_reasons["dram", "dropped"] == 1
    residency.missed(entry.block_id)
    assert counters.lost_reuse == 1 and counters.misses == 1


def test_a_removed_block_in_use_is_released_once_by_its_last_user() -> None:
    residency, _ = make()
    entry = put(residency, NS_A, b"k", 0)
    residency.written(entry, 2 * PAGE)
    residency.pin(entry)
    residency.pin(entry)
    assert residency.remove(entry) is None
    assert residency.get(entry.block_id) is None
    assert residency.unpin(entry) is None
    released = residency.unpin(entry)
    assert released is not None
    assert released.extent == Extent(0, PAGE) and released.had_record
    assert residency.release(entry) is None  # handed back once only


def test_nvme_room_comes_from_the_tenant_over_its_quota_first() -> None:
    residency, counters = make(nvme_capacity_bytes=8 * PAGE, quotas={"a": 4 * PAGE})
    a_blocks = [put(residency, NS_A, bytes([i]), i * PAGE) for i in range(2)]
    b_blocks = [put(residency, NS_B, bytes([i]), i * PAGE) for i in range(2)]
    for entry in a_blocks + b_blocks:
        residency.written(entry, 2 * PAGE)
    newcomer = put(residency, NS_A, b"new", 10 * PAGE)
    room, dropped = residency.reserve_nvme(newcomer, 2 * PAGE)
    assert room
    assert [e.block_id for e in dropped] == [a_blocks[0].block_id]
    assert all(e.nvme_record_bytes for e in b_blocks)
    assert counters.eviction_reasons["nvme", "capacity"] == 1
    residency.unreserve_nvme(newcomer, 2 * PAGE)
    # More than the quota can never fit, whatever is evicted.
    assert residency.reserve_nvme(newcomer, 5 * PAGE) == (False, [])


def test_a_record_read_error_is_kept_until_it_persists_a_checksum_failure_is_not() -> None:
    residency, counters = make()
    flaky = put(residency, NS_A, b"flaky", 0)
    residency.written(flaky, 2 * PAGE)
    for _ in range(READ_ERRORS_BEFORE_DROP - 1):
        assert not residency.record_failed(flaky, transient=True)
        assert flaky.nvme_record_bytes
    assert residency.record_failed(flaky, transient=True)
    assert not flaky.nvme_record_bytes and flaky.dram_extent is not None
    corrupt = Entry((NS_A, b"corrupt"), PAGE, 0, 2, nvme_record_bytes=2 * PAGE)
    residency.add(corrupt)  # as recovered at start: on NVMe only
    assert residency.record_failed(corrupt, transient=False)
    assert residency.get(corrupt.block_id) is None
    assert counters.eviction_reasons["nvme", "corrupt"] == 2


KEYS = st.binary(min_size=1, max_size=2)


class ResidencyMachine(RuleBasedStateMachine):
    """Any interleaving of puts, uses, pins, evictions, writes and deletes: a block in
    use is never a victim, NVMe never holds more than its capacity, every copy is handed
    back exactly once, and the catalog's bytes are its live entries' bytes."""

    entries = Bundle("entries")

    def __init__(self) -> None:
        super().__init__()
        self.residency, self.counters = make("kvtier", nvme_capacity_bytes=6 * PAGE)
        self.offset = 0
        self.generation = 0
        self.freed: list[Extent] = []

    def _free(self, extent: Extent | None) -> None:
        if extent is not None:
            assert extent not in self.freed, "an extent handed back twice"
            self.freed.append(extent)

    @rule(target=entries, key=KEYS)
    def put(self, key: bytes) -> Entry:
        old = self.residency.get((NS_A, key))
        if old is not None:
            released = self.residency.remove(old)
            if released is not None:
                self._free(released.extent)
        self.generation += 1
        self.offset += PAGE
        return put(self.residency, NS_A, key, self.offset, self.generation)

    @rule(entry=entries)
    def use(self, entry: Entry) -> None:
        if self.residency.is_live(entry):
            self.residency.used(entry)

    @rule(entry=entries)
    def pin(self, entry: Entry) -> None:
        if self.residency.is_live(entry) or entry.pins:
            self.residency.pin(entry)

    @rule(entry=entries)
    def unpin(self, entry: Entry) -> None:
        if entry.pins:
            released = self.residency.unpin(entry)
            if released is not None:
                self._free(released.extent)

    @rule(most=st.integers(1, 3), demote=st.booleans())
    def evict(self, most: int, demote: bool) -> None:
        for victim in self.residency.dram_victims("a", PAGE, most):
            assert victim.pins == 0
            if demote and not victim.nvme_record_bytes:
                room, _ = self.residency.reserve_nvme(victim, 2 * PAGE)
                self.residency.unreserve_nvme(victim, 2 * PAGE) if room else None
                if room:
                    self.residency.written(victim, 2 * PAGE)
            extent, released = self.residency.finish_dram_eviction(victim)
            self._free(extent)
            if released is not None:
                self._free(released.extent)

    @rule(entry=entries)
    def delete(self, entry: Entry) -> None:
        if self.residency.is_live(entry):
            released = self.residency.remove(entry)
            if released is not None:
                self._free(released.extent)

    @precondition(lambda self: self.generation > 0)
    @rule(entry=entries)
    def promote(self, entry: Entry) -> None:
        if self.residency.is_live(entry) and entry.dram_extent is None:
            self.offset += PAGE
            self.residency.promoted(entry, Extent(self.offset, PAGE))

    @rule(keys=st.lists(KEYS, max_size=5))
    def lookup(self, keys: list[bytes]) -> None:
        """Chains teach the value policy parents (leaves go before them)."""
        result = self.residency.lookup(NS_A, keys)
        for key, tier in zip(keys, result.tiers, strict=True):
            entry = self.residency.get((NS_A, key))
            assert tier == (entry.fastest_tier if entry is not None else None)

    @invariant()
    def each_tier_orders_exactly_its_blocks(self) -> None:
        """The packed orders name live blocks of their tier only, and every one that may be
        evicted (a victim being moved is out of its order until it is back)."""
        residency = self.residency
        live = list(residency.entries())
        dram = residency.dram_order["a"]
        nvme = residency.nvme_order
        for entry in live:
            if entry.dram_extent is not None and not entry.demoting:
                assert entry.slot in dram
            if entry.nvme_record_bytes:
                assert entry.slot in nvme
        assert len(dram) <= sum(1 for e in live if e.dram_extent is not None)
        assert len(nvme) == sum(1 for e in live if e.nvme_record_bytes)

    @invariant()
    def nvme_holds_no_more_than_its_capacity(self) -> None:
        assert self.residency.catalog.nvme_used_bytes <= 6 * PAGE

    @invariant()
    def bytes_are_the_live_entries_bytes(self) -> None:
        live = list(self.residency.entries())
        assert all(e.tiers for e in live)
        catalog = self.residency.catalog
        assert catalog.dram_used_bytes == sum(
            e.dram_extent.size_bytes for e in live if e.dram_extent
        )
        assert catalog.nvme_used_bytes == sum(e.nvme_record_bytes for e in live)
        held = {e.dram_extent for e in live if e.dram_extent}
        assert not held & set(self.freed), "a live block's extent was handed back"


TestResidencyMachine = ResidencyMachine.TestCase
TestResidencyMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_a_batch_completion_does_what_one_completion_per_block_does() -> None:
    """`written_many` and `finish_dram_evictions` (the demoter's one pass per batch) leave
    the residency as `written` and `finish_dram_eviction` block by block do: the same
    extents handed back, the same copies released, the same counters, the same blocks on
    NVMe, and the same victims after."""

    def run(batched: bool) -> tuple[object, ...]:
        residency, counters = make("kvtier")
        entries = [put(residency, NS_A, bytes([i]), i * PAGE) for i in range(12)]
        residency.used(entries[3])
        victims = residency.dram_victims("a", 8 * PAGE, most=8)
        residency.pin(victims[1])  # a reader pinned one meanwhile: it keeps its copy
        doomed = victims[2]
        residency.remove(doomed)  # overwritten meanwhile: its copies are released
        sizes = [0 if i == 4 else 2 * PAGE for i in range(len(victims))]  # one not written
        locations = [100 + i for i in range(len(victims))]
        if batched:
            residency.written_many(victims, sizes, locations)
            extents, released = residency.finish_dram_evictions(victims)
        else:
            extents, released = [], []
            for victim, size, location in zip(victims, sizes, locations, strict=True):
                if size:
                    residency.written(victim, size, location)
            for victim in victims:
                extent, gone = residency.finish_dram_eviction(victim)
                if extent is not None:
                    extents.append(extent)
                if gone is not None:
                    released.append((victim, gone))
        after = residency.dram_victims("a", 4 * PAGE, most=4)
        return (
            [v.block_id for v in victims],
            extents,
            [(e.block_id, r) for e, r in released],
            dict(counters.evictions),
            dict(counters.eviction_reasons),
            counters.dropped_blocks,
            sorted((e.block_id, e.nvme_record_bytes, e.nvme_location) for e in residency.entries()),
            [v.block_id for v in after],
        )

    one_by_one, batched = run(False), run(True)
    assert batched == one_by_one
    assert one_by_one[2], "the removed victim's copies were released"
    assert one_by_one[5] == 1, "the victim that was not written was dropped"


@pytest.mark.parametrize("policy", ["kvtier", "lru", "s3fifo"])
def test_a_long_batch_enters_the_nvme_order_as_one_by_one(policy: str) -> None:
    """A demotion batch long enough for `written_many` to insert its unplaced blocks on
    arrays (runs of BULK_INSERT_MIN and more, split by blocks a chain placed) leaves the
    NVMe order as `written` block by block does: NVMe then evicts the same blocks in the
    same order."""
    count = 3 * BULK_INSERT_MIN + 5

    def run(batched: bool) -> list[bytes]:
        residency, _ = make(policy, nvme_capacity_bytes=1 << 40)
        entries = [put(residency, NS_A, b"k%03d" % i, i * PAGE) for i in range(count)]
        # A chain places some (positions and parents) mid-batch; uses vary the priorities.
        residency.lookup(NS_A, [b"k%03d" % i for i in range(20, 26)])
        for i in range(0, count, 7):
            residency.used(entries[i])
        victims = residency.dram_victims("a", count * PAGE, most=count)
        assert len(victims) == count
        residency.remove(victims[5])  # overwritten meanwhile: not catalogued on NVMe
        sizes = [0 if i == 9 else (2 + i % 3) * PAGE for i in range(count)]  # one unwritten
        locations = list(range(count))
        if batched:
            residency.written_many(victims, sizes, locations)
        else:
            for victim, size, location in zip(victims, sizes, locations, strict=True):
                if size:
                    residency.written(victim, size, location)
        residency.finish_dram_evictions(victims)
        _, dropped = residency.make_nvme_room(1 << 40)  # evict every record, in order
        return [e.block_id[1] for e in dropped]

    one_by_one = run(False)
    assert len(one_by_one) == count - 2  # every written, live block was on NVMe
    assert run(True) == one_by_one
