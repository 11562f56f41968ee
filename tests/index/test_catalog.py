from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from kvtier.engine.events import EventLog
from kvtier.index.catalog import NO_SLOT, BlockId, Catalog, Entry, TierName
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

    @rule(target=entries, key=KEYS, size=st.integers(1, 10_000))
    def put(self, key: bytes, size: int) -> Entry:
        """A put's block (`add_block`: no Entry made); a key catalogued already is left
        as it is (NO_SLOT)."""
        before = self.catalog.get((NS, key))
        self.generation += 1
        extent = Extent(self.offset, 4096 * (size // 4096 + 1))
        self.offset += extent.size_bytes
        slot = self.catalog.add_block((NS, key), size, 7, self.generation, extent)
        if before is not None and self.catalog.is_live(before):
            assert slot == NO_SLOT
            assert self.catalog.get((NS, key)) is before
            return before
        entry = self.catalog.handle(slot)
        assert (entry.size_bytes, entry.generation, entry.dram_extent) == (
            size,
            self.generation,
            extent,
        )
        assert entry.tiers == [TierName.DRAM] and not entry.nvme_record_bytes
        return entry

    @rule(entry=entries)
    def demote(self, entry: Entry) -> None:
        if self.catalog.is_live(entry) and not entry.nvme_record_bytes:
            self.catalog.set_nvme(entry, entry.size_bytes + 4096)
            self.catalog.drop_dram(entry)

    @rule(entry=entries)
    def claim_and_unclaim(self, entry: Entry) -> None:
        """A DRAM victim's claim, by slot, is the entry's `demoting`, and gives its extent."""
        if not self.catalog.is_live(entry) or entry.demoting:
            return
        claimed = self.catalog.claim(entry.slot)
        if entry.dram_extent is None:
            assert claimed is None and not entry.demoting
            return
        assert claimed == (entry, entry.dram_extent) and entry.demoting
        assert self.catalog.unclaim(entry) == entry.pins and not entry.demoting

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


# ---- the packed catalog against a plain dict --------------------------------------------

NAMESPACES = ("a|m/l", "b|m/l")


def tiny_digest(block_id: BlockId) -> int:
    """Three digests for every key there is: most blocks collide with others."""
    return len(block_id[1]) % 3


class PackedCatalogMachine(RuleBasedStateMachine):
    """Random adds, removes, lookups, pins, dropped handles (so slots are reused) and
    parents named by a tier, on a catalog whose digests nearly always collide, against a
    dict of what each block should be."""

    def __init__(self) -> None:
        super().__init__()
        self.named: set[int] = set()  # slots a tier names as a parent
        self.catalog = Catalog(digest=tiny_digest)
        self.catalog.chain_min_keys = 1  # every chain's probe kept, however short
        self.catalog.holds = self.named.__contains__
        self.model: dict[
            BlockId, tuple[int, int, int, int, int]
        ] = {}  # size, xxh3, gen, dram, nvme
        self.held: list[tuple[Entry, BlockId, tuple[int, int, int]]] = []  # removed, still held
        self.pins: dict[BlockId, int] = {}
        self.generation = 0
        self.chains: list[tuple[str, list[bytes]]] = []

    def _fields(self, entry: Entry) -> tuple[int, int, int, int, int]:
        extent = entry.dram_extent
        return (
            entry.size_bytes,
            entry.xxh3_64,
            entry.generation,
            extent.size_bytes if extent else 0,
            entry.nvme_record_bytes,
        )

    def _check_new_slot(self, slot: int) -> None:
        assert slot not in self.named, "a slot a tier names as a parent was reused"
        assert all(e.slot != slot for e, _, _ in self.held), "a held slot was reused"

    @rule(
        ns=st.sampled_from(NAMESPACES),
        key=KEYS,
        size=st.integers(1, 1 << 40),
        in_dram=st.booleans(),
    )
    def add(self, ns: str, key: bytes, size: int, in_dram: bool) -> None:
        block_id = (ns, key)
        if block_id in self.model:
            return
        self.generation += 1
        xxh3 = hash((block_id, self.generation)) & (2**64 - 1)
        if in_dram:
            entry = Entry(block_id, size, xxh3, self.generation, dram_extent=Extent(0, 4096))
            self.catalog.add(entry)
            slot = entry.slot
            self.model[block_id] = (size, xxh3, self.generation, 4096, 0)
        else:
            slot = self.catalog.add_record(block_id, size, xxh3, self.generation, size + 512)
            self.model[block_id] = (size, xxh3, self.generation, 0, size + 512)
        self._check_new_slot(slot)

    @rule(ns=st.sampled_from(NAMESPACES), key=KEYS, keep=st.booleans(), name_it=st.booleans())
    def remove(self, ns: str, key: bytes, keep: bool, name_it: bool) -> None:
        block_id = (ns, key)
        entry = self.catalog.get(block_id)
        assert (entry is None) == (block_id not in self.model)
        if entry is None:
            return
        if name_it:
            self.named.add(entry.slot)
        self.catalog.remove(entry)
        assert entry.doomed and not self.catalog.is_live(entry)
        del self.model[block_id]
        self.pins.pop(block_id, None)
        if keep:
            self.held.append((entry, block_id, (entry.size_bytes, entry.xxh3_64, entry.generation)))

    @rule(ns=st.sampled_from(NAMESPACES), key=KEYS)
    def drop_copies(self, ns: str, key: bytes) -> None:
        """Dropping every copy takes a block out as remove does."""
        entry = self.catalog.get((ns, key))
        if entry is None:
            return
        self.catalog.drop_dram(entry)
        self.catalog.drop_nvme(entry)
        assert not self.catalog.is_live(entry)
        del self.model[(ns, key)]
        self.pins.pop((ns, key), None)

    @rule(data=st.data())
    def let_go(self, data: st.DataObject) -> None:
        if self.held:
            self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))

    @rule()
    def unname(self) -> None:
        self.named.clear()

    @rule(ns=st.sampled_from(NAMESPACES), key=KEYS)
    def pin(self, ns: str, key: bytes) -> None:
        entry = self.catalog.get((ns, key))
        if entry is not None:
            Catalog.pin(entry)
            self.pins[(ns, key)] = self.pins.get((ns, key), 0) + 1

    @rule(ns=st.sampled_from(NAMESPACES), key=KEYS)
    def unpin(self, ns: str, key: bytes) -> None:
        entry = self.catalog.get((ns, key))
        if entry is not None and self.pins.get((ns, key)):
            Catalog.unpin(entry)
            self.pins[(ns, key)] -= 1

    @rule(ns=st.sampled_from(NAMESPACES), keys=st.lists(KEYS, max_size=6))
    def lookup(self, ns: str, keys: list[bytes]) -> None:
        self.chains.append((ns, keys))
        self._look(ns, keys)

    @rule(data=st.data())
    def lookup_again(self, data: st.DataObject) -> None:
        """A chain asked before, after whatever came and went since (its kept probe)."""
        if self.chains:
            ns, keys = data.draw(st.sampled_from(self.chains))
            self._look(ns, [bytes(bytearray(k)) for k in keys])

    def _look(self, ns: str, keys: list[bytes]) -> None:
        result = self.catalog.lookup(ns, keys)
        # A chain's probe (inlined, or kept and checked) finds what one probe a key finds,
        # colliding or not.
        assert self.catalog.slots_of(ns, keys) == [self.catalog.slot_of((ns, k)) for k in keys]
        for key, tier in zip(keys, result.tiers, strict=True):
            want = self.model.get((ns, key))
            expected = None if want is None else TierName.DRAM if want[3] else TierName.NVME
            assert tier == expected

    @invariant()
    def the_catalog_is_the_model(self) -> None:
        assert len(self.catalog) == len(self.model)
        for block_id, fields in self.model.items():
            entry = self.catalog.get(block_id)
            assert entry is not None and entry.block_id == block_id
            assert entry is self.catalog.get(block_id), "one handle per slot"
            assert self._fields(entry) == fields
            assert entry.pins == self.pins.get(block_id, 0)
            assert self.catalog.is_live(entry)
        listed = {e.block_id for e in self.catalog.entries()}
        assert listed == set(self.model)

    @invariant()
    def a_held_handle_keeps_its_block(self) -> None:
        for entry, block_id, fields in self.held:
            assert entry.block_id == block_id
            assert (entry.size_bytes, entry.xxh3_64, entry.generation) == fields
            assert not self.catalog.is_live(entry)


TestPackedCatalogMachine = PackedCatalogMachine.TestCase
TestPackedCatalogMachine.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None
)


def test_a_freed_slot_is_reused_once_its_handle_is_gone_and_no_tier_names_it() -> None:
    catalog = Catalog()
    named: set[int] = set()
    catalog.holds = named.__contains__
    first = Entry((NS, b"first"), 4096, 1, 1, dram_extent=Extent(0, 4096))
    catalog.add(first)
    slot = first.slot
    catalog.remove(first)
    catalog.add_record((NS, b"second"), 10, 2, 2, 522)
    assert catalog.slot_of((NS, b"second")) != slot, "reused under a live handle"
    named.add(slot)
    del first
    catalog.add_record((NS, b"third"), 10, 3, 3, 522)
    assert catalog.slot_of((NS, b"third")) != slot, "reused while a tier names it"
    named.clear()
    catalog.add_record((NS, b"fourth"), 10, 4, 4, 522)
    assert catalog.slot_of((NS, b"fourth")) == slot
    assert catalog.get((NS, b"fourth")).generation == 4  # type: ignore[union-attr]
    assert catalog.get((NS, b"first")) is None


def test_a_kept_chain_probe_never_answers_for_a_slot_freed_256_times() -> None:
    """A slot's era is one byte: freed 256 times and live again, it reads as it did when a
    chain was probed. The kept probe must not take it for the block it held then."""
    catalog = Catalog()
    catalog.chain_min_keys = 1
    slot = catalog.add_record((NS, b"a"), 10, 1, 1, 522)
    era = catalog.era_of(slot)
    assert catalog.slots_of(NS, [b"a", b"b"]) == [slot, NO_SLOT]
    gone = catalog.get((NS, b"a"))
    assert gone is not None
    catalog.remove(gone)
    del gone
    for i in range(255):
        key = b"x%d" % i
        assert catalog.add_record((NS, key), 10, 1, 1, 522) == slot  # the slot, reused
        gone = catalog.get((NS, key))
        assert gone is not None
        catalog.remove(gone)
        del gone
    assert catalog.add_record((NS, b"c"), 10, 1, 1, 522) == slot
    assert catalog.era_of(slot) == era  # 256 frees: the era came round
    assert catalog.slots_of(NS, [b"a", b"b"]) == [NO_SLOT, NO_SLOT]
    assert catalog.slots_of(NS, [b"c", b"b"]) == [slot, NO_SLOT]


def test_a_kept_chain_probe_finds_blocks_added_and_forgets_blocks_removed() -> None:
    catalog = Catalog()  # chains of 16 keys and more are kept by default
    keys = [b"k%d" % i for i in range(16)]
    slots = [catalog.add_record((NS, k), 10, 1, 1, 522) for k in keys[:4]]
    assert catalog.slots_of(NS, keys) == slots + [NO_SLOT] * 12
    assert len(catalog._chains) == 1
    added = catalog.add_record((NS, keys[5]), 10, 1, 1, 522)
    assert catalog.slots_of(NS, keys) == [*slots, NO_SLOT, added] + [NO_SLOT] * 10
    gone = catalog.get((NS, keys[1]))
    assert gone is not None
    catalog.remove(gone)
    del gone
    again = catalog.add_record((NS, b"other"), 10, 1, 1, 522)  # may take keys[1]'s slot
    assert catalog.slot_of((NS, b"other")) == again
    want = [slots[0], NO_SLOT, slots[2], slots[3], NO_SLOT, added] + [NO_SLOT] * 10
    assert catalog.slots_of(NS, keys) == want
    assert catalog.slots_of(NS, list(keys)) == want  # asked again, nothing changed
    assert catalog.slots_of(NS, keys[:3]) == want[:3] and len(catalog._chains) == 1


def test_colliding_digests_are_told_apart_by_the_full_id() -> None:
    catalog = Catalog(digest=lambda block_id: 7)
    for i in range(50):
        catalog.add_record((NAMESPACES[i % 2], bytes([i])), i + 1, i, i, 600)
    for i in range(50):
        entry = catalog.get((NAMESPACES[i % 2], bytes([i])))
        assert entry is not None and entry.size_bytes == i + 1
        assert catalog.get((NAMESPACES[1 - i % 2], bytes([i]))) is None


def test_columns_and_the_index_grow_without_losing_a_block() -> None:
    """Past several doublings of the columns and splits of the index, with removals and
    reused slots in between, every block reads back as it went in."""
    catalog = Catalog()
    kept: dict[bytes, int] = {}
    for i in range(20_000):
        key = i.to_bytes(4, "little") * (1 + i % 3)
        catalog.add_record((NAMESPACES[i % 2], key), i + 1, i, i, 600 + i)
        kept[key] = i
        if i % 7 == 0:
            gone = (i // 2).to_bytes(4, "little") * (1 + (i // 2) % 3)
            entry = catalog.get((NAMESPACES[(i // 2) % 2], gone))
            if entry is not None:
                catalog.remove(entry)
                del kept[gone]
    assert len(catalog) == len(kept)
    for key, i in kept.items():
        entry = catalog.get((NAMESPACES[i % 2], key))
        assert entry is not None
        assert (entry.size_bytes, entry.xxh3_64, entry.nvme_record_bytes) == (i + 1, i, 600 + i)
    assert catalog.nvme_used_bytes == sum(600 + i for i in kept.values())
