"""DenseOrder: a packed eviction order over the few catalog slots one small tier holds
(a tenant's DRAM arena), each given a dense local slot so the order's arrays are sized
by the tier, not by the whole catalog."""

from __future__ import annotations

from array import array
from collections.abc import Callable

from kvtier.index.slot_policy import SlotPolicy
from kvtier.index.slots import NO_SLOT

__all__ = ["DenseOrder"]


class DenseOrder(SlotPolicy):
    """A packed order over the few catalog slots one small tier holds (a DRAM arena:
    thousands of blocks, against the millions of slots of the NVMe tier). The packed
    policies size their arrays by the largest slot they see, so the catalog's slots
    would cost every tenant's arena ~50 B per block of the whole catalog; here each
    block of the tier (and each parent its blocks name) gets a dense local slot instead,
    given back once it is neither in the tier nor named as a parent."""

    def __init__(
        self, make: Callable[[Callable[[int], int]], SlotPolicy], digest_of: Callable[[int], int]
    ) -> None:
        self._local: dict[int, int] = {}  # catalog slot -> local slot
        self._global = array("i")  # local slot -> catalog slot (NO_SLOT: free)
        self._parent = array("i")  # local slot -> its parent's local slot
        self._free: list[int] = []
        glob = self._global
        self._order = make(lambda local: digest_of(glob[local]))

    def _local_of(self, slot: int) -> int:
        local = self._local.get(slot)
        if local is None:
            if self._free:
                local = self._free.pop()
                self._global[local] = slot
            else:
                local = len(self._global)
                self._global.append(slot)
                self._parent.append(NO_SLOT)
            self._local[slot] = local
        return local

    def _maybe_free(self, local: int) -> None:
        order = self._order
        if local in order or order.names_as_parent(local):
            return
        del self._local[self._global[local]]
        self._global[local] = NO_SLOT
        self._parent[local] = NO_SLOT
        self._free.append(local)

    def _left(self, local: int) -> None:
        parent = self._parent[local]
        self._maybe_free(local)
        if parent != NO_SLOT and self._global[parent] != NO_SLOT:
            self._maybe_free(parent)

    def insert(self, slot: int, size_bytes: int, position: int = 0, parent: int = NO_SLOT) -> None:
        local = self._local_of(slot)
        up = self._local_of(parent) if parent != NO_SLOT and parent != slot else NO_SLOT
        if local not in self._order:
            self._parent[local] = up
        self._order.insert(local, size_bytes, position, up)
        if up != NO_SLOT:
            self._maybe_free(up)  # not named after all (a policy without parents, a hit)

    def hit(self, slot: int) -> None:
        local = self._local.get(slot)
        if local is not None:
            self._order.hit(local)

    def remove(self, slot: int) -> None:
        local = self._local.get(slot)
        if local is not None:
            self._order.remove(local)
            self._left(local)

    def victim(self, evictable: Callable[[int], bool]) -> int | None:
        return self._chosen(self._order.victim(lambda lo: evictable(self._global[lo])))

    def last_resort(self, evictable: Callable[[int], bool]) -> int | None:
        return self._chosen(self._order.last_resort(lambda lo: evictable(self._global[lo])))

    def _chosen(self, local: int | None) -> int | None:
        if local is None:
            return None
        slot = self._global[local]
        self._left(local)
        return slot

    def names_as_parent(self, slot: int) -> bool:
        local = self._local.get(slot)
        return local is not None and self._order.names_as_parent(local)

    def __contains__(self, slot: object) -> bool:
        local = self._local.get(slot) if isinstance(slot, int) else None
        return local is not None and local in self._order

    def __len__(self) -> int:
        return len(self._order)
