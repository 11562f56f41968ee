"""PackedValue grows its per-slot arrays one at a time ahead of need (`_grow_ahead`), so no
insert copies all eleven at once: the same decisions as growing them all when needed, and
at most one array grown by any insert while the arrays are large."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index.packed_policies import PackedPolicies
from kvtier.index.packed_policy import NO_SLOT, PackedValue
from tests.index.test_policy_bulk import MODELS, arrays, digest


def make(ahead_from: int) -> PackedValue:
    policies = PackedPolicies("kvtier", "write_back", MODELS[0], 64, digest)
    order = policies.new_tier("nvme", None, 1 << 40)
    assert isinstance(order, PackedValue)
    order.grow_ahead_from = ahead_from
    return order


def fields(order: PackedValue, upto: int) -> dict[str, object]:
    """`arrays` less the growth schedule itself (which is what differs), each array cut
    to the slots used (one grown ahead is longer)."""
    out = arrays(order, upto)
    del out["grow_ahead_from"], out["_ahead_from"]
    for name, value in out.items():
        if isinstance(value, list) and name != "_heap":
            out[name] = value[: upto + 1] if name in ("_rprev", "_rnext") else value[:upto]
    return out


def lengths(order: PackedValue) -> list[int]:
    return [len(values) for values, _, _ in order._columns()]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 2500),
    seed=st.integers(0, 1000),
    parents=st.integers(0, 5),
    bulk_from=st.integers(0, 2500),
)
def test_growing_ahead_decides_as_growing_at_once(
    n: int, seed: int, parents: int, bulk_from: int
) -> None:
    sizes = [(1024, 4096, 16384)[(i * seed + i // 7) % 3] for i in range(n)]
    ahead, at_once = make(256), make(1 << 62)
    stepped = 0
    for order in (ahead, at_once):
        for slot, size in enumerate(sizes[:bulk_from]):
            parent = slot - 1 if parents and slot % parents else NO_SLOT
            before = lengths(order)
            order.insert(slot, size, slot % 4, parent)
            if order is ahead and before[-1] > slot:  # no insert needed a full grow
                grown = sum(a != b for a, b in zip(before, lengths(order), strict=True))
                assert grown <= 1
                stepped += grown
        rest = np.arange(bulk_from, len(sizes), dtype=np.int64)
        order.insert_many(
            rest,
            np.array(sizes[bulk_from:], dtype=np.uint64),
            np.array([digest(s) for s in rest.tolist()], dtype=np.uint64),
        )
    assert fields(ahead, len(sizes)) == fields(at_once, len(sizes))
    evict = [ahead.victim(lambda s: True) for _ in range(len(sizes) + 1)]
    assert evict == [at_once.victim(lambda s: True) for _ in range(len(sizes) + 1)]
    assert min(lengths(ahead)[:-1]) >= lengths(ahead)[-1]  # `_where` is never ahead
    if min(bulk_from, n) > 600:
        assert stepped  # the steps were taken (past 16 slots, then every 1/16th)
