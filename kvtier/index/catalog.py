"""Catalog: which blocks exist, where each lives, and who is using it.

Pure bookkeeping, driven by the store's Residency (kvtier/engine/residency.py) and by the
replay simulator, on one thread (so no locks). What to evict is the policy's business
(kvtier/index/policy.py), not the catalog's.

Lifecycle of an entry:
    add(entry with a DRAM extent)          -> visible to lookup/get
    pin / unpin                            -> while pinned (a read or a demotion in progress)
                                              the entry is never chosen as a victim
    set_nvme(record_bytes)                 -> a verified record exists on disk too
    drop_dram / drop_nvme                  -> a copy went away; an entry with no copy is removed
    remove                                 -> gone from lookups at once; the caller frees its
                                              resources now, or when the last pin is released
                                              (entry.doomed tells it which)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvtier.keys import tenant_of
from kvtier.types import BlockId, Extent, LookupResult, TierName

__all__ = ["BlockId", "Catalog", "Entry", "LookupResult", "TierName"]


@dataclass(slots=True, eq=False)
class Entry:
    """Mutable catalog state of one block (identity matters: compare with `is`)."""

    block_id: BlockId
    size_bytes: int
    xxh3_64: int
    generation: int
    dram_extent: Extent | None = None
    nvme_record_bytes: int = 0
    pins: int = 0
    doomed: bool = False
    demoting: bool = False
    read_errors: int = 0  # I/O errors reading its NVMe record (not checksum failures)
    in_remote: bool = False  # this node put it in, or fetched it from, the remote tier

    @property
    def tiers(self) -> list[TierName]:
        out = []
        if self.dram_extent is not None:
            out.append(TierName.DRAM)
        if self.nvme_record_bytes:
            out.append(TierName.NVME)
        return out

    @property
    def fastest_tier(self) -> TierName | None:
        tiers = self.tiers
        return tiers[0] if tiers else None


_DRAM, _NVME = TierName.DRAM, TierName.NVME


def tier_of(entry: Entry | None) -> TierName | None:
    """The fastest tier holding a block (None: not cached)."""
    if entry is None:
        return None
    if entry.dram_extent is not None:
        return _DRAM
    return _NVME if entry.nvme_record_bytes else None


class Catalog:
    """key -> residency: copies, pins and byte accounting, reported as residency events."""

    def __init__(self, on_change: Callable[[BlockId, list[TierName]], None] | None = None) -> None:
        # Told each time a block's set of tiers changes (added, copied, dropped, removed:
        # then []), for the residency events routers index.
        self._on_change = on_change
        self._entries: dict[BlockId, Entry] = {}
        # Which blocks have a copy in each tier (for counts); the eviction order is the
        # policy's (kvtier/index/policy.py), kept by the store's Residency.
        self._in_dram: set[BlockId] = set()
        self._in_nvme: set[BlockId] = set()
        self.dram_used_bytes = 0
        self.nvme_used_bytes = 0
        self.nvme_used_by_tenant: Counter[str] = Counter()  # the shared tier's quota basis

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, block_id: BlockId) -> Entry | None:
        return self._entries.get(block_id)

    def add(self, entry: Entry) -> None:
        if entry.block_id in self._entries:
            raise KeyError("block already catalogued; remove the old entry first")
        self._entries[entry.block_id] = entry
        if entry.dram_extent is not None:
            self._in_dram.add(entry.block_id)
            self.dram_used_bytes += entry.dram_extent.size_bytes
        if entry.nvme_record_bytes:
            self._in_nvme.add(entry.block_id)
            self._nvme_add(entry.block_id, entry.nvme_record_bytes)
        self._changed(entry)

    def _changed(self, entry: Entry, gone: bool = False) -> None:
        if self._on_change is not None:
            self._on_change(entry.block_id, [] if gone else entry.tiers)

    def set_nvme(self, entry: Entry, record_bytes: int) -> None:
        if entry.nvme_record_bytes:
            raise ValueError("entry already has an NVMe record")
        entry.nvme_record_bytes = record_bytes
        if self._entries.get(entry.block_id) is entry:
            self._in_nvme.add(entry.block_id)
            self._nvme_add(entry.block_id, record_bytes)
            self._changed(entry)

    def set_dram(self, entry: Entry, extent: Extent) -> None:
        """A copy was promoted into DRAM (the entry keeps its NVMe record too)."""
        if entry.dram_extent is not None:
            raise ValueError("entry already has a DRAM copy")
        entry.dram_extent = extent
        if self._entries.get(entry.block_id) is entry:
            self._in_dram.add(entry.block_id)
            self.dram_used_bytes += extent.size_bytes
            self._changed(entry)

    def drop_dram(self, entry: Entry) -> Extent | None:
        """Forget the DRAM copy; returns its extent for the caller to free."""
        extent = entry.dram_extent
        if extent is None:
            return None
        entry.dram_extent = None
        if self._entries.get(entry.block_id) is entry:
            self._in_dram.discard(entry.block_id)
            self.dram_used_bytes -= extent.size_bytes
            if not entry.nvme_record_bytes:
                self._forget(entry)
            self._changed(entry)
        return extent

    def drop_nvme(self, entry: Entry) -> int:
        """Forget the NVMe copy; returns its record size (0 if there was none)."""
        record_bytes = entry.nvme_record_bytes
        if not record_bytes:
            return 0
        entry.nvme_record_bytes = 0
        if self._entries.get(entry.block_id) is entry:
            self._in_nvme.discard(entry.block_id)
            self._nvme_add(entry.block_id, -record_bytes)
            if entry.dram_extent is None:
                self._forget(entry)
            self._changed(entry)
        return record_bytes

    def remove(self, entry: Entry) -> None:
        """Take the entry out of every lookup now; its copies stay on it for the caller to free.

        Sets `doomed` when it is pinned: the last unpin must free its resources.
        """
        if self._entries.get(entry.block_id) is not entry:
            return
        self._forget(entry)
        if entry.dram_extent is not None:
            self.dram_used_bytes -= entry.dram_extent.size_bytes
        if entry.nvme_record_bytes:
            self._nvme_add(entry.block_id, -entry.nvme_record_bytes)
        entry.doomed = True
        self._changed(entry, gone=True)

    def _nvme_add(self, block_id: BlockId, delta_bytes: int) -> None:
        self.nvme_used_bytes += delta_bytes
        self.nvme_used_by_tenant[tenant_of(block_id[0])] += delta_bytes

    def is_live(self, entry: Entry) -> bool:
        return self._entries.get(entry.block_id) is entry

    def _forget(self, entry: Entry) -> None:
        del self._entries[entry.block_id]
        self._in_dram.discard(entry.block_id)
        self._in_nvme.discard(entry.block_id)

    @staticmethod
    def pin(entry: Entry) -> None:
        entry.pins += 1

    @staticmethod
    def unpin(entry: Entry) -> None:
        if entry.pins <= 0:
            raise ValueError("unpin without pin")
        entry.pins -= 1

    def lookup(self, ns_id: str, keys: list[bytes]) -> LookupResult:
        return LookupResult.of([tier_of(e) for e in self.find(ns_id, keys)])

    def find(self, ns_id: str, keys: list[bytes]) -> list[Entry | None]:
        """The entry of each key (None: not cached). On the Plan path for every prompt
        (hundreds of keys): one probe per key, nothing else."""
        get = self._entries.get
        return [get((ns_id, key)) for key in keys]

    def entries(self) -> Iterator[Entry]:
        """Every live entry (a copy of the list: callers may await between items)."""
        yield from list(self._entries.values())

    def count(self, tier: TierName) -> int:
        return len(self._in_dram) if tier is TierName.DRAM else len(self._in_nvme)
