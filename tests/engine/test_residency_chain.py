"""The chain positions a lookup learns (the array fast path) against the per-block scan it
replaced, on the same sequence of puts, evictions and lookups."""

from __future__ import annotations

import types

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvtier.engine.residency import Residency
from kvtier.index.slots import NO_SLOT
from kvtier.types import TierName

from .test_residency import NS_A, PAGE, make, put


def _scan_learn_chain(
    self: Residency,
    ns_id: str,
    keys: list[bytes],
    slots: list[int],
    tiers: list[TierName | None],
) -> None:
    """The scalar loop `_learn_chain` was (its specification)."""
    last = len(keys) - 1
    if len(set(keys)) != len(keys):
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            if key in seen:
                keys, slots = keys[:i], slots[:i]
                break
            seen.add(key)
    catalog, ghosts = self.catalog, self.policies.ghosts
    if slots:
        top = max(slots)
        if top >= len(self._pos):
            self._chain_room(top)
    pos, from_end, parents, parent_eras = (
        self._pos,
        self._from_end,
        self._parent,
        self._parent_era,
    )
    parent = NO_SLOT
    for i, slot in enumerate(slots):
        if slot == NO_SLOT or catalog.tier_of_slot(slot) is None:
            if ghosts.take(catalog.digest((ns_id, keys[i]))):
                self._counters.lost_reuse += 1
            parent = NO_SLOT
            continue
        if pos[slot] != i or from_end[slot] != min(last - i, 0x7FFF) or parents[slot] != parent:
            pos[slot] = i
            from_end[slot] = min(last - i, 0x7FFF)
            parents[slot] = parent
            if parent != NO_SLOT:
                parent_eras[slot] = catalog.era_of(parent)
        parent = slot


ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 15)),
        st.tuples(st.just("evict"), st.integers(1, 3)),
        st.tuples(st.just("lookup"), st.lists(st.integers(0, 15), max_size=20)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops)
# Block 1 keeps its place but changes parent (rarely drawn at random).
@example([("put", 0), ("put", 1), ("put", 2), ("lookup", [0, 1]), ("lookup", [2, 1])])
# A chain seen again after another chain moved its block: relearned, not remembered.
@example([("put", 1), ("put", 2), ("lookup", [0, 1]), ("lookup", [1, 2]), ("lookup", [0, 1])])
def test_learned_positions_and_lost_reuse_match_the_scan(script: list[tuple[str, object]]) -> None:
    fast, fast_counters = make("lru")
    slow, slow_counters = make("lru")
    slow._learn_chain = types.MethodType(_scan_learn_chain, slow)  # type: ignore[method-assign]
    offset = 0
    for op, arg in script:
        for residency in (fast, slow):
            if op == "put":
                key = bytes([arg])  # type: ignore[list-item]
                if residency.get((NS_A, key)) is None:
                    put(residency, NS_A, key, offset)
            elif op == "evict":
                for victim in residency.dram_victims("a", arg * PAGE, most=8):  # type: ignore[operator]
                    residency.finish_dram_eviction(victim)
            else:
                residency.lookup(NS_A, [bytes([i]) for i in arg])  # type: ignore[attr-defined]
        offset += PAGE
        assert fast_counters.lost_reuse == slow_counters.lost_reuse
        # By key, not by slot: when a freed slot is reused depends on when its old handle
        # is collected, which differs between the two residencies.
        assert _learned(fast) == _learned(slow)


def _learned(residency: Residency) -> dict[bytes, tuple[int, int, bytes | None]]:
    """Per live key: its position, blocks after it, and its parent's key (if catalogued)."""
    catalog = residency.catalog
    found: dict[bytes, tuple[int, int, bytes | None]] = {}
    for i in range(16):
        key = bytes([i])
        slot = catalog.slot_of((NS_A, key))
        if slot == NO_SLOT:
            continue
        parent = residency._parent_of(slot)
        found[key] = (
            residency._position(slot),
            residency._from_end_of(slot),
            None if parent == NO_SLOT else catalog.block_id_of(parent)[1],
        )
    return found


def test_a_chain_is_relearned_when_its_block_comes_back_in_a_reused_slot() -> None:
    """The same keys, slots and tiers as last time, but the slot was freed and handed out
    again meanwhile (its position forgotten): the chain must be learned again."""
    import gc

    residency, _ = make("lru")
    key, chain = b"\0", [b"\x09", b"\0"]
    put(residency, NS_A, key, 0)
    residency.lookup(NS_A, chain)
    slot = residency.catalog.slot_of((NS_A, key))
    assert residency._position(slot) == 1
    for victim in residency.dram_victims("a", PAGE, most=8):
        residency.finish_dram_eviction(victim)
    del victim
    gc.collect()
    put(residency, NS_A, key, PAGE)
    assert residency.catalog.slot_of((NS_A, key)) == slot  # the slot was reused
    residency.lookup(NS_A, chain)
    assert residency._position(slot) == 1 and residency._from_end_of(slot) == 0


def test_dram_victims_take_a_protected_leaf_before_a_parent_and_a_parent_last() -> None:
    """The kvtier order evicts leaves; protection is a preference, and so are leaves: a
    protected leaf goes before an unprotected parent, and a parent whose only cached
    child is pinned goes rather than none (a put would wait for room and fail)."""
    residency, _ = make("kvtier")
    parent = put(residency, NS_A, b"p", 0)
    child = put(residency, NS_A, b"c", PAGE)
    residency.lookup(NS_A, [b"p", b"c"])  # c's parent is p
    for entry in (parent, child):  # each leaves the tier and comes back, as promotions
        residency.dram_order["a"].remove(entry.slot)
        residency.dram_order["a"].insert(entry.slot, PAGE, 0, residency._parent_of(entry.slot))
    assert residency.dram_order["a"].names_as_parent(parent.slot)
    residency.protected = lambda block_id: block_id == child.block_id
    (first,) = residency.dram_victims("a", PAGE, most=1)
    assert first is child  # the protected leaf, not the unprotected parent
    residency.finish_dram_eviction(first)
    residency.protected = lambda block_id: False
    again = put(residency, NS_A, b"c", 2 * PAGE, generation=2)
    residency.lookup(NS_A, [b"p", b"c"])
    residency.dram_order["a"].remove(again.slot)
    residency.dram_order["a"].insert(again.slot, PAGE, 1, parent.slot)
    residency.pin(again)
    (last,) = residency.dram_victims("a", PAGE, most=1)
    assert last is parent  # its only child is pinned: no leaf may go, so the parent


def test_nvme_room_is_made_even_when_every_record_is_a_parent() -> None:
    """Two records that chains disagreeing on their order made each other's parent are
    no leaves: the NVMe order's last resort still evicts one for a new record."""
    residency, _ = make("kvtier", nvme_capacity_bytes=4 * PAGE)
    one = put(residency, NS_A, b"1", 0)
    two = put(residency, NS_A, b"2", PAGE)
    for entry in (one, two):
        residency.written(entry, 2 * PAGE)
    order = residency.nvme_order
    for entry, parent in ((one, two), (two, one)):  # each entered again under the other
        order.remove(entry.slot)
        order.insert(entry.slot, PAGE, 1, parent.slot)
    assert order.names_as_parent(one.slot) and order.names_as_parent(two.slot)
    assert order.victim(lambda slot: True) is None
    newcomer = put(residency, NS_A, b"new", 2 * PAGE)
    room, dropped = residency.reserve_nvme(newcomer, 2 * PAGE)
    assert room and [e.block_id for e in dropped] == [one.block_id]  # least recent
    residency.unreserve_nvme(newcomer, 2 * PAGE)
