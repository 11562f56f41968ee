"""Hints: the chains an engine says it will ask for soon (its waiting requests).

Deciding only, no I/O and no clock of its own (every call takes `now_s`), so the daemon
(kvtier/engine/prefetch.py) and the replay's queue (kvtier/sim/queue.py) share it.

Lifecycle of a hint:
    add(keys, now_s, ttl_s)  -> its keys are protected (kept in DRAM) until it expires
    to_promote(now_s, wanted)-> the hinted keys worth moving up, nearest deadline first
    use(key)                 -> the load came: the earliest-expiring hint holding the key
                                lets go of it (a key several waiting requests share stays
                                protected for the others)
    expire(now_s) / drop(id) -> gone; the keys no other hint holds are returned, released

A key is protected while some live hint holds it. The table is bounded (`max_hints`,
`max_keys`): adding past a bound evicts the oldest hints first, so a client that
announces without ever loading cannot grow it (the oldest hint of a FIFO queue is the
next served, but one a request left behind without loading is the likeliest stale, and
the TTL bounds how long it could protect anything anyway).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Added(Generic[K]):
    """What `add` did: the hint's id (0: nothing accepted), how many of its keys were kept
    (a chain longer than the table is cut to its front), and the keys that older hints,
    evicted for room, no longer protect."""

    hint_id: int
    accepted: int
    released: list[K]


@dataclass(slots=True)
class _Hint(Generic[K]):
    expires_s: float
    keys: list[K]
    pending: set[K] = field(default_factory=set)  # not used yet


class HintTable(Generic[K]):
    def __init__(self, max_hints: int, max_keys: int) -> None:
        if max_hints <= 0 or max_keys <= 0:
            raise ValueError("a hint table needs room for at least one hint and one key")
        self.max_hints = max_hints
        self.max_keys = max_keys
        self._hints: dict[int, _Hint[K]] = {}  # insertion order: oldest first
        self._holders: dict[K, set[int]] = {}
        self._expiry: list[tuple[float, int]] = []  # (expires_s, hint id), lazily cleaned
        self._next_id = 1
        self._keys = 0  # pending keys over all hints

    def __len__(self) -> int:
        return len(self._hints)

    @property
    def keys_held(self) -> int:
        return self._keys

    # ---- adding ---------------------------------------------------------------------------
    def add(self, keys: Iterable[K], now_s: float, ttl_s: float) -> Added[K]:
        """Announce a chain, block 0 first, needed within `ttl_s` of `now_s`. Repeated keys
        count once. Expired hints are dropped first."""
        released = self.expire(now_s)
        chain: list[K] = []
        seen: set[K] = set()
        for key in keys:
            if key not in seen:
                seen.add(key)
                chain.append(key)
        chain = chain[: self.max_keys]
        if not chain or ttl_s <= 0:
            return Added(0, 0, released)
        while self._hints and (
            len(self._hints) >= self.max_hints or self._keys + len(chain) > self.max_keys
        ):
            released += self.drop(next(iter(self._hints)))
        hint_id = self._next_id
        self._next_id += 1
        hint = _Hint(now_s + ttl_s, chain, set(chain))
        self._hints[hint_id] = hint
        self._keys += len(chain)
        for key in chain:
            self._holders.setdefault(key, set()).add(hint_id)
        heapq.heappush(self._expiry, (hint.expires_s, hint_id))
        return Added(hint_id, len(chain), [k for k in released if k not in self._holders])

    # ---- reading --------------------------------------------------------------------------
    def protected(self, key: K, now_s: float) -> bool:
        """Whether a live hint (not expired at `now_s`) still waits for `key`."""
        holders = self._holders.get(key)
        if not holders:
            return False
        return any(self._hints[h].expires_s > now_s for h in holders)

    def hinted(self) -> Iterable[K]:
        """Every key some hint still holds (expired ones too, until `expire`)."""
        return self._holders.keys()

    def to_promote(self, now_s: float, wanted: Callable[[K], bool], most: int) -> list[K]:
        """At most `most` keys of live hints for which `wanted` holds (the caller's "on a
        slower tier, not in DRAM, not moving yet"), nearest deadline first and, within a
        hint, in chain order (the front of a prefix is what a load can use first)."""
        out: list[K] = []
        seen: set[K] = set()
        for _, hint_id in sorted(
            (h.expires_s, i) for i, h in self._hints.items() if h.expires_s > now_s
        ):
            hint = self._hints[hint_id]
            for key in hint.keys:
                if key in hint.pending and key not in seen:
                    seen.add(key)
                    if wanted(key):
                        out.append(key)
                        if len(out) >= most:
                            return out
        return out

    # ---- letting go -----------------------------------------------------------------------
    def use(self, key: K) -> bool:
        """The load of `key` came: the earliest-expiring hint holding it lets go of it.
        True if that was the last hint holding it (it is no longer protected)."""
        holders = self._holders.get(key)
        if not holders:
            return False
        hint_id = min(holders, key=lambda h: (self._hints[h].expires_s, h))
        self._let_go(hint_id, key)
        hint = self._hints[hint_id]
        if not hint.pending:
            self._remove(hint_id)
        return key not in self._holders

    def drop(self, hint_id: int) -> list[K]:
        """Forget a hint; the keys no other hint holds, released."""
        hint = self._hints.get(hint_id)
        if hint is None:
            return []
        released = []
        for key in list(hint.pending):
            self._let_go(hint_id, key)
            if key not in self._holders:
                released.append(key)
        self._remove(hint_id)
        return released

    def expire(self, now_s: float) -> list[K]:
        """Drop every hint expired at `now_s`; the keys that are released by it."""
        released: list[K] = []
        while self._expiry and self._expiry[0][0] <= now_s:
            expires_s, hint_id = heapq.heappop(self._expiry)
            hint = self._hints.get(hint_id)
            if hint is not None and hint.expires_s == expires_s:
                released += self.drop(hint_id)
        return released

    def _let_go(self, hint_id: int, key: K) -> None:
        self._hints[hint_id].pending.discard(key)
        self._keys -= 1
        holders = self._holders[key]
        holders.discard(hint_id)
        if not holders:
            del self._holders[key]

    def _remove(self, hint_id: int) -> None:
        del self._hints[hint_id]
        if len(self._expiry) > 4 * len(self._hints) + 64:
            # Used-up hints leave their expiry behind: rebuild so the heap stays bounded.
            self._expiry = [(h.expires_s, i) for i, h in self._hints.items()]
            heapq.heapify(self._expiry)
