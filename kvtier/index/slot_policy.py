"""SlotPolicy: the contract of one tier's eviction order over catalog slots, which every
packed policy (kvtier/index/packed_policy.py, kvtier/index/packed_arc.py) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np

from kvtier.index.slots import NO_SLOT

__all__ = ["SlotPolicy"]


class SlotPolicy(ABC):
    """Eviction order of one tier, over catalog slots (TierPolicy's contract).

    `insert` when a block lands in the tier (a block already there: counts as `hit`),
    `hit` when it is used there, `remove` when it leaves for any reason other than being
    chosen, and `victim(evictable)` to choose (and forget) the next block to evict,
    skipping slots the caller cannot evict now; None when none may go. Sizes are bytes
    below 4 GiB; `parent` is the slot of the block before it in its chain (NO_SLOT:
    none)."""

    @abstractmethod
    def insert(
        self, slot: int, size_bytes: int, position: int = 0, parent: int = NO_SLOT
    ) -> None: ...

    def insert_many(self, slots: np.ndarray, sizes: np.ndarray, digests: np.ndarray) -> None:
        """`insert` of each slot in order, at position 0 with no parent (blocks recovered
        from disk: nothing is known of their chains); `digests` are their key digests.
        The same state after as the one-by-one calls; a policy may do it on arrays."""
        for slot, size in zip(slots.tolist(), sizes.tolist(), strict=True):
            self.insert(slot, size)

    def insert_run(self, slots: list[int], sizes: list[int]) -> None:
        """`insert_many` for a few slots (a demotion batch's), without arrays: a policy may
        skip the per-call work that is the same for each."""
        for slot, size in zip(slots, sizes, strict=True):
            self.insert(slot, size)

    @abstractmethod
    def hit(self, slot: int) -> None: ...

    def reached(self, digest: int, held: bool) -> None:
        """TierPolicy.reached, for the block with key digest `digest` (a block no tier
        holds has no slot)."""
        return None

    @abstractmethod
    def remove(self, slot: int) -> None: ...

    @abstractmethod
    def victim(self, evictable: Callable[[int], bool]) -> int | None:
        """The next slot to evict (forgotten by the policy), or None if none may go."""

    def last_resort(self, evictable: Callable[[int], bool]) -> int | None:
        """TierPolicy.last_resort, over slots."""
        return None

    @abstractmethod
    def __contains__(self, slot: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def names_as_parent(self, slot: int) -> bool:
        """Whether a block in this tier names `slot` as its parent."""
        return False


def last_victim(order: SlotPolicy, evictable: Callable[[int], bool]) -> int | None:
    """`order.victim`, else its `last_resort` (no leaf may go: a parent, rather than no
    room at all)."""
    slot = order.victim(evictable)
    return order.last_resort(evictable) if slot is None else slot
