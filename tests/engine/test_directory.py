"""Per-tenant directories (direct reads): what a reader finds is what the store holds now."""

from __future__ import annotations

import mmap
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier._directory import PROBE_SLOTS, key_digest, key_encoding
from kvtier.client.zerocopy import DirectoryReader
from kvtier.config import Config
from kvtier.engine.directory import MAX_ENTRIES, MIN_ENTRIES, Directory, entries_for
from kvtier.engine.store import Store
from kvtier.types import Extent
from tests.conftest import block_bytes
from tests.engine.test_store import NS, make_config, put

KEYS = [f"k{i}".encode() for i in range(24)]


def reader_of(fd: int) -> DirectoryReader:
    reader = DirectoryReader(os.dup(fd))
    reader.enabled = True
    return reader


@given(
    st.lists(
        st.tuples(st.sampled_from(["publish", "unpublish", "free"]), st.integers(0, 39)),
        max_size=120,
    )
)
@settings(max_examples=60, deadline=None)
def test_a_reader_finds_exactly_the_published_blocks(ops: list[tuple[str, int]]) -> None:
    # A small table (probe windows fill up) over an arena whose every 4 KiB page is
    # distinct: a reader copies the extent the entry names, so its bytes say which.
    directory = Directory(64)
    reader = reader_of(directory.fd)
    arena = memoryview(b"".join(block_bytes(i, 4096) for i in range(64)))
    model: dict[bytes, int] = {}  # key -> page its entry names
    at_page: dict[int, bytes] = {}
    try:
        for op, n in ops:
            key = f"key{n}".encode()
            page = n
            if op == "publish":
                if page in at_page and at_page[page] != key:
                    continue  # an extent holds one block at a time
                old = model.pop(key, None)
                if old is not None:
                    del at_page[old]
                ok = directory.publish(("t|ns", key), page * 4096, 4096, 0, 1)
                if ok:
                    model[key], at_page[page] = page, key
            elif op == "unpublish":
                directory.unpublish(("t|ns", key))
                if key in model:
                    del at_page[model.pop(key)]
            else:
                directory.unpublish_extent(Extent(page * 4096, 4096))
                if page in at_page:
                    del model[at_page.pop(page)]
            for m in range(40):
                probe = f"key{m}".encode()
                out = bytearray(4096)
                got = reader.read_into("ns", probe, arena, [memoryview(out)], verify=False)
                if probe in model:
                    assert got == 4096 and out == block_bytes(model[probe], 4096)
                else:
                    assert got is None
            assert len(directory) == len(model)
    finally:
        reader.close()
        directory.close()


def test_a_full_probe_window_leaves_a_block_unpublished() -> None:
    directory = Directory(MIN_ENTRIES)
    try:
        # Keys whose home slot is the same: the window holds PROBE_SLOTS of them.
        keys: list[bytes] = []
        target = None
        i = 0
        while len(keys) <= PROBE_SLOTS:
            key = f"y{i}".encode()
            slot = key_digest(b"ns", key)[0] % MIN_ENTRIES
            if target is None:
                target = slot
            if slot == target:
                keys.append(key)
            i += 1
        results = [directory.publish(("t|ns", k), n * 4096, 1, 0, 1) for n, k in enumerate(keys)]
        assert results == [True] * PROBE_SLOTS + [False]
        assert directory.unpublished_full == 1
    finally:
        directory.close()


def test_key_encoding_is_unambiguous() -> None:
    assert key_encoding(b"ab", b"c") != key_encoding(b"a", b"bc")
    assert key_digest(b"ab", b"c") != key_digest(b"a", b"bc")


@pytest.mark.parametrize(
    ("arena_bytes", "entries"),
    [(1 << 20, MIN_ENTRIES), (256 << 20, 8192), (1 << 40, MAX_ENTRIES)],
)
def test_entries_follow_the_arena(arena_bytes: int, entries: int) -> None:
    assert entries_for(arena_bytes) == entries


def test_the_directory_cannot_be_mapped_writable() -> None:
    directory = Directory(MIN_ENTRIES)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(directory.fd, MIN_ENTRIES * 64, mmap.MAP_SHARED)
        with pytest.raises(PermissionError):
            os.pwrite(directory.fd, b"x", 0)
    finally:
        directory.close()


@pytest.mark.parametrize("seed", range(3))
async def test_the_directory_follows_the_store(tmp_path: Path, seed: int) -> None:
    """Puts, overwrites, deletes, evictions to NVMe and promotions back, in a 4 MiB arena:
    after each, every key read through the directory is a miss or its current bytes, and
    every block in DRAM is found."""
    rng = random.Random(seed)
    store = Store(make_config(tmp_path, 4 << 20, 64 << 20))
    await store.start()
    fd = store.directories.fd("default")
    assert fd is not None
    reader = reader_of(fd)
    arena = store.arena("default").whole
    model: dict[bytes, bytes] = {}
    try:
        for step in range(150):
            key = rng.choice(KEYS)
            action = rng.random()
            if action < 0.6:
                data = block_bytes(seed * 100000 + step, rng.choice([4096, 200_000, 600_000]))
                await put(store, key, data, overwrite=True)
                model[key] = data
            elif action < 0.75:
                await store.delete((NS, key))
                model.pop(key, None)
            else:  # a get: promotes an NVMe-only block back into DRAM
                acquired = await store.acquire(7, [(NS, key)])
                if acquired[0]:
                    store.release(7, [acquired[0]])
            in_dram = (await store.lookup(NS, KEYS)).tiers
            for k, tier in zip(KEYS, in_dram, strict=True):
                out = bytearray(1 << 20)
                got = reader.read_into("m/l", k, arena, [memoryview(out)], verify=False)
                if got is not None:
                    assert bytes(out[:got]) == model[k], f"wrong bytes for {k!r} at step {step}"
                if tier == "dram" and k in model:
                    entry = store.residency.get((NS, k))
                    assert entry is not None
                    if entry.dram_extent is not None:
                        assert got == len(model[k]), f"{k!r} in DRAM but not published"
    finally:
        reader.close()
        await store.close()


async def test_direct_reads_off_publishes_nothing(tmp_path: Path) -> None:
    config = make_config(tmp_path, 4 << 20, 64 << 20)
    config = Config.model_validate(
        {
            **config.model_dump(mode="json"),
            "dram": {"capacity_bytes": 4 << 20, "direct_reads": False},
        }
    )
    store = Store(config)
    await store.start()
    try:
        assert store.directories.fd("default") is None
        await put(store, b"k", b"v" * 100)
    finally:
        await store.close()


class _RewrittenDuringCopy:
    """A destination part that, once the reader's copy into it is done, has the daemon
    unpublish the block and rewrite its extent (an eviction and a reuse racing the read)."""

    def __init__(self, size: int, after_copy: Callable[[], None]) -> None:
        self.view = memoryview(bytearray(size))
        self.nbytes = size
        self._after_copy = after_copy

    def __setitem__(self, index: slice, data: memoryview) -> None:
        self.view[index] = data
        self._after_copy()

    def __getitem__(self, index: slice) -> memoryview:
        return self.view[index]


@pytest.mark.parametrize("then", ["unpublish", "republish"])
def test_a_block_changed_during_the_copy_is_not_kept(then: str) -> None:
    directory = Directory(MIN_ENTRIES)
    reader = reader_of(directory.fd)
    arena = bytearray(block_bytes(1, 8192))
    block_id = ("t|ns", b"k")

    def evict_and_reuse() -> None:
        directory.unpublish(block_id)
        arena[:4096] = bytes(4096)  # the extent reused by another block
        if then == "republish":  # the key put again elsewhere: same entry, new seq
            directory.publish(block_id, 4096, 4096, 0, 2)

    try:
        assert directory.publish(block_id, 0, 4096, 0, 1)
        part = _RewrittenDuringCopy(4096, evict_and_reuse)
        got = reader.read_into("ns", b"k", memoryview(arena), [part], verify=False)  # type: ignore[list-item]
        assert got is None  # the sequence word moved during the copy: acquire instead
        # Untouched, the same read keeps its copy.
        out = bytearray(4096)
        if then == "republish":
            got = reader.read_into("ns", b"k", memoryview(arena), [memoryview(out)], verify=False)
            assert got == 4096 and out == arena[4096:]
    finally:
        reader.close()
        directory.close()


@pytest.mark.parametrize("published", [3, 40])
def test_freeing_a_coalesced_run_unpublishes_every_block_in_it(published: int) -> None:
    # Both walks: a run of fewer pages than published blocks, and of more.
    directory = Directory(MIN_ENTRIES)
    try:
        for i in range(published):
            assert directory.publish(("t|ns", f"k{i}".encode()), i * 8192, 5000, 0, 1)
        directory.unpublish_extent(Extent(8192, 2 * 8192))  # blocks 1 and 2, one run
        left = {block[1] for block in directory._slot_of}
        assert left == {f"k{i}".encode() for i in range(published) if i not in (1, 2)}
    finally:
        directory.close()


async def test_a_reload_that_lowers_the_key_limit_withdraws_longer_keys(tmp_path: Path) -> None:
    """A direct read asks the daemon nothing: once a reload lowers limits.max_key_bytes,
    a key it refuses must leave the directory (its gets then acquire, and are refused
    as every request of that key is), and is not published again by a later put."""
    config = make_config(tmp_path, 4 << 20, 64 << 20)
    store = Store(config)
    await store.start()
    fd = store.directories.fd("default")
    assert fd is not None
    reader = reader_of(fd)
    arena = store.arena("default").whole
    long_key, short_key = b"L" * 40, b"s" * 8
    try:
        for key in (long_key, short_key):
            await put(store, key, block_bytes(len(key), 4096))

        def readable(key: bytes) -> bool:
            out = bytearray(4096)
            return reader.read_into("m/l", key, arena, [memoryview(out)], verify=False) == 4096

        assert readable(long_key) and readable(short_key)
        lowered = config.model_copy(
            update={"limits": config.limits.model_copy(update={"max_key_bytes": 32})}
        )
        store.reconfigure(lowered)
        assert not readable(long_key)
        assert readable(short_key)
        await put(store, long_key, block_bytes(7, 4096), overwrite=True)  # not via a request
        assert not readable(long_key)
    finally:
        reader.close()
        await store.close()


def test_a_report_carries_its_calls_per_namespace_and_at_most_the_cap() -> None:
    """Each get_many's direct reads go out as one call beside its hits, in the report of
    its namespace; a client that piles up more calls than a report's frame cap allows
    sends the newest MAX_CALLS_PER_HITS (the daemon's cap on HITS counts that many)."""
    from kvtier._session import MAX_CALLS_PER_HITS

    directory = Directory(MIN_ENTRIES)
    reader = reader_of(directory.fd)
    try:
        reader.hit("a", b"k1", 4096, 1e-5)
        reader.hit("b", b"k2", 8192, 2e-5)
        reader.call("a", 1, 4096, 3e-5)
        reader.call("b", 1, 8192, 4e-5)
        reports = {r.namespace: r for r in reader.take_hits()}
        assert [(c.blocks, c.bytes, c.seconds) for c in reports["a"].calls] == [(1, 4096, 3e-5)]
        assert [(c.blocks, c.bytes, c.seconds) for c in reports["b"].calls] == [(1, 8192, 4e-5)]
        assert reader.take_hits() == []  # taken: nothing pending
        for i in range(MAX_CALLS_PER_HITS + 6):
            reader.hit("a", b"k1", 4096, 1e-5)
            reader.call("a", 1, 4096, float(i))
        (report,) = reader.take_hits()
        assert [c.seconds for c in report.calls] == [
            float(i) for i in range(6, MAX_CALLS_PER_HITS + 6)
        ]
    finally:
        reader.close()
        directory.close()
