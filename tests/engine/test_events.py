"""The residency event log: resuming exactly, or being told to resync — never a gap."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.events import BlockEvent, EventLog, Resync
from kvtier.index.catalog import TierName

DRAM, NVME = TierName.DRAM, TierName.NVME


def everything(_: str) -> bool:
    return True


async def test_a_watcher_gets_what_happens_after_it_registers() -> None:
    log = EventLog()
    log.record(("t|a", b"k0"), [DRAM])
    watcher = log.watch(everything, "", 0)
    log.record(("t|a", b"k1"), [DRAM])
    log.record(("t|a", b"k1"), [NVME])
    log.record(("t|a", b"k0"), [])
    batch = await watcher.next_batch(10)
    assert [(e.seq, e.block_id[1], e.tiers) for e in batch] == [
        (2, b"k1", (DRAM,)),
        (3, b"k1", (NVME,)),
        (4, b"k0", ()),
    ]


async def test_a_resumed_watcher_gets_exactly_what_it_missed_in_its_namespace() -> None:
    log = EventLog()
    for i in range(6):
        log.record((f"t|{'ab'[i % 2]}", bytes([i])), [DRAM])
    watcher = log.watch(lambda ns: ns == "t|a", log.epoch, 2)
    log.record(("t|a", b"live"), [NVME])
    log.record(("t|b", b"other"), [NVME])
    got = [(e.seq, e.block_id) for e in await watcher.next_batch(100)]
    assert got == [(3, ("t|a", b"\2")), (5, ("t|a", b"\4")), (7, ("t|a", b"live"))]


@pytest.mark.parametrize(
    ("epoch", "after_seq", "why"),
    [("another", 3, "restarted"), ("", 1, "no longer kept"), ("", 99, "ahead")],
)
def test_a_watcher_that_cannot_resume_is_told_to_resync(
    epoch: str, after_seq: int, why: str
) -> None:
    log = EventLog(keep=4)
    for i in range(10):
        log.record(("t|a", bytes([i])), [DRAM])
    with pytest.raises(Resync, match=why):
        log.watch(everything, epoch or log.epoch, after_seq)
    log.watch(everything, log.epoch, 6)  # the oldest kept is 7: resumable


async def test_a_watcher_that_falls_behind_must_resync_and_closing_ends_the_others() -> None:
    log = EventLog(backlog=3)
    slow, other = log.watch(everything, "", 0), log.watch(lambda ns: ns == "t|b", "", 0)
    for i in range(4):
        log.record(("t|a", bytes([i])), [DRAM])
    with pytest.raises(Resync, match="fell more than 3"):
        await slow.next_batch(10)
    log.close()
    assert await other.next_batch(10) == []


def test_the_history_is_nothing_the_garbage_collector_walks() -> None:
    """65 k kept events were most of what a full collection walked in a filled daemon (a
    stall of its event loop); kept as tuples of atoms they are untracked once collected,
    and a resumed watcher still gets each event whole."""
    import gc

    log = EventLog(keep=20000)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(20000):
        log.record(("t|a", b"k%d" % i), [DRAM, NVME] if i % 2 else [NVME])
    gc.collect()
    assert len(gc.get_objects()) - before < 1000
    watcher = log.watch(everything, log.epoch, 19997)
    got = [(e.seq, e.block_id[1], e.tiers) for e in watcher.queued(10)]
    assert got == [
        (19998, b"k19997", (DRAM, NVME)),
        (19999, b"k19998", (NVME,)),
        (20000, b"k19999", (DRAM, NVME)),
    ]


@settings(max_examples=200, deadline=None)
@given(
    keep=st.integers(1, 9),
    changes=st.lists(
        st.tuples(st.sampled_from(["t|a", "t|b", "u|c"]), st.binary(max_size=3), st.integers(0, 3)),
        max_size=40,
    ),
    after=st.integers(0, 45),
)
def test_the_packed_history_is_the_last_events_in_order(
    keep: int, changes: list[tuple[str, bytes, int]], after: int
) -> None:
    """The history is a ring of keys and arrays: what it replays is what a deque of the
    last `keep` BlockEvents would, whatever the wrap-around, namespaces and tier sets."""
    sets = [[], [DRAM], [NVME], [DRAM, NVME]]
    log = EventLog(keep=keep)
    model: collections.deque[BlockEvent] = collections.deque(maxlen=keep)
    for seq, (ns, key, tiers) in enumerate(changes, start=1):
        log.record((ns, key), sets[tiers])
        model.append(BlockEvent(seq, (ns, key), tuple(sets[tiers])))
    assert list(log.history(after)) == [e for e in model if e.seq > after]
    oldest = model[0].seq if model else len(changes) + 1
    if after + 1 < oldest or after > len(changes):
        with pytest.raises(Resync):
            log.watch(everything, log.epoch, after)
    else:
        watcher = log.watch(everything, log.epoch, after)
        assert watcher.queued(100) == [e for e in model if e.seq > after]


@settings(max_examples=300, deadline=None)
@given(
    keep=st.integers(1, 12),
    runs=st.lists(
        st.tuples(
            st.lists(
                st.tuples(st.sampled_from(["default|a", "t|b", "t|c"]), st.binary(max_size=3))
            ),
            st.integers(0, 3),
            st.booleans(),
        ),
        max_size=6,
    ),
    watching=st.booleans(),
)
def test_a_run_of_events_is_those_events_one_by_one(
    keep: int, runs: list[tuple[list[tuple[str, bytes]], int, bool]], watching: bool
) -> None:
    """`record_many` (recovery's bulk adds) leaves the log as `record` of each would:
    the same seqs, the same ring whatever the wrap-around or a run longer than the ring,
    and a watcher offered each event."""
    sets = [[], [DRAM], [NVME], [DRAM, NVME]]
    bulk, one = EventLog(keep=keep), EventLog(keep=keep)
    watchers = [log.watch(everything, "", 0) for log in (bulk, one)] if watching else []
    for blocks, tiers, many in runs:
        for ns, key in blocks:
            one.record((ns, key), sets[tiers])
        if many:
            bulk.record_many([ns for ns, _ in blocks], [key for _, key in blocks], sets[tiers])
        else:
            for ns, key in blocks:
                bulk.record((ns, key), sets[tiers])
        assert bulk.seq == one.seq
        assert list(bulk.history()) == list(one.history())
    if watchers:
        assert watchers[0].queued(1000) == watchers[1].queued(1000)


def test_a_run_needs_a_namespace_for_each_key() -> None:
    with pytest.raises(ValueError, match="one namespace a key"):
        EventLog().record_many(["default|a"], [b"k", b"l"], [NVME])
