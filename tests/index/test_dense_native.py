"""The native DRAM order (kvtier/index/_arc_native.c) against the Python pair it stands
for, DenseOrder over PackedChainArc: the same victims, members, parents, ARC target,
safety-net weight and tails-first switch after every call, over random call sequences
(Hypothesis's, and long seeded ones over a sparse range of catalog slots that make every
table grow, reuse freed nodes and, with a coarse digest, collide)."""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index.dense_native import NATIVE, dram_order
from kvtier.index.dense_order import DenseOrder
from kvtier.index.packed_arc import PackedChainArc
from kvtier.index.packed_policies import PackedPolicies
from kvtier.index.packed_policy import NO_SLOT, DigestSketch
from kvtier.index.slot_policy import SlotPolicy
from kvtier.index.slots import key_digest
from tests.index.test_policy_bulk import MODELS

pytestmark = pytest.mark.skipif(
    NATIVE is None and os.environ.get("KVTIER_REQUIRE_NATIVE") != "1",
    reason="kvtier/index/_arc_native.c was not built (no C compiler at install)",
)


class Raised(Exception):
    """What a caller's `evictable` raises in the sequences below."""


class Twins:
    """The Python pair and the native order, fed the same calls and the same sketch."""

    def __init__(self, digest_of: Callable[[int], int]) -> None:
        assert NATIVE is not None, "the native order was not built (KVTIER_REQUIRE_NATIVE=1)"
        self.sketch = DigestSketch()
        self.digest_of = digest_of
        sketch = self.sketch

        def make(own: Callable[[int], int]) -> SlotPolicy:
            return PackedChainArc(lambda s: sketch.count(own(s)), own, sketch)

        self.python = DenseOrder(make, digest_of)
        self.native = NATIVE(digest_of, sketch.count, PackedChainArc.STEP)  # type: ignore[call-arg]
        self.slots: set[int] = set()

    def run(self, op: tuple[Any, ...], every_slot: bool = True) -> None:
        name, *args = op
        if name == "insert":
            slot, size, position, parent = args
            self.slots.update({slot, parent})
            for order in (self.python, self.native):
                order.insert(slot, size, position, parent)
        elif name in ("hit", "remove"):
            for order in (self.python, self.native):
                getattr(order, name)(args[0])
        elif name == "access":
            self.sketch.add(self.digest_of(args[0]))
        else:  # victim or last_resort, refusing `pinned`; raising at the `fail`-th ask
            pinned, fail = args
            results: list[object] = []
            for order in (self.python, self.native):
                asked = [0]

                def evictable(slot: int, asked: list[int] = asked) -> bool:
                    asked[0] += 1
                    if asked[0] == fail:
                        raise Raised
                    return slot not in pinned

                try:
                    results.append(getattr(order, name)(evictable))
                except Raised:
                    results.append(Raised)
            assert results[0] == results[1], op
        self.check(every_slot)

    def check(self, every_slot: bool = True) -> None:
        python, native = self.python, self.native
        arc = python._order
        assert isinstance(arc, PackedChainArc)
        assert len(python) == len(native)
        assert arc.target == native.target  # type: ignore[attr-defined]
        assert arc.weight == native.weight  # type: ignore[attr-defined]
        assert arc.tails_first() == native.tails_first()  # type: ignore[attr-defined]
        for slot in self.slots if every_slot else ():
            assert (slot in python) == (slot in native), slot
            assert python.names_as_parent(slot) == native.names_as_parent(slot), slot
        state = native.state()  # type: ignore[attr-defined]
        assert state["locals"] == len(python._local)
        assert state["shadow"] == len(arc._shadow)
        assert state["ghosts"] == tuple(len(g) for g in arc._ghosts)


KEYS = 14
SLOTS = [3, 0, 7, 1_000_003, 12, 5, 99, 4_000_000, 2, 64, 65, 1 << 30, 11, 8]
calls = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.integers(0, KEYS - 1),
            st.sampled_from([4096, 65536]),
            st.integers(0, 4),
            st.one_of(st.just(None), st.integers(0, KEYS - 1)),
        ),
        st.tuples(st.sampled_from(["hit", "remove", "access"]), st.integers(0, KEYS - 1)),
        st.tuples(
            st.sampled_from(["victim", "victim", "last_resort"]),
            st.frozensets(st.integers(0, KEYS - 1), max_size=6),
            st.sampled_from([0, 0, 0, 1, 2, 3]),  # 0: never raise
        ),
    ),
    min_size=40,
    max_size=250,
)


def _slot_op(op: tuple[Any, ...]) -> tuple[Any, ...]:
    name, *args = op
    if name == "insert":
        i, size, position, parent = args
        return (name, SLOTS[i], size, position, NO_SLOT if parent is None else SLOTS[parent])
    if name in ("victim", "last_resort"):
        pinned, fail = args
        return (name, {SLOTS[i] for i in pinned}, fail)
    return (name, SLOTS[args[0]])


DIGESTS: dict[str, Callable[[int], int]] = {
    "uniform": lambda slot: key_digest(("ns", slot)),
    "colliding": lambda slot: slot % 5,  # several blocks one digest: one ghost, one count
}


@settings(max_examples=400, deadline=None)
@given(ops=calls, digest=st.sampled_from(sorted(DIGESTS)))
def test_native_order_decides_as_the_python_pair(ops: list[tuple[Any, ...]], digest: str) -> None:
    twins = Twins(DIGESTS[digest])
    for op in ops:
        twins.run(_slot_op(op))


@pytest.mark.parametrize("digest", sorted(DIGESTS))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_native_order_decides_as_the_python_pair_over_long_runs(digest: str, seed: int) -> None:
    """A DRAM arena's life: blocks in chains (parents), hits, uses, evictions under pins,
    removals; thousands of catalog slots spread over a wide range, so every table grows
    and freed locals and nodes are reused."""
    rng = random.Random(seed)
    twins = Twins(DIGESTS[digest])
    universe = rng.sample(range(10_000_000), 3000)
    for step in range(6000):
        r = rng.random()
        slot = universe[min(int(rng.expovariate(1 / 400)), len(universe) - 1)]
        if r < 0.45:
            parent = rng.choice(universe[:600]) if rng.random() < 0.5 else NO_SLOT
            op: tuple[Any, ...] = ("insert", slot, 65536, rng.randrange(8), parent)
        elif r < 0.6:
            op = ("hit", slot)
        elif r < 0.75:
            op = ("access", slot)
        elif r < 0.82:
            op = ("remove", slot)
        else:
            pinned = set(rng.sample(universe[:800], rng.randrange(40)))
            fail = rng.choice([0] * 30 + [1, 3])
            op = ("last_resort" if rng.random() < 0.1 else "victim", pinned, fail)
        twins.run(op, every_slot=step % 50 == 0)  # every slot now and then: the cost
    assert len(twins.native) > 50  # the run kept a real order, not an empty one


def test_production_picks_the_native_order_for_kvtier_only() -> None:
    policies = {
        name: PackedPolicies(name, "write_back", MODELS[0], 64, lambda s: s)
        for name in ("kvtier", "lru", "s3fifo")
    }
    assert isinstance(policies["kvtier"].new_dram_tier(1 << 20, lambda s: s), NATIVE)  # type: ignore[arg-type]
    for name in ("lru", "s3fifo"):
        assert isinstance(policies[name].new_dram_tier(1 << 20, lambda s: s), DenseOrder)


def test_python_pair_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    order = dram_order(lambda: DenseOrder(lambda own: PackedChainArc(own, own), id), id, id, 0.01)
    assert isinstance(order, DenseOrder)


def test_native_order_is_collected_with_its_cycle() -> None:
    """The order holds the catalog's bound methods and the catalog holds the residency
    that holds the order: a cycle the collector must be able to free."""

    class Owner:
        def digest(self, slot: int) -> int:
            return slot

    owner = Owner()
    sketch = DigestSketch()
    order = NATIVE(owner.digest, sketch.count, 0.01)  # type: ignore[misc, call-arg]
    owner.order = order  # type: ignore[attr-defined]
    for slot in range(100):
        order.insert(slot, 1, 0, NO_SLOT)
    import weakref

    gone = weakref.ref(owner)
    del owner, order
    gc.collect()
    assert gone() is None


def test_bad_calls_are_errors_not_crashes() -> None:
    assert NATIVE is not None
    order = NATIVE(lambda s: s, DigestSketch().count, 0.01)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        order.insert(-5, 1)
    with pytest.raises(TypeError):
        order.insert("x", 1)  # type: ignore[arg-type]
    with pytest.raises(ZeroDivisionError):
        NATIVE(lambda s: 1 // 0, DigestSketch().count, 0.01).insert(1, 1)  # type: ignore[call-arg]
    bare = NATIVE.__new__(NATIVE)
    with pytest.raises(RuntimeError):
        bare.insert(1, 1)
    assert "x" not in order and len(order) == 0
