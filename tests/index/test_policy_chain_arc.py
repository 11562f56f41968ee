"""DRAM's order (ChainArcPolicy, PackedChainArc): the packed copy decides identically, a
victim is always an evictable leaf, a finished prompt's last block goes first, and the
switches it learns (ARC's target, tails first) move the way their evidence says."""

from __future__ import annotations

import gc
import mmap
import tracemalloc
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index.packed_policy import NO_SLOT, PackedChainArc
from kvtier.index.policy import (
    PROBATION,
    PROTECTED,
    TAIL,
    BlockInfo,
    ChainArcPolicy,
    FrequencySketch,
    Key,
)
from kvtier.index.slots import key_digest
from tests.index.test_packed_policy import Pair, block_id, ops, slot_maps

SIZE = 4096


class _CountByDigest:
    """A sketch as PackedChainArc reads one given it (`count(digest)`), over the keys'
    counts in `sketch`."""

    def __init__(self, sketch: FrequencySketch, keys: dict[int, Key]) -> None:
        self._sketch = sketch
        self._key_of = {key_digest(key): key for key in keys.values()}

    def count(self, digest: int) -> int:
        return self._sketch.count(self._key_of[digest])


def _arc_pair(slot_of: list[int], by_sketch: bool = False) -> Pair:
    """`by_sketch`: the packed order reads uses by the digest it has (a sketch given, as
    PackedPolicies.new_tier does), not through `uses_of`, which then must not be called."""
    sketch = FrequencySketch()
    keys = {slot: block_id(i) for i, slot in enumerate(slot_of)}

    def uses_of(slot: int) -> int:
        assert not by_sketch, "uses_of read although a sketch was given"
        return sketch.count(keys[slot])

    counts = _CountByDigest(sketch, keys) if by_sketch else None
    new = PackedChainArc(uses_of, lambda slot: key_digest(keys[slot]), counts)
    return Pair(ChainArcPolicy(sketch), new, slot_of, sketch)


@settings(max_examples=400, deadline=None)
@given(calls=ops, slot_of=slot_maps, by_sketch=st.booleans())
def test_packed_chain_arc_chooses_the_same_victims(
    calls: list[tuple[Any, ...]], slot_of: list[int], by_sketch: bool
) -> None:
    pair = _arc_pair(slot_of, by_sketch)
    for op in calls:
        pair.run(op)
        old, new = pair.old, pair.new
        assert isinstance(old, ChainArcPolicy) and isinstance(new, PackedChainArc)
        assert old.target == new.target
        assert old.tails_first() == new.tails_first()
        for i, slot in enumerate(slot_of):
            assert old.names_as_parent(block_id(i)) == new.names_as_parent(slot)


# A workload of prompts: each a chain of fresh or repeated ids (a conversation's next turn
# re-sends the previous prompt's full blocks and adds new ones).
prompts = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=60
)  # (conversation, blocks added)


def _serve(
    policy: ChainArcPolicy, sketch: FrequencySketch, capacity: int, workload: list[Any]
) -> list[Key]:
    """Each prompt through a one-tier cache of `capacity` blocks, its last block the
    partial one the next turn rewrites; returns the victims, checking each as it goes."""
    chains: dict[int, list[int]] = {}
    fresh = iter(range(10**6))
    victims: list[Key] = []
    peak = capacity  # the most blocks the tier held
    for conv, added in workload:
        full = chains.setdefault(conv, [])
        chain = [*full, *(next(fresh) for _ in range(added))]
        full[:] = chain[:-1]  # the last block is partial: the next turn rewrites it
        pinned = set(chain)  # the prompt being served holds its blocks
        for position, key in enumerate(chain):
            parent = chain[position - 1] if position else None
            sketch.add(key)
            if key in policy:
                policy.hit(key)
                continue
            while len(policy) >= capacity:
                victim = policy.victim(lambda k, held=pinned: k not in held)
                if victim is None:
                    break
                assert victim not in pinned
                # Only pinned blocks have children here (a prompt pins its whole chain,
                # conversations share no block), so an evictable leaf is always there.
                assert not policy.names_as_parent(victim), "a victim is a leaf"
                victims.append(victim)
            policy.insert(key, BlockInfo(SIZE, position, parent))
            # ARC's target is bounded by what the tier held, which is more than its
            # capacity while a prompt longer than it is pinned (nothing may go).
            peak = max(peak, len(policy))
            assert 0.0 <= policy.target <= peak + 1
    return victims


@settings(max_examples=200, deadline=None)
@given(workload=prompts, capacity=st.integers(4, 30))
def test_victims_are_evictable_leaves_and_the_tier_stays_bounded(
    workload: list[Any], capacity: int
) -> None:
    sketch = FrequencySketch()
    policy = ChainArcPolicy(sketch)
    _serve(policy, sketch, capacity, workload)  # checks the target at every insert


def _put(
    policy: ChainArcPolicy,
    sketch: FrequencySketch,
    key: str,
    position: int = 0,
    parent: str | None = None,
    uses: int = 1,
) -> None:
    for _ in range(uses):
        sketch.add(key)
    policy.insert(key, BlockInfo(SIZE, position, parent))


def _not(*pinned: str) -> Any:
    return lambda key: key not in pinned


def test_with_no_evictable_leaf_the_last_resort_is_the_least_recent_evictable_block() -> None:
    """Leaves first is a preference: blocks that chains disagreeing on their order made
    each other's parent (neither is a leaf), or a parent whose only child is pinned, are
    evicted by `last_resort`, least recent first, when `victim` finds nothing."""
    sketch = FrequencySketch()
    policy = ChainArcPolicy(sketch)
    _put(policy, sketch, "a", 1, "b")  # a chain b, a
    _put(policy, sketch, "b", 1, "a")  # a chain a, b
    assert policy.victim(lambda k: True) is None  # a cycle: no leaf
    assert policy.last_resort(lambda k: True) == "a"
    assert policy.victim(lambda k: True) == "b"  # a leaf now
    _put(policy, sketch, "a")
    _put(policy, sketch, "c", 1, "a")
    assert policy.victim(_not("c")) is None
    assert policy.last_resort(_not("c")) == "a"
    assert policy.last_resort(_not("c")) is None


def test_the_packed_order_has_the_same_last_resort() -> None:
    keys = ["a", "b", "c"]
    sketch = FrequencySketch()
    packed = PackedChainArc(
        lambda slot: sketch.count(keys[slot]), lambda slot: key_digest(keys[slot])
    )
    packed.insert(0, SIZE, 1, 1)  # a, its parent b
    packed.insert(1, SIZE, 1, 0)  # b, its parent a
    assert packed.victim(lambda s: True) is None
    assert packed.last_resort(lambda s: True) == 0
    assert packed.victim(lambda s: True) == 1
    assert len(packed) == 0
    packed.insert(0, SIZE, 0, NO_SLOT)
    packed.insert(2, SIZE, 1, 0)  # c, a's child
    assert packed.victim(lambda s: s != 2) is None
    assert packed.last_resort(lambda s: s != 2) == 0
    assert packed.last_resort(lambda s: s != 2) is None


def test_a_finished_prompts_last_block_goes_before_older_leaves() -> None:
    sketch = FrequencySketch()
    policy = ChainArcPolicy(sketch)
    _put(policy, sketch, "r")  # a prompt r, s: s is the oldest leaf
    _put(policy, sketch, "s", 1, "r")
    _put(policy, sketch, "a0")  # prompt a0 a1 a2 (r's end, s, becomes a tail here)
    _put(policy, sketch, "a1", 1, "a0")
    _put(policy, sketch, "a2", 2, "a1")
    _put(policy, sketch, "b0")  # the next prompt starts: a2, a's last block, is a tail
    assert policy.tails_first()
    assert [policy.victim(_not("b0")) for _ in range(2)] == ["s", "a2"]  # tails, oldest first
    # Then probation's least recently used leaves: r (a leaf once s left), then a1.
    assert policy.victim(_not("b0")) == "r"
    assert policy.victim(_not("b0")) == "a1"


def test_blocks_seen_twice_outlast_blocks_seen_once() -> None:
    sketch = FrequencySketch()
    policy = ChainArcPolicy(sketch)
    _put(policy, sketch, "r", uses=2)
    _put(policy, sketch, "old", 1, "r", uses=2)  # asked for twice: protected
    _put(policy, sketch, "new", 1, "r")
    assert policy.victim(_not("r")) == "new"
    assert policy.victim(_not("r")) == "old"
    assert policy.victim(_not("r")) is None


def test_a_block_back_from_probations_ghosts_gives_probation_room() -> None:
    sketch = FrequencySketch()
    policy = ChainArcPolicy(sketch)
    _put(policy, sketch, "r", uses=2)  # protected, pinned: the chain's root
    _put(policy, sketch, "p", 1, "r", uses=2)  # protected
    _put(policy, sketch, "x", 1, "r")  # probation
    assert policy.victim(_not("r")) == "x"  # target 0: probation goes first
    policy.insert("x", BlockInfo(SIZE, 1, "r"))  # back from probation's ghosts
    assert policy.target == 1.0
    # x is in probation again (still seen once), which now holds no more than its
    # target: the protected block goes.
    assert policy.victim(_not("r")) == "p"
    policy.insert("p", BlockInfo(SIZE, 1, "r"))  # back from protected's ghosts
    assert policy.target == 0.0


def _tail_younger_than_a_leaf(policy: ChainArcPolicy, sketch: FrequencySketch) -> None:
    _put(policy, sketch, "r")
    _put(policy, sketch, "q", 5, "r")  # the deepest block of prompt r
    _put(policy, sketch, "s", 1, "r")  # a shallower leaf, touched after q
    policy.hit("q")  # q touched again: younger than s
    _put(policy, sketch, "a0")  # the next prompt: q is a tail
    assert policy._where["q"] == TAIL and policy._where["s"] == PROBATION


def test_tails_go_first_while_they_do_not_come_back() -> None:
    sketch = FrequencySketch()
    policy = ChainArcPolicy(sketch)
    _tail_younger_than_a_leaf(policy, sketch)
    assert policy.tails_first()
    assert policy.victim(_not("r", "a0")) == "q"


def test_tails_that_come_back_compete_by_age() -> None:
    sketch = FrequencySketch()
    policy = ChainArcPolicy(sketch)
    policy._returns = {TAIL: [10, 9], PROBATION: [10, 0]}  # tails do come back
    _tail_younger_than_a_leaf(policy, sketch)
    assert not policy.tails_first()
    assert policy.victim(_not("r", "a0")) == "s"  # older than the tail q
    assert policy._where["q"] == TAIL and PROTECTED not in policy._where.values()


@given(
    tails=st.tuples(st.integers(0, 50), st.integers(0, 50)),
    probation=st.tuples(st.integers(0, 50), st.integers(0, 50)),
    more=st.integers(1, 20),
)
def test_tails_first_only_while_tails_come_back_less_often(
    tails: tuple[int, int], probation: tuple[int, int], more: int
) -> None:
    policy = ChainArcPolicy(FrequencySketch())
    # [evicted, came back]; came back <= evicted as in a real run
    t = [tails[0] + tails[1], tails[1]]
    p = [probation[0] + probation[1], probation[1]]
    policy._returns = {TAIL: t, PROBATION: p}
    expected = (t[1] + 1) / (t[0] + 2) <= (p[1] + 1) / (p[0] + 2)
    assert policy.tails_first() == expected
    # More tails coming back never switches tails-first on; more probation returns
    # never switches it off.
    before = policy.tails_first()
    t[0] += more
    t[1] += more
    assert policy.tails_first() <= before
    t[0] -= more
    t[1] -= more
    p[0] += more
    p[1] += more
    assert policy.tails_first() >= before


def test_packed_chain_arc_keeps_a_few_bytes_a_block_and_no_object() -> None:
    blocks = 20000
    gc.collect()
    tracemalloc.start()
    try:
        before_objects = len(gc.get_objects())
        before_bytes = tracemalloc.get_traced_memory()[0]
        policy = PackedChainArc(
            lambda slot: 1 + slot % 3, lambda slot: slot * 0x9E3779B97F4A7C15 % 2**64
        )
        for slot in range(blocks):
            policy.insert(slot, SIZE, slot % 64, slot - 1 if slot % 64 else NO_SLOT)
        for _ in range(blocks // 10):
            policy.victim(lambda s: True)
        gc.collect()
        grown_objects = len(gc.get_objects()) - before_objects
        # Per-slot columns live in anonymous mappings (index/slots.py), which tracemalloc
        # does not see: their bytes are counted from the views.
        grown_bytes = tracemalloc.get_traced_memory()[0] - before_bytes + _mapped_bytes(policy)
    finally:
        tracemalloc.stop()
    assert grown_objects < 120  # the columns' mappings and views, none a block
    # 37 bytes a block in the arrays (with their headroom), ~26 in the shadow LRU's
    # digests, ~26 a ghost
    assert grown_bytes < blocks * 70 + blocks // 10 * 30 + 4096


def _mapped_bytes(root: object, depth: int = 3) -> int:
    """Bytes of the mmap-backed columns reachable from `root`'s attributes."""
    seen: set[int] = set()
    total = 0

    def walk(obj: object, left: int) -> None:
        nonlocal total
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, memoryview):
            if isinstance(obj.obj, mmap.mmap):
                total += obj.nbytes
            return
        if left and hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                walk(value, left - 1)
        if left and hasattr(obj, "__slots__"):
            for name in obj.__slots__:
                if hasattr(obj, name):
                    walk(getattr(obj, name), left - 1)

    walk(root, depth)
    return total
