"""The packed policies decide as policy.py's: the same calls (keys mapped to slots by a
random bijection) give the same victims, lengths and memberships; their tables agree
with the OrderedDicts they replace; and they keep no object per block."""

from __future__ import annotations

import gc
import heapq
import random
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvtier.sim.replay as replay_module
from kvtier.index.packed_policies import PackedGhosts, PackedReuse
from kvtier.index.packed_policy import (
    NO_SLOT,
    DigestSketch,
    PackedLru,
    PackedS3Fifo,
    PackedValue,
    SlotPolicy,
)
from kvtier.index.planner import PrefillCost, TierCost
from kvtier.index.policy import (
    BlockInfo,
    FrequencySketch,
    Ghosts,
    Key,
    LruPolicy,
    ReuseEstimator,
    S3FifoPolicy,
    TierPolicy,
    ValueModel,
    ValuePolicy,
)
from kvtier.index.slots import DigestTable, key_digest
from kvtier.sim.packed import KeyedPolicies
from kvtier.sim.replay import ReplayConfig, Request, read_trace, replay
from tests.sim.test_replay import TRACE

PREFILL = PrefillCost(40e-6, 1.3e-9)
DRAM = TierCost(50e9, 10e-6)
# Savings by model, for blocks of 1-16 KiB at positions 0-3: all positive; NVMe about as
# dear as recomputing (small blocks save a little, 16 KiB ones nothing: many ties); NVMe
# slower than recomputing (nothing saves anything: every priority is L, all ties).
MODEL = ValueModel(16, 1024, PREFILL, {"dram": DRAM, "nvme": TierCost(7e9, 100e-6)})
MIXED = ValueModel(16, 1024, PREFILL, {"dram": DRAM, "nvme": TierCost(2e8, 600e-6)})
ZERO = ValueModel(16, 1024, PREFILL, {"dram": DRAM, "nvme": TierCost(1e6, 1.0)})
VALUE_TIERS = [
    ("dram", "nvme", MODEL),
    ("nvme", None, MODEL),
    ("nvme", None, MIXED),
    ("nvme", None, ZERO),
]
SIZES = (1024, 4096, 16384)
KEYS = 24


def block_id(i: int) -> tuple[str, bytes]:
    return ("t|ns", i.to_bytes(4, "little"))


# ---- the reference: policy.py, and when ValuePolicy may order differently --------------


class _Counter:
    """itertools.count that remembers the last value it gave."""

    def __init__(self) -> None:
        self.last = -1

    def __iter__(self) -> _Counter:
        return self

    def __next__(self) -> int:
        self.last += 1
        return self.last


class ObservedValuePolicy(ValuePolicy):
    """ValuePolicy that can tell when one of its stale heap items has come back to life:
    a block's item from before its latest insert carries its current priority again
    (the one case PackedValue is documented to order differently). With `purge`, a
    block's items go when it leaves, so that never happens: PackedValue's semantics."""

    def __init__(self, *args: Any, purge: bool = False) -> None:
        super().__init__(*args)
        self._seq = _Counter()  # type: ignore[assignment]
        self._born: dict[Key, int] = {}
        self._purge = purge

    def remove(self, key: Key) -> None:
        super().remove(key)
        if self._purge:
            self._heap = [item for item in self._heap if item[3] != key]
            heapq.heapify(self._heap)

    def insert(self, key: Key, info: BlockInfo) -> None:
        if key not in self:
            self._born[key] = self._seq.last + 1  # type: ignore[attr-defined]
        super().insert(key, info)

    def resurrected(self) -> bool:
        return any(
            self._priority.get(key) == priority and seq < self._born[key]
            for priority, _, seq, key in self._heap
        )


# ---- driving both with the same calls --------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.integers(0, KEYS - 1),
            st.sampled_from(SIZES),
            st.integers(0, 3),
            st.one_of(st.none(), st.integers(0, KEYS - 1)),
        ),
        st.tuples(st.just("hit"), st.integers(0, KEYS - 1)),
        st.tuples(st.just("access"), st.integers(0, KEYS - 1)),
        st.tuples(st.just("remove"), st.integers(0, KEYS - 1)),
        st.tuples(st.just("reach"), st.integers(0, KEYS - 1), st.booleans()),
        st.tuples(st.just("victim"), st.frozensets(st.integers(0, KEYS - 1), max_size=6)),
    ),
    min_size=40,  # left to itself, Hypothesis makes most runs a handful of calls long
    max_size=200,
)


@dataclass
class Pair:
    """policy.py's tier keyed by block ids and a packed one keyed by slots."""

    old: TierPolicy
    new: SlotPolicy
    slot_of: list[int]  # block i -> slot
    sketch: FrequencySketch = field(default_factory=FrequencySketch)
    check_members: bool = True  # after every call, for every block
    victims: int = 0

    def key_of(self, slot: int) -> int:
        return self.slot_of.index(slot)

    def run(self, op: tuple[Any, ...], stop: Callable[[], bool] = lambda: False) -> None:
        name, *args = op
        if name == "insert":
            i, size, position, parent = args
            self.old.insert(
                block_id(i),
                BlockInfo(size, position, None if parent is None else block_id(parent)),
            )
            self.new.insert(
                self.slot_of[i], size, position, NO_SLOT if parent is None else self.slot_of[parent]
            )
        elif name == "hit":
            self.old.hit(block_id(args[0]))
            self.new.hit(self.slot_of[args[0]])
        elif name == "access":
            self.sketch.add(block_id(args[0]))
        elif name == "remove":
            self.old.remove(block_id(args[0]))
            self.new.remove(self.slot_of[args[0]])
        elif name == "reach":
            i, held = args
            self.old.reached(block_id(i), held)
            self.new.reached(key_digest(block_id(i)), held)
        else:
            pinned = {block_id(i) for i in args[0]}
            pinned_slots = {self.slot_of[i] for i in args[0]}
            old = self.old.victim(lambda k: k not in pinned)
            new = self.new.victim(lambda s: s not in pinned_slots)
            if stop():
                return
            assert old == (None if new is None else block_id(self.key_of(new))), op
            if old is None:  # what the caller asks last: a victim the order's rules held
                old = self.old.last_resort(lambda k: k not in pinned)
                new = self.new.last_resort(lambda s: s not in pinned_slots)
                assert old == (None if new is None else block_id(self.key_of(new))), op
            self.victims += old is not None
        assert len(self.old) == len(self.new)
        if self.check_members:
            for i in range(len(self.slot_of)):
                assert (block_id(i) in self.old) == (self.slot_of[i] in self.new)


def _pair(kind: str, slot_of: list[int], capacity_bytes: int = 64 * 1024) -> Pair:
    digests = {slot: key_digest(block_id(i)) for i, slot in enumerate(slot_of)}
    if kind == "lru":
        return Pair(LruPolicy(), PackedLru(), slot_of)
    return Pair(
        S3FifoPolicy(capacity_bytes), PackedS3Fifo(capacity_bytes, digests.__getitem__), slot_of
    )


def _value_pair(
    slot_of: list[int],
    tier: str,
    fallback: str | None,
    model: ValueModel,
    purge: bool = False,
    shadow: bool = False,
    reach_net: bool = False,
) -> Pair:
    sketch = FrequencySketch()
    keys = {slot: block_id(i) for i, slot in enumerate(slot_of)}
    old = ObservedValuePolicy(tier, fallback, model, sketch, shadow, reach_net, purge=purge)
    new = PackedValue(
        tier,
        fallback,
        model,
        lambda slot: sketch.count(keys[slot]),
        lambda slot: key_digest(keys[slot]),
        shadow=shadow,
        reach_net=reach_net,
    )
    return Pair(old, new, slot_of, sketch)


slot_maps = st.permutations(range(KEYS))


@settings(max_examples=300, deadline=None)
@given(calls=ops, slot_of=slot_maps, capacity=st.sampled_from([4096, 20000, 64 * 1024]))
@pytest.mark.parametrize("kind", ["lru", "s3fifo"])
def test_lru_and_s3fifo_choose_the_same_victims(
    kind: str, calls: list[tuple[Any, ...]], slot_of: list[int], capacity: int
) -> None:
    pair = _pair(kind, slot_of, capacity)
    for op in calls:
        pair.run(op)


@settings(max_examples=300, deadline=None)
@given(
    calls=ops,
    slot_of=slot_maps,
    which=st.integers(0, len(VALUE_TIERS) - 1),
    reach_net=st.booleans(),
)
def test_value_policy_chooses_the_same_victims_as_one_that_forgets_a_leaving_block(
    calls: list[tuple[Any, ...]], slot_of: list[int], which: int, reach_net: bool
) -> None:
    pair = _value_pair(slot_of, *VALUE_TIERS[which], purge=True, reach_net=reach_net)
    for op in calls:
        pair.run(op)


@settings(max_examples=300, deadline=None)
@given(calls=ops, slot_of=slot_maps, which=st.integers(0, len(VALUE_TIERS) - 1))
def test_value_policy_chooses_the_same_victims_until_a_stale_item_returns(
    calls: list[tuple[Any, ...]], slot_of: list[int], which: int
) -> None:
    pair = _value_pair(slot_of, *VALUE_TIERS[which])
    old = pair.old
    assert isinstance(old, ObservedValuePolicy)
    for op in calls:
        pair.run(op, stop=old.resurrected)
        if old.resurrected():
            # Past this point ValuePolicy may order by a stale item (see the test below).
            event("a stale ValuePolicy item came back")
            return


@pytest.mark.parametrize("net", ["", "shadow", "reach"])
@pytest.mark.parametrize(("tier", "fallback", "model"), VALUE_TIERS)
def test_value_policy_same_victims_over_long_random_runs(
    tier: str, fallback: str | None, model: ValueModel, net: str
) -> None:
    """Thousands of calls as a store makes them: chains looked up (a use, then a hit or
    an insert per block), a tier kept to 150 blocks with a few pinned, some removed.
    Against ValuePolicy without its stale items: with them, a removed block that comes
    back at its old priority soon resurrects one (see the test below)."""
    rng = random.Random(f"{tier}{fallback}{model}")
    blocks = 400
    slot_of = list(range(blocks))
    rng.shuffle(slot_of)
    pair = _value_pair(
        slot_of, tier, fallback, model, purge=True, shadow=net == "shadow", reach_net=net == "reach"
    )
    pair.check_members = False
    old = pair.old
    assert isinstance(old, ObservedValuePolicy)
    chains = [[rng.randrange(blocks) for _ in range(rng.randint(1, 12))] for _ in range(60)]
    parent: dict[int, int | None] = {}
    lowest = 1.0  # the safety net's weight
    for _ in range(1200):
        chain = rng.choice(chains)
        for i, b in enumerate(chain):
            parent.setdefault(b, chain[i - 1] if i and chain[i - 1] != b else None)
            pair.run(("reach", b, block_id(b) in old))
            pair.run(("access", b))
            pair.run(("insert", b, rng.choice(SIZES), i, parent[b]))
        while len(pair.new) > 150:
            pair.run(("victim", frozenset(rng.sample(range(blocks), 5))))
            lowest = min(lowest, old.weight)
        if rng.random() < 0.05:
            pair.run(("remove", rng.randrange(blocks)))
    assert pair.victims > 500, pair.victims
    assert all((block_id(i) in old) == (slot_of[i] in pair.new) for i in range(blocks))
    # The safety net's weight moved the same way in both (and moved: some victims were
    # the least recent leaf's, not the value heap's).
    assert isinstance(pair.new, PackedValue)
    assert old.weight == pair.new.weight
    assert (lowest < 0.9) == (net != ""), lowest


def test_where_value_policies_differ_a_stale_item_back_at_its_old_priority() -> None:
    """ValuePolicy's heap keeps a block's superseded items; one whose priority equals the
    block's again (here: nothing saves anything, so every priority is L = 0) counts
    again, with its old seq, and the returning block jumps the queue. PackedValue treats
    the returning block as new: A's second stay is younger than B."""
    old = ObservedValuePolicy("nvme", None, ZERO, FrequencySketch())
    new = PackedValue("nvme", None, ZERO, lambda slot: 1)
    a, b = block_id(0), block_id(1)  # slots 0 and 1
    old.insert(a, BlockInfo(4096))
    old.hit(a)  # a second heap item for A, at the same priority
    old.insert(b, BlockInfo(4096))
    new.insert(0, 4096)
    new.hit(0)
    new.insert(1, 4096)
    assert old.victim(lambda k: True) == a and new.victim(lambda s: True) == 0
    old.insert(a, BlockInfo(4096))
    new.insert(0, 4096)
    assert old.resurrected()
    assert old.victim(lambda k: True) == a  # A's stale second item, older than B's
    assert new.victim(lambda s: True) == 1  # B, in the order the blocks arrived


# ---- the tables that replace OrderedDicts ------------------------------------------------

# Digests that share their low bits, so probe runs are long and the index wraps.
digests = st.builds(lambda lo, hi: lo | hi << 40, st.integers(0, 15), st.integers(0, 7))


@settings(max_examples=300, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.sampled_from(["put", "move", "pop", "oldest", "exchange", "trim"]),
            digests,
            st.integers(0, 255),
        ),
        max_size=300,
    )
)
def test_digest_table_is_an_ordered_dict(calls: list[tuple[str, int, int]]) -> None:
    table, model = DigestTable(), OrderedDict[int, int]()
    for name, digest, value in calls:
        if name in ("put", "move"):
            table.put(digest, value, to_end=name == "move")
            model[digest] = value
            if name == "move":
                model.move_to_end(digest)
        elif name == "pop":
            assert table.pop(digest) == model.pop(digest, -1)
        elif name == "exchange":
            assert table.exchange(digest, value) == model.get(digest, -1)
            model[digest] = value
            model.move_to_end(digest)
        elif name == "trim":
            table.trim(value % 8)
            while len(model) > value % 8:
                model.popitem(last=False)
        elif model:
            assert table.pop_oldest() == model.popitem(last=False)[0]
        assert len(table) == len(model)
        assert table.get(digest) == model.get(digest, -1)
    assert [table.pop_oldest() for _ in range(len(table))] == list(model)


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.booleans(), st.integers(0, 30), st.integers(0, 5), st.integers(-1, 6)),
        max_size=200,
    ),
    remembered=st.integers(1, 12),
)
def test_reuse_estimate_is_the_same(
    calls: list[tuple[bool, int, int, int]], remembered: int
) -> None:
    old, new = ReuseEstimator(remembered), PackedReuse(remembered)
    for observe, i, uses, from_end in calls:
        key = block_id(i)
        info = BlockInfo(4096, 0, None, from_end)
        if observe:
            old.observe(key, uses, info)
            new.observe(key_digest(key), uses, from_end)
        assert old.p_reuse(key, uses, info) == new.p_reuse(key_digest(key), uses, from_end)
        bucket = old.bucket(uses, info)
        assert new.bucket(uses, from_end) == bucket
        assert old.probability(bucket) == new.probability(bucket)


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=200),
    capacity=st.integers(1, 10),
)
def test_ghosts_are_the_same(calls: list[tuple[bool, int]], capacity: int) -> None:
    old, new = Ghosts(capacity), PackedGhosts(capacity)
    for add, i in calls:
        if add:
            old.add(block_id(i))
            new.add(key_digest(block_id(i)))
        else:
            assert old.take(block_id(i)) == new.take(key_digest(block_id(i)))
        assert len(old) == len(new)


@settings(max_examples=100, deadline=None)
@given(
    # a few hot keys (past the counters' 15) among many cold ones
    adds=st.lists(
        st.integers(0, 4) | st.integers(0, 300).map(block_id), min_size=100, max_size=400
    ),
    width=st.sampled_from([16, 256, 1 << 16]),
    reset_after=st.sampled_from([50, 1000]),
)
def test_sketch_counts_what_frequency_sketch_counts(
    adds: list[Key], width: int, reset_after: int
) -> None:
    """Keyed by `key_digest`, the same keys collide: the counts are equal (saturated and
    halved too), and `add` returns the count after it."""
    old = FrequencySketch(width, reset_after=reset_after)
    new = DigestSketch(width, reset_after=reset_after)
    for key in adds:
        old.add(key)
        assert new.add(key_digest(key)) == old.count(key)
        assert old.count(key) == new.count(key_digest(key))
    assert all(old.count(k) == new.count(key_digest(k)) for k in [*adds, "never added"])


def test_sketch_width_must_be_a_power_of_two_it_can_index() -> None:
    for width in (0, 100, 1 << 17):
        with pytest.raises(ValueError, match="power of two"):
            DigestSketch(width)


# ---- the replay: the same figures -------------------------------------------------------


def _replays(
    config: ReplayConfig, requests: list[Request], modes: tuple[bool, ...] = (False, True)
) -> list[dict[str, Any]]:
    """The report with policy.py's policies, then with the packed ones: tier orders only
    (False) or everything (True)."""
    reports = [replay(config, requests)[0]]
    for packed_counts in modes:
        with mock.patch.object(
            replay_module, "Policies", partial(KeyedPolicies, packed_counts=packed_counts)
        ):
            reports.append(replay(config, requests)[0])
    return reports


@settings(max_examples=25, deadline=None)
@given(
    chains=st.lists(
        st.lists(st.integers(0, 60), min_size=1, max_size=10, unique=True), min_size=1, max_size=80
    ),
    policy=st.sampled_from(["lru", "s3fifo", "kvtier"]),
    admission=st.sampled_from(["write_back", "selective", "write_through"]),
)
def test_replay_of_random_traces_gives_the_same_figures(
    chains: list[list[int]], policy: str, admission: str
) -> None:
    # Ids of a chain are chained hashes: equal ids, equal prefixes (a fresh id per prefix).
    prefixes: dict[tuple[int, ...], int] = {}
    requests = [
        Request(
            n * 1000.0,
            512 * len(chain),
            1,
            [prefixes.setdefault(tuple(chain[: i + 1]), len(prefixes)) for i in range(len(chain))],
        )
        for n, chain in enumerate(chains)
    ]
    config = ReplayConfig(6, 12, policy=policy, admission=admission)  # type: ignore[arg-type]
    old, tiers, packed = _replays(config, requests)
    assert tiers == old
    assert packed == old


@pytest.mark.skipif(not TRACE.exists(), reason="the shared Mooncake trace is not here")
@pytest.mark.parametrize("policy", ["lru", "s3fifo", "kvtier"])
def test_replay_of_the_shared_trace_gives_the_same_figures(policy: str) -> None:
    """`kvtier replay TRACE --dram-capacity 5000 --admission write_back`, all packed
    (benchmarks/packed_policy.py prints the figures, and the tier-orders-only run)."""
    config = ReplayConfig(5000, 20000, policy=policy, admission="write_back")
    old, packed = _replays(config, read_trace(Path(TRACE)), modes=(True,))
    assert packed == old


# ---- nothing per block for the collector, and a few bytes a block ----------------------

BLOCKS = 20000


def _fill(policy: SlotPolicy, blocks: int) -> None:
    for slot in range(blocks):
        policy.insert(slot, 4096, slot % 64, slot - 1 if slot % 64 else NO_SLOT)
    for slot in range(0, blocks, 7):
        policy.hit(slot)


def _packed(kind: str) -> SlotPolicy:
    if kind == "lru":
        return PackedLru()
    if kind == "s3fifo":
        return PackedS3Fifo(1 << 40, lambda slot: slot * 0x9E3779B97F4A7C15 % 2**64)
    # DRAM's saving is the same at every position: a chain's blocks tie, so an insert
    # does not raise all its ancestors (as in a real chain; that is time, not memory).
    return PackedValue("dram", "nvme", MODEL, lambda slot: 1)


@pytest.mark.parametrize(("kind", "bytes_per_block"), [("lru", 10), ("s3fifo", 18), ("kvtier", 68)])
def test_a_block_costs_a_few_bytes_and_no_object(kind: str, bytes_per_block: int) -> None:
    gc.collect()
    tracemalloc.start()
    try:
        before_objects = len(gc.get_objects())
        before_bytes = tracemalloc.get_traced_memory()[0]
        policy = _packed(kind)
        _fill(policy, BLOCKS)
        # evict a tenth so S3-FIFO's ghosts fill too
        for _ in range(BLOCKS // 10):
            policy.victim(lambda s: True)
        gc.collect()
        grown_objects = len(gc.get_objects()) - before_objects
        grown_bytes = tracemalloc.get_traced_memory()[0] - before_bytes
    finally:
        tracemalloc.stop()
    assert grown_objects < 50  # the policy and its arrays, not one per block
    ghosts = BLOCKS // 10 * 30 if kind == "s3fifo" else 0
    assert grown_bytes < BLOCKS * bytes_per_block + ghosts + 4096


def test_the_value_order_evicts_a_parent_as_a_last_resort_both_copies() -> None:
    """Two blocks each other's parent (chains disagreeing on their order): no leaf, so
    `victim` gives none, and `last_resort` the least recently used of them, in both
    copies; once it is gone the other is a leaf again."""
    pair = _value_pair(list(range(KEYS)), "nvme", None, MODEL)
    pair.run(("insert", 0, 4096, 1, 1))
    pair.run(("insert", 1, 4096, 1, 0))
    assert pair.old.victim(lambda k: True) is None
    assert pair.new.victim(lambda s: True) is None
    pair.run(("victim", frozenset()))  # Pair.run asks last_resort of both, and compares
    assert pair.victims == 1 and len(pair.old) == len(pair.new) == 1
    assert pair.old.victim(lambda k: True) == block_id(1)
    assert pair.new.victim(lambda s: True) == 1
