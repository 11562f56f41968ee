"""The catalog's NVMe location column (issue 22): set with a record, answered to the segment
layout's reclaim (`holds_record`), moved only from where the catalog still has it
(`move_record`), never inherited by a reused slot; and a property test against a dict."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index.catalog import Catalog, Entry
from kvtier.types import Extent

NS = "t|m"


def test_a_location_rides_with_the_record_and_moves_only_from_where_it_is() -> None:
    cat = Catalog()
    cat.add_record((NS, b"a"), 100, 1, 7, 8192, location=(3 << 32) | 5)
    assert cat.holds_record((NS, b"a"), 7, (3 << 32) | 5)
    assert not cat.holds_record((NS, b"a"), 6, (3 << 32) | 5)  # another generation
    assert not cat.holds_record((NS, b"a"), 7, (3 << 32) | 6)  # another place
    assert not cat.holds_record((NS, b"b"), 7, (3 << 32) | 5)  # not catalogued
    assert not cat.move_record((NS, b"a"), 7, (9 << 32) | 1, (4 << 32) | 1)
    assert cat.move_record((NS, b"a"), 7, (3 << 32) | 5, (4 << 32) | 1)
    entry = cat.get((NS, b"a"))
    assert entry is not None and entry.nvme_location == (4 << 32) | 1


def test_an_entry_carries_its_location_into_the_catalog_and_set_nvme_sets_it() -> None:
    cat = Catalog()
    e = Entry((NS, b"x"), 10, 2, 3, nvme_record_bytes=8192, nvme_location=42)
    cat.add(e)
    assert e.nvme_location == 42 and cat.holds_record((NS, b"x"), 3, 42)
    d = Entry((NS, b"y"), 10, 2, 4, dram_extent=Extent(0, 4096))
    cat.add(d)
    assert not cat.holds_record((NS, b"y"), 4, 0)  # no record yet
    cat.set_nvme(d, 8192, 99)
    assert d.nvme_location == 99 and cat.holds_record((NS, b"y"), 4, 99)
    cat.drop_nvme(d)
    assert not cat.holds_record((NS, b"y"), 4, 99)  # dropped: reclaim may delete it


def test_a_reused_slot_does_not_inherit_a_location() -> None:
    cat = Catalog()
    slot = cat.add_record((NS, b"old"), 10, 1, 1, 8192, location=77)
    entry = cat.handle(slot)
    cat.remove(entry)
    del entry
    again = cat.add_record((NS, b"new"), 10, 1, 2, 8192)
    assert again == slot  # the slot came back ...
    assert cat.handle(again).nvme_location == 0  # ... without the old location
    assert not cat.holds_record((NS, b"new"), 2, 77)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "move", "remove", "ask"]),
        st.integers(0, 7),  # key
        st.integers(1, 3),  # generation
        st.integers(1, 5),  # a location
        st.integers(1, 5),  # another
    ),
    max_size=80,
)


@settings(max_examples=150)
@given(ops=OPS)
def test_locations_match_a_dict(ops: list[tuple[str, int, int, int, int]]) -> None:
    cat = Catalog()
    model: dict[bytes, tuple[int, int]] = {}  # key -> (generation, location)
    for op, k, gen, loc, other in ops:
        key = b"k%d" % k
        if op == "add" and key not in model:
            cat.add_record((NS, key), 10, 1, gen, 8192, location=loc)
            model[key] = (gen, loc)
        elif op == "move":
            took = cat.move_record((NS, key), gen, loc, other)
            assert took == (model.get(key) == (gen, loc))
            if took:
                model[key] = (gen, other)
        elif op == "remove" and key in model:
            entry = cat.get((NS, key))
            assert entry is not None
            cat.remove(entry)
            del model[key]
        for kk in range(8):
            want = model.get(b"k%d" % kk)
            for g in (1, 2, 3):
                for lc in range(1, 6):
                    got = cat.holds_record((NS, b"k%d" % kk), g, lc)
                    assert got == (want == (g, lc))
