"""DigestTable's index rebuilt with numpy (`_rehash`): every key is where linear probing
finds it (no empty slot between its home and it, across the wrap too), absent keys are
not found, and the table still behaves as the ordered dict it stands for."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index.slots import _EMPTY, DigestTable

# Homes crowded at the index's top end, so runs wrap past the last slot into the first.
crowded = st.builds(
    lambda lo, hi: (lo | 0xFFF0) | hi << 32, st.integers(0, 15), st.integers(0, 1 << 20)
)


def _check_probing(table: DigestTable) -> None:
    index, mask = table._index, table._mask
    for i, node in enumerate(index):
        if node <= 0:
            continue
        j = int(table._digest[node]) & mask
        while j != i:  # every slot from the key's home up to it is taken
            assert index[j] != _EMPTY, (i, j)
            j = (j + 1) & mask
    assert sorted(n for n in index if n > 0) == sorted(set(n for n in index if n > 0))


@settings(max_examples=150, deadline=None)
@given(
    keys=st.lists(crowded | st.integers(0, (1 << 64) - 1), min_size=1, max_size=400, unique=True),
    popped=st.integers(0, 100),
)
def test_a_rehash_keeps_every_key_findable(keys: list[int], popped: int) -> None:
    table, model = DigestTable(), OrderedDict[int, int]()
    for n, digest in enumerate(keys):  # puts rehash as the table grows
        table.put(digest, n % 256)
        model[digest] = n % 256
    for digest in keys[:popped]:  # deleted marks, and free nodes
        assert table.pop(digest) == model.pop(digest)
    table._rehash()
    assert table._deleted == 0
    _check_probing(table)
    for digest in keys:
        assert table.get(digest) == model.get(digest, -1)
    assert table.get(0xFFFF_FFFF_FFFF_FFF7) == model.get(0xFFFF_FFFF_FFFF_FFF7, -1)
    assert [table.pop_oldest() for _ in range(len(table))] == list(model)


def test_a_large_table_rehashed_finds_every_key() -> None:
    table = DigestTable()
    keys = [i * 0x9E3779B97F4A7C15 & ((1 << 64) - 1) for i in range(1, 50_001)]
    for n, digest in enumerate(keys):
        table.put(digest, n % 256)
    for digest in keys[::3]:
        table.pop(digest)
    table._rehash()
    _check_probing(table)
    assert all(table.get(d) == (-1 if n % 3 == 0 else n % 256) for n, d in enumerate(keys))


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.sampled_from(["put", "pop", "oldest"]), crowded, st.integers(0, 255)),
        max_size=400,
    ),
    bound=st.integers(0, 64),
)
def test_removals_keep_runs_unbroken_without_deleted_marks(
    calls: list[tuple[str, int, int]], bound: int
) -> None:
    """Backward-shift removal: after any mix of puts and removals of keys crowded at the
    top of the index (runs wrap), every key is findable, the index holds no mark, and a
    table sized for its bound never rehashed while it stayed within it."""
    table, model = DigestTable(bound), OrderedDict[int, int]()
    size = len(table._index)
    within = True
    for name, digest, value in calls:
        if name == "put":
            table.put(digest, value)
            model.setdefault(digest, value)
            model[digest] = value
        elif name == "pop":
            assert table.pop(digest) == model.pop(digest, -1)
        elif model:
            assert table.pop_oldest() == model.popitem(last=False)[0]
        within = within and len(model) <= bound
        assert all(n >= 0 for n in table._index)
        _check_probing(table)
    for digest, value in model.items():
        assert table.get(digest) == value
    if within and bound:
        assert len(table._index) == size
