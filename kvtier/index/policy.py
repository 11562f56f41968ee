"""What to keep where: eviction order per tier, admission to NVMe, and lost-reuse ghosts.

Pure bookkeeping (no I/O, no clock of its own), used by the daemon's store and by
`kvtier replay` alike, so what the replay measures is what the daemon does.

A `TierPolicy` orders one tier's blocks for eviction: `insert` when a block lands in the
tier, `hit` when it is used there, `remove` when it leaves for any reason other than being
chosen, and `victim(evictable)` to choose (and forget) the next block to evict, skipping
blocks the caller cannot evict now (leased, being written). Three are selectable:

* `lru` — least recently used first.
* `s3fifo` — S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO with
  one-bit-per-use second chances, and a ghost FIFO that sends returning blocks straight to
  main. Scan-resistant, a strong simple baseline.
* `kvtier` — eviction by value: a block's priority is
  `L + uses × saving_s / size_bytes` (greedy-dual-size-frequency, Cao & Irani), where
  `saving_s` is what one more use of the block saves by being in this tier rather than in
  the tier it would fall to (recompute when it is the last), from the planner's cost
  model at the block's position in its chain — a late block is worth more than an early
  one because attention makes it dearer to recompute. `freq` counts uses, remembered
  across evictions by a count-min sketch, and `L` rises to each evicted priority, so blocks
  not used for a long time age out. A block is worth at least what the blocks extending
  its chain are worth (without it they are useless), so its priority is raised to theirs:
  leaves are evicted before their parents. The last tier's (NVMe's) order, with a safety
  net towards recency (kvtier/index/reach_net.py).

DRAM, the first tier, under `kvtier` is `ChainArcPolicy` instead: every DRAM hit saves the
same (one NVMe fetch), so value adds nothing there; a block's use count and whether it
ended a finished prompt tell what comes back soon (its docstring).

`Admission` decides whether a block evicted from DRAM is written to NVMe: `write_back`
always, `selective` where its learned P(reuse) is high enough, `write_through` at insert.
`Ghosts` remember recently dropped keys: a later miss on one is reuse lost to eviction.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Literal

import xxhash

from kvtier.index.planner import PrefillCost, TierCost
from kvtier.index.reach_net import ReachNet
from kvtier.index.slots import key_digest

Key = Hashable
POLICIES = ("lru", "s3fifo", "kvtier")
PolicyName = Literal["lru", "s3fifo", "kvtier"]
ADMISSIONS = ("write_back", "selective", "write_through")
AdmissionMode = Literal["write_back", "selective", "write_through"]


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What the policy knows of a block besides its key: its size and place in a chain."""

    size_bytes: int
    position: int = 0  # index of the block in its chain (0: first); unknown reads as 0
    parent: Key | None = None
    from_end: int = -1  # blocks after it in the chain it arrived with (-1: unknown)


class TierPolicy(ABC):
    """Eviction order of one tier."""

    @abstractmethod
    def insert(self, key: Key, info: BlockInfo) -> None: ...

    @abstractmethod
    def hit(self, key: Key) -> None: ...

    @abstractmethod
    def remove(self, key: Key) -> None: ...

    @abstractmethod
    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        """The next block to evict (forgotten by the policy), or None if none may go."""

    def last_resort(self, evictable: Callable[[Key], bool]) -> Key | None:
        """A victim when `victim` found none for any predicate the caller tried: one its
        own rules held back (a parent, for an order that evicts leaves first)."""
        return None

    def reached(self, key: Key, held: bool) -> None:
        """A request for `key` no tier above held: this tier served it (`held`, called
        before the `hit` that follows), or no tier had it (ValuePolicy's `reach_net`)."""
        return None

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


class LruPolicy(TierPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, info: BlockInfo) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def hit(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        for key in self._order:
            if evictable(key):
                del self._order[key]
                return key
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class S3FifoPolicy(TierPolicy):
    """S3-FIFO by bytes: small queue 10 % of the tier, main the rest, ghosts as many keys
    as main holds."""

    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity = capacity_bytes
        self._small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}
        self._size: dict[Key, int] = {}
        self._small_bytes = 0

    def insert(self, key: Key, info: BlockInfo) -> None:
        if key in self._size:
            self.hit(key)
            return
        self._size[key] = info.size_bytes
        self._freq[key] = 0
        if self._ghost.pop(key, "absent") is None:
            self._main[key] = None
        else:
            self._small[key] = None
            self._small_bytes += info.size_bytes

    def hit(self, key: Key) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def remove(self, key: Key) -> None:
        if key not in self._size:
            return
        if self._small.pop(key, "absent") is None:
            self._small_bytes -= self._size[key]
        self._main.pop(key, None)
        del self._size[key], self._freq[key]

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        # Bounded: every block is looked at a few times at most (freq only goes down).
        for _ in range(4 * (len(self._size) + 1)):
            use_small = self._small and (
                self._small_bytes >= self.SMALL_FRACTION * self._capacity or not self._main
            )
            queue = self._small if use_small else self._main
            if not queue:
                return None
            key = next(iter(queue))
            if not evictable(key):
                queue.move_to_end(key)  # in use: look again later
                continue
            if use_small:
                del self._small[key]
                self._small_bytes -= self._size[key]
                if self._freq[key] > 0:
                    self._freq[key] = 0
                    self._main[key] = None  # used while on probation: promote
                    continue
                self._remember_ghost(key)
            else:
                if self._freq[key] > 0:
                    self._freq[key] -= 1
                    self._main.move_to_end(key)  # a second chance
                    continue
                del self._main[key]
            del self._size[key], self._freq[key]
            return key
        return None

    def _remember_ghost(self, key: Key) -> None:
        self._ghost[key] = None
        while len(self._ghost) > max(len(self._main), 1):
            self._ghost.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)


class FrequencySketch:
    """Count-min sketch of uses (4 rows, 4-bit-ish saturating counters kept as ints),
    halved every `reset_after` increments so old popularity fades (TinyLFU's aging)."""

    ROWS = 4

    def __init__(self, width: int = 1 << 16, reset_after: int | None = None) -> None:
        self._width = width
        self._rows = [[0] * width for _ in range(self.ROWS)]
        self._reset_after = reset_after or 10 * width
        self._added = 0

    def _slots(self, key: Key) -> list[int]:
        digest = xxhash.xxh3_128_intdigest(repr(key).encode())
        return [(digest >> (32 * i)) % self._width for i in range(self.ROWS)]

    def add(self, key: Key) -> None:
        for row, slot in zip(self._rows, self._slots(key), strict=True):
            if row[slot] < 15:
                row[slot] += 1
        self._added += 1
        if self._added >= self._reset_after:
            self._added = 0
            for row in self._rows:
                for i, count in enumerate(row):
                    row[i] = count >> 1

    def count(self, key: Key) -> int:
        return min(row[slot] for row, slot in zip(self._rows, self._slots(key), strict=True))


@dataclass(frozen=True, slots=True)
class ValueModel:
    """Seconds one use of a block saves, by where it is kept: the planner's cost model."""

    tokens_per_block: int  # 0: a block holds size_bytes / kv_bytes_per_token tokens
    kv_bytes_per_token: int
    prefill: PrefillCost
    tier_costs: dict[str, TierCost]  # may be updated in place as estimates change

    def recompute_s(self, info: BlockInfo) -> float:
        tokens = self.tokens_per_block or max(info.size_bytes // self.kv_bytes_per_token, 1)
        start = info.position * tokens
        return self.prefill.seconds(start, start + tokens) - self.prefill.step_s

    def fetch_s(self, tier: str, size_bytes: int) -> float:
        return self.tier_costs[tier].fetch_s(size_bytes)

    def saving_s(self, tier: str, fallback: str | None, info: BlockInfo) -> float:
        """Seconds per use saved by keeping the block in `tier` rather than `fallback`
        (None: recompute). Never negative: a block dearer to fetch than to recompute is
        worth nothing (the planner would not fetch it)."""
        recompute = self.recompute_s(info)
        here = min(recompute, self.fetch_s(tier, info.size_bytes))
        there = (
            recompute
            if fallback is None
            else min(recompute, self.fetch_s(fallback, info.size_bytes))
        )
        return max(there - here, 0.0)


class ReuseEstimator:
    """P(a block is used again) by what is known of it: uses so far and, for a block that
    arrived near the end of its chain (a prompt's tail rarely recurs: the next turn extends
    it into a new block), how near. Learned online, and only from outcomes already known:
    each placement or use of a block is *pending* in its bucket until it resolves, as a
    reuse when the block is used again, or as no reuse when `remembered_keys` other keys
    have been seen since (it falls out of the memory of last buckets). So P is the chance
    of a use again within that horizon (the tiers' reach, in keys: `Policies` passes its
    ghost capacity), and it is not biased low while reuses are still on their way.

    (Counted at once, every recent placement read as not reused yet: docs/design.md,
    "Admission".) Before the first outcome a bucket reads 1/2 (Laplace), so a cold start
    admits like write-back until the evidence arrives."""

    def __init__(self, remembered_keys: int = 1 << 20) -> None:
        self._resolved: dict[tuple[int, int], int] = {}
        self._reused: dict[tuple[int, int], int] = {}
        # Bounded: a daemon sees unbounded keys; the least recently seen are forgotten
        # first, which resolves their last placement as not reused.
        self._last: OrderedDict[Key, tuple[int, int]] = OrderedDict()
        self._remembered = max(remembered_keys, 1)

    @staticmethod
    def bucket(uses: int, info: BlockInfo) -> tuple[int, int]:
        return min(uses, 3), min(info.from_end, 3) if info.from_end >= 0 else -1

    def observe(self, key: Key, uses: int, info: BlockInfo) -> None:
        """Record a placement or use of `key` (which resolves its previous one as reused)."""
        previous = self._last.get(key)
        if previous is not None:
            self._reused[previous] = self._reused.get(previous, 0) + 1
            self._resolved[previous] = self._resolved.get(previous, 0) + 1
        bucket = self.bucket(uses, info)
        self._last[key] = bucket
        self._last.move_to_end(key)
        if len(self._last) > self._remembered:
            _, forgotten = self._last.popitem(last=False)
            self._resolved[forgotten] = self._resolved.get(forgotten, 0) + 1

    def probability(self, bucket: tuple[int, int]) -> float:
        return (self._reused.get(bucket, 0) + 1) / (self._resolved.get(bucket, 0) + 2)

    def p_reuse(self, key: Key, uses: int, info: BlockInfo) -> float:
        """P(reuse) of a block: its last bucket if it was seen, else the one it would be in."""
        bucket = self._last.get(key)
        return self.probability(bucket if bucket is not None else self.bucket(uses, info))


class ValuePolicy(TierPolicy):
    """Greedy-dual-size-frequency on the planner's savings, leaves before parents, with a
    safety net towards recency where the value order loses.

    With `shadow` (the DRAM order: every request of a block reaches it as a hit or an
    insert), a shadow LRU of as many keys as the tier holds sees the same calls: a hit
    here that the shadow would have missed is a point for the value order, a miss here
    that it would have hit a point for recency, and each moves `weight` (the share of
    victims the value order chooses, 1 at start) by `step`. The other victims are the
    least recently used leaves. Where the value order is right the weight stays at 1 and
    nothing changes; where it is wrong (traffic it was not tuned for) the order drifts to
    recency, so it is not far below LRU anywhere (ARC's and LeCaR's adaptation, with the
    shadow in place of their ghost lists). With `reach_net` (NVMe's order) the weight
    moves by kvtier/index/reach_net.py's net, scored by the requests reaching the tier."""

    STEP = 0.01

    def __init__(
        self,
        tier: str,
        fallback: str | None,
        model: ValueModel,
        sketch: FrequencySketch,
        shadow: bool = False,
        reach_net: bool = False,
    ) -> None:
        self._tier = tier
        self._fallback = fallback
        self._model = model
        self._sketch = sketch
        self._inflation = 0.0  # L: rises to each evicted priority
        self._priority: dict[Key, float] = {}
        self._info: dict[Key, BlockInfo] = {}
        self._children: dict[Key, set[Key]] = {}  # cached children in this tier
        self._heap: list[tuple[float, int, int, Key]] = []  # (priority, -position, seq, key)
        self._seq = itertools.count()
        self._recency: OrderedDict[Key, None] = OrderedDict()  # least recent first
        self._shadow: OrderedDict[Key, None] | None = OrderedDict() if shadow else None
        self._reach = ReachNet() if reach_net else None
        self.weight = 1.0
        self._credit = 0.0  # victims owed to the value order

    def _touch(self, key: Key, hit: bool) -> None:
        self._recency[key] = None
        self._recency.move_to_end(key)
        if self._reach is not None:
            self._reach.touched(key_digest(key), len(self._info))
        shadow = self._shadow
        if shadow is None:
            return
        if (key in shadow) != hit:
            step = self.STEP if hit else -self.STEP
            self.weight = min(max(self.weight + step, 0.0), 1.0)
        shadow[key] = None
        shadow.move_to_end(key)
        while len(shadow) > max(len(self._info), 1):
            shadow.popitem(last=False)

    def reached(self, key: Key, held: bool) -> None:
        if self._reach is not None:
            step = self._reach.reached(key_digest(key), held)
            self.weight = min(max(self.weight + step, 0.0), 1.0)

    def _own_priority(self, key: Key) -> float:
        info = self._info[key]
        saving = self._model.saving_s(self._tier, self._fallback, info)
        # Uses stand for P(reuse) here, not the learned estimate: a priority is fixed when it
        # is set, and bucket estimates drift as they learn, which would make old and new
        # priorities incomparable (old blocks kept on stale optimism). The learned
        # estimate drives admission, which is decided on the spot.
        uses = max(self._sketch.count(key), 1)
        return self._inflation + uses * saving / max(info.size_bytes, 1)

    def _set(self, key: Key, priority: float) -> None:
        self._priority[key] = priority
        heapq.heappush(self._heap, (priority, -self._info[key].position, next(self._seq), key))
        # A parent is worth at least its children: raise the chain above this block.
        parent = self._info[key].parent
        while parent is not None and parent in self._priority:
            if self._priority[parent] >= priority:
                break
            self._priority[parent] = priority
            info = self._info[parent]
            heapq.heappush(self._heap, (priority, -info.position, next(self._seq), parent))
            parent = info.parent

    def insert(self, key: Key, info: BlockInfo) -> None:
        if key in self._info:
            self.hit(key)
            return
        self._info[key] = info
        self._touch(key, hit=False)
        if info.parent is not None:
            self._children.setdefault(info.parent, set()).add(key)
        # Arriving after blocks that extend it (e.g. promoted later): worth as much as they.
        floor = max(
            (self._priority.get(c, 0.0) for c in self._children.get(key, ()) if c != key),
            default=0.0,
        )
        self._set(key, max(self._own_priority(key), floor))

    def hit(self, key: Key) -> None:
        if key in self._info:
            self._touch(key, hit=True)
            self._set(key, max(self._own_priority(key), self._priority[key]))

    def remove(self, key: Key) -> None:
        info = self._info.pop(key, None)
        if info is None:
            return
        del self._priority[key]  # its heap items are now stale and skipped
        del self._recency[key]
        siblings = self._children.get(info.parent) if info.parent is not None else None
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[info.parent]

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        self._credit += self.weight
        chosen: Key | None = None
        if self._credit < 1.0:
            chosen = self._least_recent_leaf(evictable)
        if chosen is None:
            self._credit = max(self._credit - 1.0, 0.0)
            chosen = self._by_value(evictable)
        if chosen is not None:
            self.remove(chosen)
        if len(self._heap) > 4 * len(self._priority) + 1024:
            self._compact()
        return chosen

    def last_resort(self, evictable: Callable[[Key], bool]) -> Key | None:
        """ChainArcPolicy.last_resort, for this order: the least recently used evictable
        block, parent or not (L unchanged: no value was weighed)."""
        chosen = next((key for key in self._recency if evictable(key)), None)
        if chosen is not None:
            self.remove(chosen)
        return chosen

    def _least_recent_leaf(self, evictable: Callable[[Key], bool]) -> Key | None:
        # A chain's blocks are used front to back, so its head is older than its tail:
        # the first leaf from the old end is that chain's tail, and the chain leaves
        # tail first, as the value order's leaves-before-parents has it.
        for key in self._recency:
            if not self._children.get(key) and evictable(key):
                return key
        return None

    def _by_value(self, evictable: Callable[[Key], bool]) -> Key | None:
        deferred: list[tuple[float, int, int, Key]] = []
        chosen: Key | None = None
        while self._heap:
            item = heapq.heappop(self._heap)
            priority, _, _, key = item
            if self._priority.get(key) != priority:
                continue  # stale: the block was used again or left the tier
            if self._children.get(key) or not evictable(key):
                deferred.append(item)
                continue
            chosen = key
            self._inflation = max(self._inflation, priority)
            break
        for item in deferred:
            heapq.heappush(self._heap, item)
        return chosen

    def _compact(self) -> None:
        self._heap = [item for item in self._heap if self._priority.get(item[3]) == item[0]]
        heapq.heapify(self._heap)

    def __contains__(self, key: object) -> bool:
        return key in self._info

    def __len__(self) -> int:
        return len(self._info)


# Lists of ChainArcPolicy (and PackedChainArc): a block is in exactly one.
PROBATION, PROTECTED, TAIL = 0, 1, 2


class ChainArcPolicy(TierPolicy):
    """DRAM's order (issue 26): ARC over use counts, the ends of finished prompts first.

    What it exploits (docs/design.md, "Policy"; measured on the shared trace's DRAM at
    5 k blocks, sampled under LRU): DRAM savings are the same for every block (an NVMe
    fetch avoided), and the block's age while in DRAM says almost nothing about its next
    use (P(used within 200 requests) 0.19-0.23 at every age LRU keeps), but two things
    do: a block seen once is used again within that horizon 8 % of the time, one seen
    twice or more 21-43 %; and the last block of a prompt (the partial one the next turn
    rewrites) 1 %, 96 % never again. So:

    * *probation* holds blocks the use-count sketch has seen once, *protected* the
      others, each least recently used first (ARC's T1 and T2, Megiddo & Modha);
    * *tails*: when a chain starts (a block with no parent is touched) the deepest block
      touched since the previous chain start — that prompt's last block — moves to a
      third list, evicted first;
    * the victim is the first leaf (no child cached here: a chain leaves tail first) of
      tails, else of probation while it holds more than `target` blocks, else of
      protected. `target` is ARC's adaptation, from one ghost list of as many keys as the
      tier holds per list: a block back from probation's ghosts raises `target` (by
      max(1, protected's ghosts / probation's), as ARC does), from protected's lowers it.
    * Tails go first only while they come back (tail ghost hits per tail evicted) no more
      often than probation's blocks do; otherwise a tail competes with probation's head
      by age, so traffic that re-sends whole prompts unchanged is not hurt.
    * ValuePolicy's safety net: a shadow LRU as large as the tier sees the same calls,
      and `weight`, the share of victims chosen as above (the rest: the least recently
      used leaf), moves by STEP towards whichever of the two would have hit. Where
      frequency points the wrong way (tests/sim/test_transform.py's recency trace) this
      keeps the order within ~2 % of LRU.

    No constant here was tuned to a trace: the lists are LRU, `target`, the tail switch
    and `weight` are learned online (STEP is ValuePolicy's). The packed copy
    (PackedChainArc) decides identically."""

    STEP = 0.01

    def __init__(self, sketch: FrequencySketch) -> None:
        self._sketch = sketch
        self._lists: tuple[OrderedDict[Key, None], ...] = (
            OrderedDict(),
            OrderedDict(),
            OrderedDict(),
        )
        self._where: dict[Key, int] = {}
        self._info: dict[Key, BlockInfo] = {}
        self._tick: dict[Key, int] = {}
        self._kids: dict[Key, int] = {}  # children cached in this tier, by parent key
        self._clock = 0
        self._deep: Key | None = None  # deepest block touched since the last chain start
        self._deep_position = -1
        # Keys evicted from each list, as many as the tier holds (ARC's B1, B2; and tails).
        self._ghosts: tuple[OrderedDict[Key, None], ...] = (
            OrderedDict(),
            OrderedDict(),
            OrderedDict(),
        )
        self.target = 0.0  # ARC's p: probation's share of the tier, in blocks
        self._recent: OrderedDict[Key, None] = OrderedDict()  # every block, least recent first
        self._shadow: OrderedDict[Key, None] = OrderedDict()  # an LRU as large as the tier
        self.weight = 1.0  # the share of victims this order chooses; the rest: LRU's
        self._credit = 0.0
        # Evictions and ghost returns of probation and tails: [evicted, came back].
        self._returns = {PROBATION: [0, 0], TAIL: [0, 0]}

    def _place(self, key: Key, kind: int) -> None:
        old = self._where.get(key)
        if old is not None:
            del self._lists[old][key]
        self._where[key] = kind
        self._lists[kind][key] = None

    def _touch(self, key: Key, hit: bool) -> None:
        info = self._info[key]
        recent, shadow = self._recent, self._shadow
        recent[key] = None
        recent.move_to_end(key)
        if (key in shadow) != hit:  # ValuePolicy's safety net: whose guess was right
            step = self.STEP if hit else -self.STEP
            self.weight = min(max(self.weight + step, 0.0), 1.0)
        shadow[key] = None
        shadow.move_to_end(key)
        while len(shadow) > max(len(self._info), 1):
            shadow.popitem(last=False)
        self._clock += 1
        self._tick[key] = self._clock
        if info.parent is None:
            deep = self._deep
            if deep is not None and deep != key and deep in self._where:
                self._place(deep, TAIL)
            self._deep, self._deep_position = key, info.position
        elif info.position >= self._deep_position:
            self._deep, self._deep_position = key, info.position
        self._place(key, PROTECTED if self._sketch.count(key) > 1 else PROBATION)

    def insert(self, key: Key, info: BlockInfo) -> None:
        if key in self._where:
            self.hit(key)
            return
        self._info[key] = info
        if info.parent is not None:
            self._kids[info.parent] = self._kids.get(info.parent, 0) + 1
        kind = next((k for k, g in enumerate(self._ghosts) if g.pop(key, 0) is None), None)
        young = len(self._ghosts[PROBATION]) + len(self._ghosts[TAIL])
        old = len(self._ghosts[PROTECTED])
        if kind == PROBATION:
            self.target = min(
                self.target + max(1.0, old / (young + 1)), float(len(self._where) + 1)
            )
        elif kind == PROTECTED:
            self.target = max(self.target - max(1.0, young / (old + 1)), 0.0)
        if kind is not None and kind != PROTECTED:
            self._returns[kind][1] += 1
        self._touch(key, hit=False)

    def hit(self, key: Key) -> None:
        if key in self._where:
            self._touch(key, hit=True)

    def remove(self, key: Key) -> None:
        kind = self._where.pop(key, None)
        if kind is None:
            return
        del self._lists[kind][key], self._tick[key], self._recent[key]
        if key == self._deep:
            self._deep = None  # left: the next block at least as deep takes its place
        parent = self._info.pop(key).parent
        if parent is not None:
            left = self._kids[parent] - 1
            if left:
                self._kids[parent] = left
            else:
                del self._kids[parent]

    def _first_leaf(self, kind: int, evictable: Callable[[Key], bool]) -> Key | None:
        kids = self._kids
        for key in self._lists[kind]:
            if key not in kids and evictable(key):
                return key
        return None

    def tails_first(self) -> bool:
        """Whether evicted tails come back no more often than evicted probation blocks."""
        tails, probation = self._returns[TAIL], self._returns[PROBATION]
        return (tails[1] + 1) * (probation[0] + 2) <= (probation[1] + 1) * (tails[0] + 2)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        self._credit += self.weight
        if self._credit < 1.0:
            for key in self._recent:
                if key not in self._kids and evictable(key):
                    return self._evicted(key, self._where[key])
        self._credit = max(self._credit - 1.0, 0.0)
        chosen: Key | None = None
        kind = TAIL
        tails_first = self.tails_first()
        if tails_first:
            chosen = self._first_leaf(TAIL, evictable)
        if chosen is None:
            young = self._first_leaf(PROBATION, evictable)
            kind = PROBATION
            if not tails_first:
                tail = self._first_leaf(TAIL, evictable)
                if tail is not None and (young is None or self._tick[tail] < self._tick[young]):
                    young, kind = tail, TAIL
            old = self._first_leaf(PROTECTED, evictable)
            probation = len(self._lists[PROBATION]) + len(self._lists[TAIL])
            if old is not None and (young is None or probation <= self.target):
                young, kind = old, PROTECTED
            chosen = young
        if chosen is None:
            return None
        return self._evicted(chosen, kind)

    def last_resort(self, evictable: Callable[[Key], bool]) -> Key | None:
        """Leaves first is a preference, never why nothing is evicted: a parent whose
        cached children are all pinned, or blocks that chains disagreeing on their order
        made each other's parent (a cycle: none is a leaf), must still make room. The
        least recently used evictable block, leaf or not (after the caller's every
        `victim` try: a protected leaf goes before an unprotected parent)."""
        chosen = next((key for key in self._recent if evictable(key)), None)
        return None if chosen is None else self._evicted(chosen, self._where[chosen])

    def _evicted(self, chosen: Key, kind: int) -> Key:
        if kind != PROTECTED:
            self._returns[kind][0] += 1
        self.remove(chosen)
        ghosts = self._ghosts[kind]
        ghosts[chosen] = None
        while len(ghosts) > max(len(self._where), 1):
            ghosts.popitem(last=False)
        return chosen

    def names_as_parent(self, key: Key) -> bool:
        return key in self._kids

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)


class Admission:
    """Whether a block leaving DRAM is written to NVMe (or, write_through, at insert).

    `selective` writes a block only if blocks like it (same uses-so-far and closeness to
    the end of its chain) have been used again at least `min_p_reuse` of the time: a
    prompt's last block, which the next turn extends into a new one, is rarely worth the
    drive's endurance."""

    def __init__(
        self,
        mode: AdmissionMode,
        sketch: FrequencySketch,
        reuse: ReuseEstimator,
        min_p_reuse: float = 0.1,
    ) -> None:
        self.mode = mode
        self._sketch = sketch
        self._reuse = reuse
        self.min_p_reuse = min_p_reuse

    def admit_on_evict(self, key: Key, info: BlockInfo) -> bool:
        if self.mode == "selective":
            uses = max(self._sketch.count(key), 1)
            return self._reuse.p_reuse(key, uses, info) >= self.min_p_reuse
        return self.mode == "write_back"

    @property
    def on_insert(self) -> bool:
        return self.mode == "write_through"


class Ghosts:
    """Keys recently dropped from every tier (bounded FIFO): a miss on one is lost reuse."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._keys: OrderedDict[Key, None] = OrderedDict()

    def add(self, key: Key) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)

    def take(self, key: Key) -> bool:
        """True (and forgets it) if `key` was dropped recently."""
        return self._keys.pop(key, "absent") is None

    def __len__(self) -> int:
        return len(self._keys)


class Policies:
    """Everything the tiers decide with, shared by the daemon's store and `kvtier replay`:
    the use counts, the reuse estimate, admission, ghosts, and one eviction order per tier
    (`new_tier` makes more, e.g. one DRAM order per tenant arena)."""

    def __init__(
        self,
        name: str,
        admission: AdmissionMode,
        model: ValueModel,
        ghost_capacity: int,
        min_p_reuse: float = 0.1,
    ) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
        self.name = name
        self.model = model
        self.sketch = FrequencySketch()
        # P(reuse) within the tiers' reach: the ghosts, too, remember about as many keys
        # as the tiers hold (ReuseEstimator says why the horizon matters).
        self.reuse = ReuseEstimator(ghost_capacity or 1 << 20)
        self.admission = Admission(admission, self.sketch, self.reuse, min_p_reuse)
        self.ghosts = Ghosts(ghost_capacity)

    def accessed(self, key: Key, info: BlockInfo) -> None:
        """A block was asked for (hit or miss): count the use, settle its last estimate."""
        self.sketch.add(key)
        self.reuse.observe(key, self.sketch.count(key), info)

    def new_tier(self, tier: str, fallback: str | None, capacity_bytes: int) -> TierPolicy:
        if self.name == "lru":
            return LruPolicy()
        if self.name == "s3fifo":
            return S3FifoPolicy(capacity_bytes)
        if fallback is not None:
            # Every request of a block reaches the first tier as a hit or an insert, and
            # what one more DRAM hit saves is the same for every block (an NVMe fetch):
            # which blocks come back soon is the whole question (ChainArcPolicy).
            return ChainArcPolicy(self.sketch)
        return ValuePolicy(tier, fallback, self.model, self.sketch, reach_net=True)
