"""Catalog.add_records (recovery's bulk add) leaves the catalog as adding the same
records one by one with add_record does: the same slots, fields, accounting, events,
hash-table buckets and free lists, from any earlier state (reused slots, held slots,
digest collisions), and lookups agree after."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.events import EventLog
from kvtier.index.catalog import NO_SLOT, BlockId, Catalog, RecordColumns, seeded_digest

NAMES = ["a|m", "b|m", "c|other"]
KEYS = st.binary(min_size=0, max_size=3)
# (namespace index, key, size, generation, location)
RECORD = st.tuples(
    st.integers(0, 2), KEYS, st.integers(0, 1 << 20), st.integers(1, 99), st.integers(0, 9)
)


def columns(records: list[tuple[int, bytes, int, int, int]], digests: bool) -> RecordColumns:
    keys = [key for _, key, _, _, _ in records]
    lens = np.array([len(k) for k in keys], dtype=np.int64)
    off = np.zeros(len(keys), dtype=np.int64)
    if len(keys):
        off[1:] = np.cumsum(lens)[:-1]

    def col(i: int) -> np.ndarray:
        return np.array([r[i] for r in records], dtype=np.uint64)

    sizes = col(2)
    return RecordColumns(
        NAMES,
        np.array([r[0] for r in records], dtype=np.uint32),
        b"".join(keys),
        off,
        lens,
        sizes,
        sizes * np.uint64(7) + np.uint64(1),
        col(3),
        (sizes + np.uint64(4095)) // np.uint64(4096) * np.uint64(4096) + np.uint64(4096),
        col(4),
        np.array([seeded_digest(NAMES[r[0]], r[1]) for r in records], dtype=np.uint64)
        if digests
        else None,
    )


def buckets(cat: Catalog) -> list[frozenset[int]]:
    """Each bucket's slots (the order in a chain is free)."""
    out = []
    for head in cat._heads:
        chain, s = set(), head
        while s >= 0:
            chain.add(s)
            s = cat._chain[s]
        out.append(frozenset(chain))
    return out


def free_list(cat: Catalog) -> list[int]:
    out, s = [], cat._free
    while s != NO_SLOT:
        out.append(s)
        s = cat._chain[s]
    return out


def state(cat: Catalog, events: EventLog) -> object:
    live = {}
    for s in range(cat._slots):
        if cat.is_live_slot(s):
            live[cat.block_id_of(s)] = (
                s,
                cat._size[s],
                cat._xxh3[s],
                cat._gen[s],
                cat._record[s],
                cat._loc[s],
                cat._pins[s],
                cat._flags[s],
                cat._errors[s],
                cat.era_of(s),
                cat.digest_of(s),
            )
    recent = [(e.seq, e.block_id, e.tiers) for e in events.history()]
    return (
        live,
        len(cat),
        cat._slots,
        cat._base,
        cat._split,
        buckets(cat),
        free_list(cat),
        sorted(cat._to_free),
        cat._held,
        cat.nvme_used_bytes,
        dict(cat.nvme_used_by_tenant),
        cat._nvme_count,
        [cat._ns_names[cat._ns[s]] for s in range(cat._slots)],
        recent,
    )


def tiny(block_id: BlockId) -> int:
    """A digest of 3 bits: most keys collide."""
    return len(block_id[1]) * 3 + len(block_id[0]) & 7


def build(
    digest: Callable[[BlockId], int] | None,
    before: list[tuple[int, bytes, int, int, int]],
    drop: list[int],
    hold: list[int],
    keep: int = 1 << 16,
    runs: bool = False,
) -> tuple[Catalog, EventLog, list[object]]:
    """`runs`: the catalog tells the log of a bulk add's events at once (as the store's)."""
    events = EventLog(keep=keep)
    cat = Catalog(events.record, digest, on_changes=events.record_many if runs else None)
    held = {s for s in hold}
    cat.holds = lambda slot: slot in held
    handles: list[object] = []
    for ns, key, size, gen, loc in before:
        if cat.slot_of((NAMES[ns], key)) == NO_SLOT:
            cat.add_record((NAMES[ns], key), size, 1, gen, size + 4096, loc)
    entries = list(cat.entries())
    for i in drop:
        if entries:
            entry = entries[i % len(entries)]
            if cat.is_live(entry):
                cat.remove(entry)
    if entries and drop:
        handles.append(entries[drop[0] % len(entries)])  # a removed slot whose handle lives
    del entries
    return cat, events, handles


@settings(max_examples=300, deadline=None)
@given(
    before=st.lists(RECORD, max_size=40),
    drop=st.lists(st.integers(0, 100), max_size=12),
    hold=st.lists(st.integers(0, 40), max_size=6),
    batch=st.lists(RECORD, max_size=60, unique_by=lambda r: (r[0], r[1])),
    collide=st.booleans(),
    digests=st.booleans(),
    keep=st.sampled_from([1, 7, 64, 1 << 16]),
)
def test_add_records_is_add_record_one_by_one(
    before: list[tuple[int, bytes, int, int, int]],
    drop: list[int],
    hold: list[int],
    batch: list[tuple[int, bytes, int, int, int]],
    collide: bool,
    digests: bool,
    keep: int,
) -> None:
    digest = tiny if collide else None
    bulk, bulk_events, keep_a = build(digest, before, drop, hold, keep, runs=True)
    one, one_events, keep_b = build(digest, before, drop, hold, keep)
    cols = columns(batch, digests)
    got = bulk.add_records(cols)
    want = []
    for ns, key, size, gen, loc in batch:
        block = (NAMES[ns], key)
        if one.slot_of(block) != NO_SLOT:
            want.append(NO_SLOT)
            continue
        record = (size + 4095) // 4096 * 4096 + 4096
        want.append(one.add_record(block, size, size * 7 + 1, gen, record, loc))
    assert got.tolist() == want
    assert state(bulk, bulk_events) == state(one, one_events)
    probe = [key for _, key, _, _, _ in batch] + [b"zz", b""]
    for name in NAMES:
        assert bulk.lookup(name, probe) == one.lookup(name, probe)
        assert bulk.slots_of(name, probe) == one.slots_of(name, probe)
    # And the two stay the same under what follows (removals reuse the same slots).
    for cat in (bulk, one):
        then(cat)
    assert state(bulk, bulk_events) == state(one, one_events)
    del keep_a, keep_b


def then(cat: Catalog) -> None:
    """Half the blocks removed, one added (in a function: no handle outlives it)."""
    for entry in list(cat.entries())[::2]:
        cat.remove(entry)
    cat.add_record(("a|m", b"after"), 1, 1, 1, 4096, 3)


def test_a_block_twice_in_one_call_is_refused() -> None:
    cat = Catalog()
    with pytest.raises(ValueError, match="twice"):
        cat.add_records(columns([(0, b"k", 1, 1, 0), (0, b"k", 2, 2, 0)], True))
    assert len(cat) == 0


def test_a_large_batch_splits_the_table_as_one_by_one() -> None:
    """Thousands of records in one call: the linear-hashing table grows through several
    doublings inside it, to the same buckets."""
    batch = [(i % 3, i.to_bytes(3, "little"), i, 1, i + 1) for i in range(5000)]
    bulk, one = Catalog(), Catalog()
    bulk.add_records(columns(batch[:700], False))
    bulk.add_records(columns(batch[700:], True))
    for ns, key, size, gen, loc in batch:
        one.add_record((NAMES[ns], key), size, size * 7 + 1, gen, 0, loc)
    assert (bulk._base, bulk._split) == (one._base, one._split)
    assert buckets(bulk) == buckets(one)
    assert bulk.slots_of("a|m", [b[1] for b in batch]) == one.slots_of("a|m", [b[1] for b in batch])
