from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from kvtier.engine.events import EventLog
from kvtier.index.catalog import BlockId, Catalog, Entry, TierName
from kvtier.tiers.allocator import Extent

NS = "default|m/l"
KEYS = st.binary(min_size=1, max_size=3)


class CatalogMachine(RuleBasedStateMachine):
    """Residency, accounting, victims and lookups stay consistent under any sequence."""

    entries = Bundle("entries")

    def __init__(self) -> None:
        super().__init__()
        self.events = EventLog(keep=1 << 20)
        self.catalog = Catalog(self.events.record)
        self.replayed: dict[BlockId, tuple[TierName, ...]] = {}
        self.offset = 0
        self.generation = 0

    @rule(target=entries, key=KEYS, size=st.integers(1, 10_000))
    def add(self, key: bytes, size: int) -> Entry:
        old = self.catalog.get((NS, key))
        if old is not None:
            self.catalog.remove(old)
        self.generation += 1
        extent = Extent(self.offset, 4096 * (size // 4096 + 1))
        self.offset += extent.size_bytes
        entry = Entry((NS, key), size, 0, self.generation, dram_extent=extent)
        self.catalog.add(entry)
        return entry

    @rule(entry=entries)
    def demote(self, entry: Entry) -> None:
        if self.catalog.is_live(entry) and not entry.nvme_record_bytes:
            self.catalog.set_nvme(entry, entry.size_bytes + 4096)
            self.catalog.drop_dram(entry)

    @rule(entry=entries)
    def pin(self, entry: Entry) -> None:
        Catalog.pin(entry)

    @rule(entry=entries)
    def unpin(self, entry: Entry) -> None:
        if entry.pins:
            Catalog.unpin(entry)

    @rule(entry=entries)
    def drop_nvme(self, entry: Entry) -> None:
        self.catalog.drop_nvme(entry)

    @rule(entry=entries)
    def remove(self, entry: Entry) -> None:
        self.catalog.remove(entry)

    @rule(entry=entries)
    def promote(self, entry: Entry) -> None:
        if self.catalog.is_live(entry) and entry.dram_extent is None:
            self.catalog.set_dram(entry, Extent(self.offset, 4096))
            self.offset += 4096

    @invariant()
    def the_events_replayed_are_the_catalog(self) -> None:
        """What a router rebuilds from the events alone is exactly what the node holds."""
        watcher = self.events.watch(lambda _: True, self.events.epoch, 0)
        for event in watcher.queued(1 << 20):
            if event.tiers:
                self.replayed[event.block_id] = event.tiers
            else:
                self.replayed.pop(event.block_id, None)
        self.events.unwatch(watcher)
        held = {e.block_id: tuple(e.tiers) for e in self.catalog.entries()}
        assert self.replayed == held
        self.replayed = {}  # replayed from 0 each time: the whole history must add up

    @rule(keys=st.lists(KEYS, max_size=6))
    def lookup_is_a_prefix(self, keys: list[bytes]) -> None:
        result = self.catalog.lookup(NS, keys)
        assert len(result.tiers) == len(keys)
        present = [t is not None for t in result.tiers]
        assert all(present[: result.prefix_blocks])
        assert result.prefix_blocks == len(keys) or not present[result.prefix_blocks]
        for key, tier in zip(keys, result.tiers, strict=True):
            entry = self.catalog.get((NS, key))
            assert tier == (entry.fastest_tier.value if entry and entry.fastest_tier else None)

    @invariant()
    def accounting_matches_live_entries(self) -> None:
        live = list(self.catalog.entries())
        assert all(e.tiers for e in live), "an entry with no copy must not be listed"
        dram = sum(e.dram_extent.size_bytes for e in live if e.dram_extent)
        nvme = sum(e.nvme_record_bytes for e in live)
        assert self.catalog.dram_used_bytes == dram
        assert self.catalog.nvme_used_bytes == nvme
        assert self.catalog.count(TierName.DRAM) == sum(1 for e in live if e.dram_extent)
        assert self.catalog.count(TierName.NVME) == sum(1 for e in live if e.nvme_record_bytes)


TestCatalogMachine = CatalogMachine.TestCase
TestCatalogMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
