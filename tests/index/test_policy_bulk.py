"""SlotPolicy.insert_many (recovery's bulk insert into the NVMe order) and insert_run (a
demotion batch's) leave every packed policy as inserting the same slots one by one
does: the same arrays, heap and lists, and the same victims after, from any earlier
state."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index.packed_policies import PackedPolicies
from kvtier.index.packed_policy import NO_SLOT, SlotPolicy
from kvtier.index.planner import PrefillCost, TierCost
from kvtier.index.policy import ValueModel

PREFILL = PrefillCost(40e-6, 1.3e-9)
DRAM = TierCost(50e9, 10e-6)
MODELS = [
    ValueModel(16, 1024, PREFILL, {"dram": DRAM, "nvme": TierCost(7e9, 100e-6)}),
    ValueModel(16, 1024, PREFILL, {"dram": DRAM, "nvme": TierCost(2e8, 600e-6)}),
    ValueModel(16, 1024, PREFILL, {"dram": DRAM, "nvme": TierCost(1e6, 1.0)}),  # all ties
]
SLOTS = 40
SIZES = st.sampled_from([1024, 4096, 16384, 4096 * 3])
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.integers(0, SLOTS - 1),
            SIZES,
            st.integers(0, 3),
            st.integers(-1, SLOTS - 1),
        ),
        st.tuples(st.just("hit"), st.integers(0, SLOTS - 1)),
        st.tuples(st.just("remove"), st.integers(0, SLOTS - 1)),
        st.tuples(st.just("victim"), st.integers(0, 3)),
        st.tuples(
            st.just("use"), st.integers(0, SLOTS + 20), st.integers(-1, 3), st.integers(1, 4)
        ),
    ),
    max_size=60,
)


def digest(slot: int) -> int:
    return (slot * 0x9E3779B97F4A7C15 + 12345) & 0xFFFF_FFFF_FFFF_FFFF


def make(name: str, model: ValueModel) -> tuple[PackedPolicies, SlotPolicy]:
    policies = PackedPolicies(name, "write_back", model, 64, digest)
    return policies, policies.new_tier("nvme", None, 64 * 1024)


def run(policies: PackedPolicies, order: SlotPolicy, ops: list[tuple[Any, ...]]) -> list[object]:
    out: list[object] = []
    for op in ops:
        if op[0] == "insert":
            _, slot, size, position, parent = op
            order.insert(slot, size, position, NO_SLOT if parent == slot else parent)
        elif op[0] == "hit":
            order.hit(op[1])
        elif op[0] == "remove":
            order.remove(op[1])
        elif op[0] == "use":
            for _ in range(op[3]):
                policies.accessed(digest(op[1]), op[2])
        else:
            out.append(order.victim(lambda s, m=op[1]: s % 4 != m))
    return out


def arrays(order: SlotPolicy, upto: int) -> dict[str, object]:
    """Every array-valued field, over the slots used (lengths grow differently), and the
    scalars."""
    out: dict[str, object] = {}
    for name, value in vars(order).items():
        if name in ("_heap",):
            out[name] = list(value)
        elif hasattr(value, "typecode") or isinstance(value, (bytearray, memoryview)):
            out[name] = list(value[: upto + 2])
        elif isinstance(value, (int, float)):
            out[name] = value
    return out


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(["kvtier", "lru", "s3fifo"]),
    which=st.integers(0, len(MODELS) - 1),
    before=OPS,
    batch=st.lists(
        st.tuples(st.integers(0, SLOTS + 20), SIZES), max_size=40, unique_by=lambda t: t[0]
    ),
    after=OPS,
    way=st.sampled_from(["many", "run"]),
    again=st.integers(0, 39),
)
def test_a_bulk_insert_is_insert_one_by_one(
    name: str,
    which: int,
    before: list[tuple[Any, ...]],
    batch: list[tuple[int, int]],
    after: list[tuple[Any, ...]],
    way: str,
    again: int,
) -> None:
    bulk_policies, bulk = make(name, MODELS[which])
    one_policies, one = make(name, MODELS[which])
    assert run(bulk_policies, bulk, before) == run(one_policies, one, before)
    if way == "run":
        if batch and again < len(batch):
            batch = [*batch, batch[again]]  # a slot twice in one run: a hit the second time
        bulk.insert_run([s for s, _ in batch], [z for _, z in batch])
    else:
        slots = np.array([s for s, _ in batch], dtype=np.int64)
        sizes = np.array([z for _, z in batch], dtype=np.uint64)
        bulk.insert_many(slots, sizes, np.array([digest(s) for s in slots.tolist()], np.uint64))
    for slot, size in batch:
        one.insert(slot, size)
    upto = SLOTS + 21
    a, b = arrays(bulk, upto), arrays(one, upto)
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list) and isinstance(y, list) and key != "_heap":
            # Grown in other steps: every slot used is below both lengths.
            n = min(len(x), len(y))
            x, y = x[:n], y[:n]
        assert x == y, key
    assert len(bulk) == len(one)
    assert all((s in bulk) == (s in one) for s in range(upto))
    assert run(bulk_policies, bulk, after) == run(one_policies, one, after)
    drained = [bulk.victim(lambda s: True) for _ in range(len(bulk) + 1)]
    assert drained == [one.victim(lambda s: True) for _ in range(len(one) + 1)]
