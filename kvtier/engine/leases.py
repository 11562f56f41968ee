"""LeaseTable: who holds what through the shared arena, and until when.

A lease is created by `Store.reserve` (slots a client writes in place) or `Store.acquire`
(blocks it reads in place) and ends on release, on its session's end, or at its TTL. The
table only keeps the books — ids, owners, per-session counts, expiry; what a lease holds
(pins, reservations) is given back by the store when it ends one, because giving back
memory is a flow of the store's (a freed extent may wake a waiting put).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.errors import ResourceExhausted

if TYPE_CHECKING:
    from kvtier.index.catalog import Entry


@dataclass(slots=True, eq=False)
class Lease:
    lease_id: int
    session_id: int
    expires_s: float
    pinned: list[Entry] = field(default_factory=list)
    writers: list[Any] = field(default_factory=list)  # PutWriters: reserved, not committed
    staged: list[int] = field(default_factory=list)  # each writer's slot in the write area
    promote_s: float = 0.0  # spent reading NVMe-only blocks into the arena for this lease


class LeaseTable:
    def __init__(self, max_per_session: int, ttl_s: float) -> None:
        self.max_per_session = max_per_session
        self.ttl_s = ttl_s
        self._leases: dict[int, Lease] = {}
        self._by_session: Counter[int] = Counter()
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._leases)

    def ids(self) -> list[int]:
        return list(self._leases)

    def get(self, lease_id: int, session_id: int) -> Lease | None:
        """The lease if it exists and belongs to `session_id` (a session cannot name
        another's leases)."""
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.session_id == session_id else None

    def of_session(self, session_id: int) -> list[int]:
        return [i for i, lease in self._leases.items() if lease.session_id == session_id]

    def check_room(self, session_id: int) -> None:
        """Refuse a new lease before pinning anything: one client cannot pin the arena."""
        held = self._by_session[session_id]
        if held >= self.max_per_session:
            raise ResourceExhausted(
                f"this session holds {held} leases, the most allowed "
                "(limits.max_leases_per_session): release some before asking for more"
            )

    def new(self, session_id: int) -> Lease:
        lease = Lease(self._next_id, session_id, time.monotonic() + self.ttl_s)
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        self._by_session[session_id] += 1
        return lease

    def take(self, lease_id: int) -> Lease | None:
        """Forget a lease (and its count against its session); what it holds stays on it
        for the caller to give back."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._by_session[lease.session_id] -= 1
            if not self._by_session[lease.session_id]:
                del self._by_session[lease.session_id]
        return lease

    def expired(self, now_s: float) -> list[int]:
        return [i for i, lease in self._leases.items() if lease.expires_s <= now_s]
