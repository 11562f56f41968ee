"""Block residency events: which blocks this node holds, and in which tiers, as it changes.

A router keeps an index of which node holds which prefix from these (list, then watch,
as Kubernetes clients do): `Snapshot` gives the blocks and the sequence number of the
last event they reflect; `WatchEvents` streams every later change. Each event is a
block's whole new state — the tiers holding it, empty when it is gone — so applying one
twice, or one the snapshot already reflects, does no harm.

Resuming without going stale: every event has a sequence number, and the log keeps the
last `keep` of them, under an epoch chosen at each start. A watcher that reconnects with
(epoch, last seq seen) gets exactly the events it missed; if those are no longer kept,
the daemon restarted (a new epoch: its DRAM tier is gone, its NVMe tier recovered), or
the watcher fell `backlog` events behind, it is told to resync — drop its index, take a
snapshot, watch from there — rather than silently missing a change.

Runs on the event loop (like the catalog that feeds it): no locks.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvtier.index.catalog import BlockId, TierName


@dataclass(frozen=True, slots=True)
class BlockEvent:
    seq: int
    block_id: BlockId
    tiers: tuple[TierName, ...]  # every tier holding it now, fastest first; () = gone


class Resync(Exception):
    """The events a watcher asked for are gone: it must take a snapshot again."""


class Watcher:
    """One watching stream's queue of events (those its filter accepts)."""

    def __init__(self, accepts: Callable[[str], bool], backlog: int) -> None:
        self.accepts = accepts
        self._backlog = backlog
        self._queue: collections.deque[BlockEvent] = collections.deque()
        self._ready = asyncio.Event()
        self.fell_behind = False
        self.closed = False

    def offer(self, event: BlockEvent) -> None:
        if self.fell_behind or not self.accepts(event.block_id[0]):
            return
        if len(self._queue) >= self._backlog:
            self.fell_behind = True
            self._queue.clear()
        else:
            self._queue.append(event)
        self._ready.set()

    def replay(self, events: Iterable[BlockEvent]) -> None:
        """Queue missed events (not bounded by the backlog: the history is)."""
        self._queue.extend(e for e in events if self.accepts(e.block_id[0]))
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    def queued(self, max_events: int) -> list[BlockEvent]:
        """What is queued now, without waiting."""
        return [self._queue.popleft() for _ in range(min(max_events, len(self._queue)))]

    async def next_batch(self, max_events: int) -> list[BlockEvent]:
        """The next events (waits for at least one); [] once closed; Resync if it fell behind."""
        while not self._queue and not self.fell_behind and not self.closed:
            self._ready.clear()
            await self._ready.wait()
        if self.fell_behind:
            raise Resync(f"the watcher fell more than {self._backlog} events behind")
        return self.queued(max_events)


class EventLog:
    """The node's residency events: a bounded history for resuming, and live watchers."""

    def __init__(self, keep: int = 65536, backlog: int = 16384) -> None:
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self._keep = keep
        self._backlog = backlog
        # The history, a ring of the last `keep` events: the key bytes of each (the block
        # id's own object) in a list, its interned namespace and the code of its set of
        # tiers (in `_tier_sets`) in arrays; an event's seq is its place in the ring. One
        # object an event, where a (seq, (ns, key), code) tuple was four (seq's int, two
        # tuples, the key: ~240 B an event, 15 MiB at the default 65 k) and tuples the
        # garbage collector walked before it untracked them. A BlockEvent is made for a
        # watcher, or for a replay.
        self._keys: list[bytes] = [b""] * keep
        self._ns = array("I", bytes(4 * keep))
        self._codes = bytearray(keep)
        self._kept = 0  # events in the ring (the newest is seq)
        self._ns_ids: dict[str, int] = {}
        self._ns_names: list[str] = []
        self._tier_sets: list[tuple[TierName, ...]] = []
        self._tier_codes: dict[tuple[TierName, ...], int] = {}
        self._watchers: set[Watcher] = set()

    def record(self, block_id: BlockId, tiers: list[TierName]) -> None:
        """A block's set of tiers changed (the catalog calls this)."""
        self.seq += 1
        held = tuple(tiers)
        code = self._tier_codes.get(held)
        if code is None:
            code = self._tier_code(held)
        ns, key = block_id
        ns_n = self._ns_ids.get(ns)
        if ns_n is None:
            ns_n = self._ns_n(ns)
        at = self.seq % self._keep
        self._keys[at] = key
        self._ns[at] = ns_n
        self._codes[at] = code
        if self._kept < self._keep:
            self._kept += 1
        if self._watchers:
            event = BlockEvent(self.seq, block_id, held)
            for watcher in self._watchers:
                watcher.offer(event)

    def record_many(
        self, ns_ids: Sequence[str], keys: Sequence[bytes], tiers: list[TierName]
    ) -> None:
        """`record((ns_ids[i], keys[i]), tiers)` for each i in order, the same events
        (recovery's bulk adds: a million events at 1 M records, ~2 µs each one by one).
        With no watcher to offer them to, the ring is written by slices, and the events
        this call itself would overwrite are not written at all."""
        n = len(keys)
        if len(ns_ids) != n:
            raise ValueError("record_many: one namespace a key")
        if self._watchers:
            for ns, key in zip(ns_ids, keys, strict=True):
                self.record((ns, key), tiers)
            return
        code = self._tier_code(tuple(tiers))
        interned = {ns: self._ns_n(ns) for ns in dict.fromkeys(ns_ids)}  # a few names
        codes = [interned[ns] for ns in ns_ids]
        keep = self._keep
        first = self.seq + 1 + max(0, n - keep)  # the oldest event the ring keeps of these
        self.seq += n
        self._kept = min(keep, self._kept + n)
        done = first - (self.seq - n + 1)  # rows not written: overwritten within this call
        while done < n:
            at = first % keep
            run = min(n - done, keep - at)
            self._keys[at : at + run] = keys[done : done + run]
            self._ns[at : at + run] = array("I", codes[done : done + run])
            self._codes[at : at + run] = bytes((code,)) * run
            first += run
            done += run

    def _tier_code(self, held: tuple[TierName, ...]) -> int:
        code = self._tier_codes.get(held)
        if code is None:  # a few sets ever (the tiers' combinations, fastest first)
            code = self._tier_codes[held] = len(self._tier_sets)
            self._tier_sets.append(held)
        return code

    def _ns_n(self, ns: str) -> int:
        ns_n = self._ns_ids.get(ns)
        if ns_n is None:
            ns_n = self._ns_ids[ns] = len(self._ns_names)
            self._ns_names.append(ns)
        return ns_n

    def history(self, after_seq: int = 0) -> Iterator[BlockEvent]:
        """The kept events after `after_seq`, oldest first."""
        keep, keys, ns, codes = self._keep, self._keys, self._ns, self._codes
        names, sets = self._ns_names, self._tier_sets
        for seq in range(max(after_seq, self.seq - self._kept) + 1, self.seq + 1):
            at = seq % keep
            yield BlockEvent(seq, (names[ns[at]], keys[at]), sets[codes[at]])

    def watch(self, accepts: Callable[[str], bool], epoch: str, after_seq: int) -> Watcher:
        """A watcher of the events after (epoch, after_seq) — or of those from now on when
        `epoch` is empty — with the missed ones already queued; Resync if they are gone."""
        watcher = Watcher(accepts, self._backlog)
        if epoch:
            if epoch != self.epoch:
                raise Resync("the daemon restarted since (another epoch)")
            if after_seq > self.seq:
                raise Resync(f"seq {after_seq} is ahead of this daemon's last event ({self.seq})")
            oldest = self.seq - self._kept + 1
            if after_seq + 1 < oldest:
                raise Resync(f"events after seq {after_seq} are no longer kept (only {self._keep})")
            watcher.replay(self.history(after_seq))
        self._watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close(self) -> None:
        """End every watching stream (the daemon is stopping)."""
        for watcher in self._watchers:
            watcher.close()
        self._watchers.clear()
