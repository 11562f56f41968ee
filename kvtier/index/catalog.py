"""Catalog: which blocks exist, where each lives, and who is using it.

Pure bookkeeping, driven by the store's Residency (kvtier/engine/residency.py) and by the
replay simulator, on one thread (so no locks). What to evict is the policy's business
(kvtier/index/policy.py, kvtier/index/packed_policy.py), not the catalog's.

Lifecycle of an entry:
    add(entry with a DRAM extent)          -> visible to lookup/get
    pin / unpin                            -> while pinned (a read or a demotion in progress)
                                              the entry is never chosen as a victim
    set_nvme(record_bytes)                 -> a verified record exists on disk too
    drop_dram / drop_nvme                  -> a copy went away; an entry with no copy is removed
    remove                                 -> gone from lookups at once; the caller frees its
                                              resources now, or when the last pin is released
                                              (entry.doomed tells it which)

**Packed** (issue 22): a block is an integer *slot*, each of its fields one element of a
typed array (kvtier/index/slots.py), so a catalog of millions of blocks is a few dozen
arrays and nothing per block that the garbage collector walks. Per slot:

    digest (uint64)  chain (int32: next slot in its hash bucket, or in the free list)
    ns (uint32: interned namespace)  key_off (int64), key_len (uint16): the key in one
    byte heap (a reused slot reuses its key's room when the new key is as long)
    size, xxh3, generation, record bytes (uint64)  pins (uint32)  flags, read errors, era
    (uint8)  NVMe location (uint64: where the segment layout put the record, opaque here;
    kvtier/tiers/segment_file.py packs it; 0 for the file layout)

DRAM copies are few (an arena holds thousands of blocks, the NVMe tier millions), so
their extents are a dict by slot rather than two more arrays for every block.

The index, digest -> slot, is kvtier/index/catalog_index.py's (a base of `Catalog`).

`Entry` is a handle (catalog, slot, block id) whose attributes read and write the arrays.
The catalog hands out at most one live handle per slot (a weak-reference map), so `is`
identity and `is_live` mean what they meant when entries were objects; a removed block's
slot is reused only once its last handle is gone and no tier still names it as a parent
(`holds`). An `Entry` built by its constructor holds its fields itself until `add`
moves them into a slot (the simulator and the tests build entries that way).
"""

from __future__ import annotations

import mmap
import weakref
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Literal, Protocol

import numpy as np
import xxhash

from kvtier.index import catalog_bulk
from kvtier.index.catalog_bulk import BlockEventRun, RecordColumns
from kvtier.index.catalog_index import KeyIndex
from kvtier.index.chain_probes import CHAIN_MIN_KEYS, ChainProbes
from kvtier.index.entry import DEMOTING, DOOMED, FREE, IN_REMOTE, LIVE, Entry
from kvtier.index.slots import NO_SLOT, mapping, remap
from kvtier.keys import tenant_of
from kvtier.types import BlockId, Extent, LookupResult, TierName

__all__ = [
    "NO_SLOT",
    "BlockEventRun",
    "BlockId",
    "Catalog",
    "DramHook",
    "Entry",
    "LookupResult",
    "RecordColumns",
    "TierName",
    "seeded_digest",
]

_LIVE, _DOOMED, _DEMOTING, _IN_REMOTE, _FREE = LIVE, DOOMED, DEMOTING, IN_REMOTE, FREE
_MIN_BUCKETS = 16
# The per-slot columns held as typed memoryviews: (attribute, typecode).
_Code = Literal["Q", "i", "I", "H"]
_COLUMNS: tuple[tuple[str, _Code], ...] = (
    ("_digest", "Q"),
    ("_chain", "i"),
    ("_ns", "I"),
    ("_key_off", "Q"),
    ("_key_len", "H"),
    ("_size", "Q"),
    ("_xxh3", "Q"),
    ("_gen", "Q"),
    ("_record", "Q"),
    ("_pins", "I"),
    ("_loc", "Q"),
)
_RETRY_HELD = 16  # removed slots a tier still names, looked at again per add


_DRAM, _NVME = TierName.DRAM, TierName.NVME
# The numpy dtype of each column's typecode (for the bulk add's vectorised writes).
_DTYPES = {"Q": np.uint64, "i": np.int32, "I": np.uint32, "H": np.uint16}


def seeded_digest(ns_id: str, key: bytes | memoryview) -> int:
    """The catalog's default key digest: xxh3-64 of the key seeded by the namespace's own
    xxh3-64 (what `RecordColumns.digest` must hold)."""
    return xxhash.xxh3_64_intdigest(key, xxhash.xxh3_64_intdigest(ns_id.encode()))


def tier_of(entry: Entry | None) -> TierName | None:
    """The fastest tier holding a block (None: not cached)."""
    if entry is None:
        return None
    if entry.dram_extent is not None:
        return _DRAM
    return _NVME if entry.nvme_record_bytes else None


def _never(slot: int) -> bool:
    return False


class DramHook(Protocol):
    """`Catalog(on_dram=...)`: a live block's DRAM copy appeared (`extent`, with the
    block's size, checksum and generation) or went (`extent` None)."""

    def __call__(
        self, block_id: BlockId, extent: Extent | None, size_bytes: int, xxh3_64: int, gen: int
    ) -> None: ...


class Catalog(KeyIndex):
    """key -> residency: copies, pins and byte accounting, reported as residency events."""

    # The columns (_COLUMNS), set in __init__ and _grow.
    _digest: memoryview[int]
    _chain: memoryview[int]
    _ns: memoryview[int]
    _key_off: memoryview[int]
    _key_len: memoryview[int]
    _size: memoryview[int]
    _xxh3: memoryview[int]
    _gen: memoryview[int]
    _record: memoryview[int]
    _pins: memoryview[int]
    _loc: memoryview[int]

    def __init__(
        self,
        on_change: Callable[[BlockId, list[TierName]], None] | None = None,
        digest: Callable[[BlockId], int] | None = None,
        on_dram: DramHook | None = None,
        on_changes: BlockEventRun | None = None,
    ) -> None:
        # Told each time a block's set of tiers changes (added, copied, dropped, removed:
        # then []), for the residency events routers index; `on_changes`, where given,
        # told at once of a run of blocks with one new set (recovery's bulk adds).
        self._on_change = on_change
        self._on_changes = on_changes
        # Told only when a live block's DRAM copy appears or goes (the tenants'
        # directories): a third of the changes, with the copy's fields, so the hook
        # needs no lookup of the block (a record written or dropped is not its business).
        self._on_dram = on_dram
        # A block's digest: by default xxh3-64 of the key seeded by its namespace's own
        # xxh3-64 (0.1 µs; slots.key_digest, the replay's, hashes a repr: 0.6 µs, on every
        # key of every Lookup and Plan). Tests force collisions with a tiny one.
        self._seeds: dict[str, int] = {}
        self._fast = digest is None
        self._digest_fn = self._seeded_digest if digest is None else digest
        # Whether a tier still names a removed slot (as a parent): then it is not reused.
        self.holds: Callable[[int], bool] = _never
        # Told (slot) when a slot is handed to a new block, for per-slot state kept
        # elsewhere (the residency's chain positions).
        self.on_reuse: Callable[[int], None] | None = None
        # The columns: typed views of anonymous mappings (slots.mapping), grown by remap.
        self._maps: dict[str, mmap.mmap] = {}
        for name, code in _COLUMNS:
            self._maps[name] = mapping(0)
            setattr(self, name, memoryview(self._maps[name]).cast(code))
        self._flags = mapping(0)  # one byte a slot: an mmap indexes as a bytearray does
        self._errors = mapping(0)
        self._era = mapping(0)  # bumped when a slot is freed: stale slot references tell
        self._keys = mapping(0)  # the key heap
        self._keys_used = 0
        self._capacity = 0
        self._grow()
        self._slots = 0  # slots ever made (the arrays' used length)
        self._free = NO_SLOT  # free slots, chained through _chain
        self._to_free: list[int] = []  # removed slots to look at (handle gone, or none)
        self._held: list[int] = []  # removed slots a tier still named when looked at
        self._handles: dict[int, weakref.KeyedRef[int, Entry]] = {}
        # Linear hashing: buckets [0, split) and [base, base + split) are split to the
        # mask 2*base - 1, the others still at base - 1.
        self._heads = array("i", [NO_SLOT]) * _MIN_BUCKETS
        self._base = _MIN_BUCKETS
        self._split = 0
        self._len = 0
        self._unlinked = self._freed = 0  # blocks ever unindexed, slots ever freed: _chains
        self._chains = ChainProbes()
        self.chain_min_keys = CHAIN_MIN_KEYS  # tests keep short chains' probes too
        self._ns_ids: dict[str, int] = {}
        self._ns_names: list[str] = []
        self._ns_tenants: list[str] = []
        self._dram: dict[int, Extent] = {}  # slot -> its DRAM copy (kept after a remove)
        self._dram_slots: set[int] = set()  # the live ones
        self._nvme_count = 0
        self.dram_used_bytes = 0
        self.nvme_used_bytes = 0
        self.nvme_used_by_tenant: Counter[str] = Counter()  # the shared tier's quota basis

    def __len__(self) -> int:
        return self._len

    # ---- slots -----------------------------------------------------------------------------
    def _ns_id(self, ns_id: str) -> int:
        n = self._ns_ids.get(ns_id)
        if n is None:
            n = len(self._ns_names)
            if n > 0xFFFF_FFFF:
                raise OverflowError("more than 2^32 namespaces")
            self._ns_ids[ns_id] = n
            self._ns_names.append(ns_id)
            self._ns_tenants.append(tenant_of(ns_id))
        return n

    def _grow(self) -> None:
        """Double every column. Untouched pages cost nothing, so doubling wastes no RAM,
        and remap moves pages rather than bytes: no copy, no stall at any size."""
        capacity = max(2 * self._capacity, 4096)
        for name, code in _COLUMNS:
            view: memoryview[int] = getattr(self, name)
            itemsize = view.itemsize
            view.release()
            self._maps[name] = remap(self._maps[name], capacity * itemsize)
            setattr(self, name, memoryview(self._maps[name]).cast(code))
        self._flags = remap(self._flags, capacity)
        self._errors = remap(self._errors, capacity)
        self._era = remap(self._era, capacity)
        self._capacity = capacity

    def _new_slot(self) -> int:
        if self._free == NO_SLOT:
            self._reclaim()
        slot = self._free
        if slot != NO_SLOT:
            self._free = self._chain[slot]
            if self.on_reuse is not None:
                self.on_reuse(slot)
            return slot
        if self._slots >= self._capacity:
            self._grow()
        slot = self._slots
        self._slots += 1
        return slot

    def _reclaim(self) -> None:
        """Free the removed slots nothing refers to any more."""
        candidates, self._to_free = self._to_free, []
        if self._held:
            candidates += self._held[:_RETRY_HELD]
            del self._held[:_RETRY_HELD]
        flags, handles = self._flags, self._handles
        for slot in candidates:
            if flags[slot] & (_LIVE | _FREE):
                continue
            ref = handles.get(slot)
            if ref is not None and ref() is not None:
                continue  # its handle's death puts it back on _to_free
            if self.holds(slot):
                self._held.append(slot)
                continue
            handles.pop(slot, None)
            self._dram.pop(slot, None)
            flags[slot] = _FREE
            self._era[slot] = (self._era[slot] + 1) & 0xFF
            self._freed += 1
            self._pins[slot] = 0
            self._record[slot] = 0
            self._errors[slot] = 0
            self._chain[slot] = self._free
            self._free = slot

    def _handle_gone(self, ref: weakref.KeyedRef[int, Entry]) -> None:
        # Called from wherever the last reference dropped: only note it (freeing now could
        # run inside another catalog call); _new_slot frees it.
        slot = ref.key
        if self._handles.get(slot) is ref:
            del self._handles[slot]
            self._to_free.append(slot)

    def handle(self, slot: int) -> Entry:
        """The entry of a slot (the same object while any reference to it lives)."""
        ref = self._handles.get(slot)
        if ref is not None:
            entry = ref()
            if entry is not None:
                return entry
        entry = Entry.__new__(Entry)
        entry.block_id = self.block_id_of(slot)
        entry._catalog = self
        entry._slot = slot
        entry._own = None
        self._handles[slot] = weakref.KeyedRef(entry, self._handle_gone, slot)
        return entry

    def claim(self, slot: int) -> tuple[Entry, Extent] | None:
        """A DRAM victim's handle, claimed (`demoting` set), and its DRAM extent; None if
        the slot has no DRAM copy (the policy's view lagged the catalog)."""
        extent = self._dram.get(slot)
        if extent is None:
            return None
        entry = self.handle(slot)
        self._flags[slot] |= _DEMOTING
        return entry, extent

    def unclaim(self, entry: Entry) -> int:
        """A claimed block's move is over (`demoting` cleared); its pins."""
        if entry._catalog is not self:
            entry.demoting = False
            return entry.pins
        slot = entry._slot
        self._flags[slot] &= ~_DEMOTING & 0xFF
        return self._pins[slot]

    def block_id_of(self, slot: int) -> BlockId:
        off = self._key_off[slot]
        key = self._keys[off : off + self._key_len[slot]]  # an mmap slice is bytes
        return self._ns_names[self._ns[slot]], key

    def digest(self, block_id: BlockId) -> int:
        """The key digest of `block_id` (slot or not)."""
        return self._digest_fn(block_id)

    def digest_of(self, slot: int) -> int:
        """The key digest of the block in `slot` (what the packed policies key by)."""
        return int(self._digest[slot])

    def digests_of(self, slots: np.ndarray) -> np.ndarray:
        """`digest_of` each slot (uint64)."""
        out: np.ndarray = self._np("_digest")[slots]
        return out

    def sizes_of(self, slots: np.ndarray) -> np.ndarray:
        """`size_of` each slot (uint64)."""
        out: np.ndarray = self._np("_size")[slots]
        return out

    def era_of(self, slot: int) -> int:
        """Changes each time `slot` is freed: (slot, era) names one block for good."""
        return self._era[slot]

    def tenant_of_slot(self, slot: int) -> str:
        return self._ns_tenants[self._ns[slot]]

    def is_live_slot(self, slot: int) -> bool:
        return bool(self._flags[slot] & _LIVE)

    def has_dram(self, slot: int) -> bool:
        return slot in self._dram

    def record_bytes_of(self, slot: int) -> int:
        return self._record[slot]

    def size_of(self, slot: int) -> int:
        return self._size[slot]

    def evictable_slot(self, slot: int) -> bool:
        """Live, unpinned and not being moved."""
        return self._flags[slot] & (_LIVE | _DEMOTING) == _LIVE and not self._pins[slot]

    def slots_of(self, ns_id: str, keys: list[bytes]) -> list[int]:
        """The slot of each key (NO_SLOT: not cached), making no handle (chain_probes.py)."""
        return self._chains.slots_of(self, ns_id, keys)

    def tiers_of(self, slots: list[int]) -> list[TierName | None]:
        """`tier_of_slot` of each slot, inlined (a Plan's 256)."""
        dram, record = self._dram, self._record
        return [
            None if s < 0 else _DRAM if s in dram else _NVME if record[s] else None for s in slots
        ]

    # ---- adding ----------------------------------------------------------------------------
    def add(self, entry: Entry) -> None:
        if entry._catalog is self:
            self._add_again(entry)
            return
        if entry._catalog is not None or entry._own is None:
            raise ValueError("the entry belongs to another catalog")
        block_id = entry.block_id
        if self.slot_of(block_id) != NO_SLOT:
            raise KeyError("block already catalogued; remove the old entry first")
        own = entry._own
        size, xxh3, gen, extent, record, pins, doomed, demoting, errors, in_remote, loc = own
        slot = self._put(block_id, size, xxh3, gen, extent, record, loc)
        self._pins[slot] = pins
        self._errors[slot] = min(errors, 255)
        flags = self._flags[slot]
        flags |= (_DOOMED if doomed else 0) | (_DEMOTING if demoting else 0)
        flags |= _IN_REMOTE if in_remote else 0
        self._flags[slot] = flags
        entry._catalog, entry._slot, entry._own = self, slot, None
        self._handles[slot] = weakref.KeyedRef(entry, self._handle_gone, slot)
        self._changed_slot(slot)

    def add_block(
        self,
        block_id: BlockId,
        size_bytes: int,
        xxh3_64: int,
        generation: int,
        extent: Extent,
        published: bool = False,
    ) -> int:
        """`add` of a new block with a DRAM copy and nothing else (a put), without an
        `Entry` (the caller makes a handle, `handle(slot)`, only if it needs one): its
        slot, or NO_SLOT (nothing added) if the key is catalogued already. The key's
        digest is taken once for the check and the insert. `published`: the DRAM hook
        has been told of this very copy already (a put catalogued after its reply, whose
        copy the directory had before it), so it is not told twice."""
        ns_id, key = block_id
        ns = self._ns_ids.get(ns_id)
        if ns is None:
            ns = self._ns_id(ns_id)
        digest = self._digest_fn(block_id)
        if self._find(ns, key, digest) != NO_SLOT:
            return NO_SLOT
        # `_put` for this one case, inlined: a put's block has no record, no location and
        # a DRAM copy, so its set of tiers is DRAM alone (the hooks need no lookups).
        slot = self._new_slot()
        self._digest[slot] = digest
        self._ns[slot] = ns
        self._store_key(slot, key)
        self._size[slot] = size_bytes
        self._xxh3[slot] = xxh3_64
        self._gen[slot] = generation
        self._record[slot] = 0
        if self._loc[slot]:
            self._loc[slot] = 0  # stale from a reused slot
        self._pins[slot] = 0
        self._errors[slot] = 0
        self._flags[slot] = _LIVE
        self._dram[slot] = extent
        self._dram_slots.add(slot)
        self.dram_used_bytes += extent.size_bytes
        self._link(slot)
        if self._on_dram is not None and not published:
            self._on_dram(block_id, extent, size_bytes, xxh3_64, generation)
        if self._on_change is not None:
            self._on_change(block_id, [_DRAM])
        return slot

    def add_record(
        self,
        block_id: BlockId,
        size_bytes: int,
        xxh3_64: int,
        generation: int,
        record_bytes: int,
        location: int = 0,
    ) -> int:
        """Add an NVMe-only block without making an `Entry` (recovery: millions of them);
        returns its slot. The block must not be catalogued already."""
        slot = self._put(block_id, size_bytes, xxh3_64, generation, None, record_bytes, location)
        self._changed_slot(slot)
        return slot

    def add_records(self, cols: RecordColumns) -> np.ndarray:
        """`add_record` for many NVMe-only blocks at once (recovery: a chunk of a fan);
        kvtier/index/catalog_bulk.py, `add_records`, says how."""
        return catalog_bulk.add_records(self, cols)

    def _np(self, name: str) -> np.ndarray:
        """A numpy view of a column (drop it before the column can grow: _grow)."""
        code = dict(_COLUMNS)[name]
        return np.frombuffer(self._maps[name], dtype=_DTYPES[code], count=self._capacity)

    def _put(
        self,
        block_id: BlockId,
        size: int,
        xxh3: int,
        gen: int,
        extent: Extent | None,
        record: int,
        location: int = 0,
        digest: int | None = None,
    ) -> int:
        ns = self._ns_id(block_id[0])
        if digest is None:
            digest = self._digest_fn(block_id)
        slot = self._new_slot()
        self._digest[slot] = digest
        self._ns[slot] = ns
        self._store_key(slot, block_id[1])
        self._size[slot] = size
        self._xxh3[slot] = xxh3
        self._gen[slot] = gen
        self._record[slot] = record
        if location or self._loc[slot]:
            # Written only when set (or stale from a reused slot): in the file layout the
            # column's pages are never touched, so it costs no RAM there.
            self._loc[slot] = location
        self._pins[slot] = 0
        self._errors[slot] = 0
        self._flags[slot] = _LIVE
        if extent is not None:
            self._put_extent(slot, extent)
            self._dram_slots.add(slot)
            self.dram_used_bytes += extent.size_bytes
        if record:
            self._nvme_count += 1
            self._nvme_add(slot, record)
        self._link(slot)
        if extent is not None:
            self._dram_changed(slot, extent, block_id)
        return slot

    def _add_again(self, entry: Entry) -> None:
        """An entry of this catalog that was removed, added back as it is."""
        slot = entry._slot
        if self._flags[slot] & _LIVE or self.slot_of(entry.block_id) != NO_SLOT:
            raise KeyError("block already catalogued; remove the old entry first")
        self._flags[slot] |= _LIVE
        extent = entry.dram_extent
        if extent is not None:
            self._dram_slots.add(slot)
            self.dram_used_bytes += extent.size_bytes
        if self._record[slot]:
            self._nvme_count += 1
            self._nvme_add(slot, self._record[slot])
        self._link(slot)
        if extent is not None:
            self._dram_changed(slot, extent)
        self._changed_slot(slot)

    def _put_extent(self, slot: int, extent: Extent | None) -> None:
        if extent is None:
            self._dram.pop(slot, None)
        else:
            self._dram[slot] = extent

    def _tiers(self, slot: int) -> list[TierName]:
        out = []
        if slot in self._dram:
            out.append(_DRAM)
        if self._record[slot]:
            out.append(_NVME)
        return out

    def _dram_changed(
        self, slot: int, extent: Extent | None, block_id: BlockId | None = None
    ) -> None:
        if self._on_dram is not None:
            if block_id is None:
                block_id = self.block_id_of(slot)
            self._on_dram(block_id, extent, self._size[slot], self._xxh3[slot], self._gen[slot])

    def _changed_slot(self, slot: int, gone: bool = False, block_id: BlockId | None = None) -> None:
        if self._on_change is not None:
            if block_id is None:
                block_id = self.block_id_of(slot)
            self._on_change(block_id, [] if gone else self._tiers(slot))

    def _mine(self, entry: Entry) -> bool:
        """Whether `entry` is this catalog's and still in its index."""
        return entry._catalog is self and bool(self._flags[entry._slot] & _LIVE)

    # ---- copies ----------------------------------------------------------------------------
    def set_nvme(self, entry: Entry, record_bytes: int, location: int = 0) -> None:
        if entry._catalog is self:
            # The entry's properties, by its slot (a demotion batch sets each of its
            # records here: the setters' calls were most of this one's).
            slot = entry._slot
            if self._record[slot]:
                raise ValueError("entry already has an NVMe record")
            self._record[slot] = record_bytes
            self._loc[slot] = location
            if self._flags[slot] & _LIVE:
                self._nvme_count += 1
                self._nvme_add(slot, record_bytes)
                self._changed_slot(slot, block_id=entry.block_id)
            return
        if entry.nvme_record_bytes:  # an entry of no catalog: its own fields
            raise ValueError("entry already has an NVMe record")
        entry.nvme_record_bytes = record_bytes
        entry.nvme_location = location

    def set_dram(self, entry: Entry, extent: Extent) -> None:
        """A copy was promoted into DRAM (the entry keeps its NVMe record too)."""
        if entry.dram_extent is not None:
            raise ValueError("entry already has a DRAM copy")
        entry.dram_extent = extent
        if self._mine(entry):
            self._dram_slots.add(entry._slot)
            self.dram_used_bytes += extent.size_bytes
            self._dram_changed(entry._slot, extent, entry.block_id)
            self._changed_slot(entry._slot, block_id=entry.block_id)

    def drop_dram(self, entry: Entry) -> Extent | None:
        """Forget the DRAM copy; returns its extent for the caller to free."""
        if entry._catalog is self:  # as `set_nvme`: by the slot, not the properties
            slot = entry._slot
            extent = self._dram.pop(slot, None)
            if extent is not None and self._flags[slot] & _LIVE:
                self._dram_slots.discard(slot)
                self.dram_used_bytes -= extent.size_bytes
                if not self._record[slot]:
                    self._forget(slot)
                self._dram_changed(slot, None, entry.block_id)
                self._changed_slot(slot, block_id=entry.block_id)
            return extent
        extent = entry.dram_extent  # an entry of no catalog: its own field
        if extent is not None:
            entry.dram_extent = None
        return extent

    def drop_nvme(self, entry: Entry) -> int:
        """Forget the NVMe copy; returns its record size (0 if there was none)."""
        record_bytes = entry.nvme_record_bytes
        if not record_bytes:
            return 0
        entry.nvme_record_bytes = 0
        if self._mine(entry):
            slot = entry._slot
            self._nvme_count -= 1
            self._nvme_add(slot, -record_bytes)
            if slot not in self._dram:
                self._forget(slot)
            self._changed_slot(slot, block_id=entry.block_id)
        return record_bytes

    def remove(self, entry: Entry) -> None:
        """Take the entry out of every lookup now; its copies stay on it for the caller to free.

        Sets `doomed` when it is pinned: the last unpin must free its resources.
        """
        if not self._mine(entry):
            return
        slot = entry._slot
        extent = self._dram.get(slot)
        if extent is not None:
            self.dram_used_bytes -= extent.size_bytes
        if self._record[slot]:
            self._nvme_count -= 1
            self._nvme_add(slot, -self._record[slot])
        self._forget(slot)
        self._flags[slot] |= _DOOMED
        if extent is not None:
            self._dram_changed(slot, None, entry.block_id)
        self._changed_slot(slot, gone=True, block_id=entry.block_id)

    def _nvme_add(self, slot: int, delta_bytes: int) -> None:
        self.nvme_used_bytes += delta_bytes
        self.nvme_used_by_tenant[self._ns_tenants[self._ns[slot]]] += delta_bytes

    def is_live(self, entry: Entry) -> bool:
        return self._mine(entry)

    # ---- NVMe locations (the segment layout's reclaim asks, on the catalog's thread) -----
    def _record_slot(self, block_id: BlockId, generation: int, location: int) -> int:
        slot = self.slot_of(block_id)
        if (
            slot == NO_SLOT
            or not self._record[slot]
            or self._gen[slot] != generation
            or self._loc[slot] != location
        ):
            return NO_SLOT
        return slot

    def holds_record(self, block_id: BlockId, generation: int, location: int) -> bool:
        """Whether the catalog holds this generation's NVMe record of `block_id` at
        `location`."""
        return self._record_slot(block_id, generation, location) != NO_SLOT

    def move_record(self, block_id: BlockId, generation: int, old: int, new: int) -> bool:
        """The record was copied from `old` to `new`: take it if the catalog still has it
        at `old` (else the copy is dead); whether it did."""
        slot = self._record_slot(block_id, generation, old)
        if slot == NO_SLOT:
            return False
        self._loc[slot] = new
        return True

    def _forget(self, slot: int) -> None:
        """Out of the index; the slot's fields stay for its handle, if any."""
        self._unlink(slot)
        self._flags[slot] &= ~_LIVE & 0xFF
        self._dram_slots.discard(slot)
        ref = self._handles.get(slot)
        if ref is None or ref() is None:
            self._to_free.append(slot)

    @staticmethod
    def pin(entry: Entry) -> None:
        entry.pins += 1

    @staticmethod
    def unpin(entry: Entry) -> None:
        if entry.pins <= 0:
            raise ValueError("unpin without pin")
        entry.pins -= 1

    # ---- reading ---------------------------------------------------------------------------
    def get(self, block_id: BlockId) -> Entry | None:
        slot = self.slot_of(block_id)
        return None if slot == NO_SLOT else self.handle(slot)

    def __contains__(self, block_id: object) -> bool:
        return isinstance(block_id, tuple) and self.slot_of(block_id) != NO_SLOT

    def tier_of_slot(self, slot: int) -> TierName | None:
        if slot == NO_SLOT:
            return None
        if slot in self._dram:
            return _DRAM
        return _NVME if self._record[slot] else None

    def lookup(self, ns_id: str, keys: list[bytes]) -> LookupResult:
        return LookupResult.of(self.tiers_of(self.slots_of(ns_id, keys)))

    def find(self, ns_id: str, keys: list[bytes]) -> list[Entry | None]:
        """The entry of each key (None: not cached)."""
        handle = self.handle
        return [None if s == NO_SLOT else handle(s) for s in self.slots_of(ns_id, keys)]

    def entries(self) -> Iterator[Entry]:
        """Every live entry (from a snapshot of the slots: callers may await between
        items; a block removed meanwhile is skipped)."""
        flags, era = self._flags, self._era
        # 5 bytes a live slot, not a tuple each (a List of a 10 M catalog).
        slots = array("i", (s for s in range(self._slots) if flags[s] & _LIVE))
        eras = bytes(era[s] for s in slots)
        for slot, was in zip(slots, eras, strict=True):
            if flags[slot] & _LIVE and era[slot] == was:
                yield self.handle(slot)

    def dram_slots(self) -> list[int]:
        """The slots with a DRAM copy now (a copy of the set)."""
        return list(self._dram_slots)

    def count(self, tier: TierName) -> int:
        return len(self._dram_slots) if tier is TierName.DRAM else self._nvme_count
