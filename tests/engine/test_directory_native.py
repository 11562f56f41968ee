"""A tenant's directory with its per-block work in C (kvtier/engine/_directory_native.c)
against the Python one it stands for (kvtier/engine/directory.py): after every call of
random sequences (publish with and without the namespace, republish at another extent or
generation, unpublish, unpublish an extent or a run of them, probe windows filled by
colliding keys), both tables hold the same bytes, seqs included, so no reader can tell
them apart; and a reader of the native table finds what the store holds."""

from __future__ import annotations

import gc
import inspect
import os
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier._directory import key_digest
from kvtier.engine.directory import NATIVE_DIRECTORY, Directory, DirectoryTable, new_directory
from kvtier.types import Extent
from tests.engine.test_directory import reader_of

pytestmark = pytest.mark.skipif(
    NATIVE_DIRECTORY is None and os.environ.get("KVTIER_REQUIRE_NATIVE") != "1",
    reason="kvtier/engine/_directory_native.c was not built (no C compiler at install)",
)

PAGE = 4096


class Twins:
    def __init__(self, entries: int) -> None:
        assert NATIVE_DIRECTORY is not None, "the native directory was not built"
        self.python = Directory(entries)
        self.native = NATIVE_DIRECTORY(entries)
        self.both: tuple[DirectoryTable, DirectoryTable] = (self.python, self.native)

    def call(self, name: str, *args: object, **kwargs: object) -> None:
        got = [getattr(d, name)(*args, **kwargs) for d in self.both]
        assert got[0] == got[1], f"{name}{args}: {got[1]} where Python gives {got[0]}"
        self.check()

    def check(self) -> None:
        python, native = self.python, self.native
        assert bytes(python._map) == bytes(native._map), "the tables differ"  # type: ignore[attr-defined]
        assert len(native) == len(python)
        assert native.unpublished_full == python.unpublished_full

    def close(self) -> None:
        for d in self.both:
            d.close()


def block_id(n: int) -> tuple[str, bytes]:
    return (f"t|ns{n % 3}", b"key-%d" % n)


ops = st.lists(
    st.tuples(
        st.sampled_from(["publish", "publish_ns", "publish_kw", "unpublish", "free", "free_run"]),
        st.integers(0, 47),  # the block
        st.integers(0, 63),  # its page
        st.integers(1, 3),  # a generation, or a run's pages
    ),
    max_size=150,
)


@settings(max_examples=200, deadline=None)
@given(calls=ops, entries=st.sampled_from([8, 16, 64]))
def test_the_same_table_as_python(calls: list[tuple[str, int, int, int]], entries: int) -> None:
    twins = Twins(entries)  # small tables: probe windows fill, keys are turned away
    try:
        for name, n, page, extra in calls:
            if name.startswith("publish"):
                args: tuple[object, ...] = (block_id(n), page * PAGE, 100 + n, n * 7, extra)
                namespace = b"ns%d" % (n % 3)  # what namespace_of gives for block_id(n)
                if name == "publish_ns":
                    args += (namespace,)
                kwargs = {"namespace": namespace} if name == "publish_kw" else {}
                twins.call("publish", *args, **kwargs)
            elif name == "unpublish":
                twins.call("unpublish", block_id(n))
            elif name == "free":
                twins.call("unpublish_extent", Extent(page * PAGE, PAGE))
            else:
                twins.call("unpublish_extent", Extent(page * PAGE, extra * 8 * PAGE))
    finally:
        twins.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_long_sequences_over_a_large_table(seed: int) -> None:
    """Thousands of blocks (the id index grows, entries leave from inside probe runs),
    runs of extents freed both ways (page by page, and by the published offsets)."""
    rng = random.Random(seed)
    twins = Twins(8192)
    at: dict[int, tuple[str, bytes]] = {}
    most = 0
    try:
        for step in range(20_000):
            r = rng.random()
            if r < 0.55:
                page = rng.randrange(6000)
                n = rng.randrange(9000)
                if page in at and at[page] != block_id(n):
                    continue  # an extent holds one block at a time
                for d in twins.both:
                    d.publish(block_id(n), page * PAGE, PAGE, n, 1 + step % 5)
                at = {p: b for p, b in at.items() if b != block_id(n)}
                at[page] = block_id(n)
            elif r < 0.75:
                gone = block_id(rng.randrange(9000))
                for d in twins.both:
                    d.unpublish(gone)
                at = {p: b for p, b in at.items() if b != gone}
            else:
                start = rng.randrange(6000)
                pages = 3000 if rng.random() < 0.002 else rng.choice([1, 4, 64])
                for d in twins.both:
                    d.unpublish_extent(Extent(start * PAGE, pages * PAGE))
                at = {p: b for p, b in at.items() if not start <= p < start + pages}
            most = max(most, len(twins.native))
            if step % 499 == 0:
                twins.check()
        twins.check()
        assert most > 400  # the id index grown many times over
    finally:
        twins.close()


def test_a_reader_finds_what_the_native_table_says() -> None:
    assert NATIVE_DIRECTORY is not None
    directory = NATIVE_DIRECTORY(64)
    reader = reader_of(directory.fd)
    arena = memoryview(b"".join(bytes([p]) * PAGE for p in range(8)))  # each page its own
    try:
        assert directory.publish(("t|ns", b"a"), 2 * PAGE, PAGE, 0, 1)
        out = bytearray(PAGE)
        assert reader.read_into("ns", b"a", arena, [memoryview(out)], verify=False) == PAGE
        assert out == bytes([2]) * PAGE
        assert directory.publish(("t|ns", b"a"), 5 * PAGE, PAGE, 0, 2)  # moved
        assert reader.read_into("ns", b"a", arena, [memoryview(out)], verify=False) == PAGE
        assert out == bytes([5]) * PAGE
        directory.unpublish_extent(Extent(4 * PAGE, 2 * PAGE))
        assert reader.read_into("ns", b"a", arena, [memoryview(out)], verify=False) is None
        assert len(directory) == 0
    finally:
        reader.close()
        directory.close()


def test_it_keeps_no_objects_for_the_collector_and_lets_go_at_close() -> None:
    """Block ids are held in C, out of the collector's reach (a tuple of a str and bytes
    is in no cycle: the Python directory's list and dict of them were walked by every full
    collection); closing lets go of them and of the mapping."""
    assert NATIVE_DIRECTORY is not None
    directory = NATIVE_DIRECTORY(16384)
    ids = [("t|ns", b"gc-%d" % i) for i in range(2000)]
    # A collection untracks tuples of atoms, and a dict of untracked keys and int values
    # is then no container either: done here, not at whatever point a collection
    # happens to run, so the Python directory's containers below are always just its
    # list (its dict was one too in ~1 run of 8, when no collection ran first).
    gc.collect()

    def containers(bid: tuple[str, bytes]) -> int:
        return sum(not inspect.isframe(r) for r in gc.get_referrers(bid))

    alone = [containers(bid) for bid in ids[:50]]
    before = [sys.getrefcount(bid) for bid in ids]
    assert all(directory.publish(bid, i * PAGE, PAGE, 0, 1) for i, bid in enumerate(ids))
    assert [sys.getrefcount(bid) for bid in ids] == [n + 1 for n in before]
    assert [containers(bid) for bid in ids[:50]] == alone
    python = Directory(16384)  # for contrast: its list is one more container
    assert all(python.publish(bid, i * PAGE, PAGE, 0, 1) for i, bid in enumerate(ids))
    assert [containers(bid) for bid in ids[:50]] == [n + 1 for n in alone]
    python.close()
    del python
    gc.collect()  # whatever else held it (a frame of an assertion) let go too
    directory.close()
    assert [sys.getrefcount(bid) for bid in ids] == before
    with pytest.raises(RuntimeError, match="closed"):
        directory.publish(ids[0], 0, PAGE, 0, 1)


def test_bad_arguments_are_refused() -> None:
    assert NATIVE_DIRECTORY is not None
    directory = NATIVE_DIRECTORY(64)
    try:
        with pytest.raises(TypeError):
            directory.publish("not a block id", 0, 1, 0, 1)  # type: ignore[arg-type]
        with pytest.raises(OverflowError):
            directory.publish(("t|ns", b"k"), -4096, 1, 0, 1)
        assert len(directory) == 0
    finally:
        directory.close()
    with pytest.raises(ValueError):
        NATIVE_DIRECTORY(48)


def test_kvtier_native_0_picks_the_python_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert NATIVE_DIRECTORY is not None
    native = new_directory(64)
    assert type(native) is NATIVE_DIRECTORY
    native.close()
    monkeypatch.setenv("KVTIER_NATIVE", "0")
    python = new_directory(64)
    assert type(python) is Directory
    python.close()
    assert key_digest(b"ns", b"k")  # the one digest both use
