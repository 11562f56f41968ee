"""The catalog's bulk add (`Catalog.add_records`): a chunk of recovered NVMe-only blocks
added with the hashing, the column writes and the linear-hashing inserts done on numpy
arrays, to the same slots, fields, accounting, events and buckets as adding them one by
one (tests/index/test_catalog_bulk.py holds it to that). Apart from catalog.py because
the catalog's one-block paths fill that module; it reaches the catalog's columns through
`CatalogInternals`, a Protocol, not an import (catalog.py imports this).
"""

from __future__ import annotations

import mmap
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from kvtier.index.entry import LIVE
from kvtier.index.slots import NO_SLOT, remap
from kvtier.types import BlockId, TierName

__all__ = ["BlockEventRun", "CatalogInternals", "RecordColumns", "add_records"]


class BlockEventRun(Protocol):
    """`Catalog(on_changes=...)`: blocks (ns_ids[i], keys[i]), in order, each now held in
    `tiers` (what `on_change` would be told of each)."""

    def __call__(
        self, ns_ids: Sequence[str], keys: Sequence[bytes], tiers: list[TierName]
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class RecordColumns:
    """NVMe-only blocks as columns, one element a block (numpy arrays of one length), for
    `Catalog.add_records`: recovery hands a fan of records over this way, with no object
    per record. The namespace is an index into `ns_names`, the key (offset, length) in
    `blob`; `digest` is `seeded_digest` of each (None: the catalog computes it)."""

    ns_names: list[str]
    ns: np.ndarray  # uint32, into ns_names
    blob: bytes | mmap.mmap  # a slice of either is the key's bytes
    key_off: np.ndarray  # int64, into blob
    key_len: np.ndarray  # int64
    size_bytes: np.ndarray  # uint64: the payload
    xxh3_64: np.ndarray  # uint64
    generation: np.ndarray  # uint64
    record_bytes: np.ndarray  # uint64
    location: np.ndarray  # uint64 (0: none)
    digest: np.ndarray | None = None  # uint64

    def __len__(self) -> int:
        return len(self.ns)

    def key(self, i: int) -> bytes:
        off = int(self.key_off[i])
        return self.blob[off : off + int(self.key_len[i])]

    def block_id(self, i: int) -> BlockId:
        return self.ns_names[int(self.ns[i])], self.key(i)

    def take(self, rows: np.ndarray | slice) -> RecordColumns:
        """These rows (the same blob and names)."""
        return RecordColumns(
            self.ns_names,
            self.ns[rows],
            self.blob,
            self.key_off[rows],
            self.key_len[rows],
            self.size_bytes[rows],
            self.xxh3_64[rows],
            self.generation[rows],
            self.record_bytes[rows],
            self.location[rows],
            None if self.digest is None else self.digest[rows],
        )


class CatalogInternals(Protocol):
    """What the bulk add reads and writes of a `Catalog` (its own fields)."""

    _heads: array[int]
    _keys: mmap.mmap
    _keys_used: int
    _free: int
    _to_free: list[int]
    _held: list[int]
    _slots: int
    _capacity: int
    _base: int
    _split: int
    _len: int
    _fast: bool
    _digest_fn: Callable[[BlockId], int]
    _on_change: Callable[[BlockId, list[TierName]], None] | None
    _on_changes: BlockEventRun | None
    _nvme_count: int
    _ns_tenants: list[str]
    _errors: mmap.mmap
    _flags: mmap.mmap
    nvme_used_bytes: int
    nvme_used_by_tenant: Counter[str]

    def _ns_id(self, ns_id: str) -> int: ...
    def _seed(self, ns_id: str) -> int: ...
    def _np(self, name: str) -> np.ndarray: ...
    def _grow(self) -> None: ...
    def _new_slot(self) -> int: ...
    def _key_is(self, slot: int, key: bytes) -> bool: ...
    def _store_key(self, slot: int, key: bytes) -> None: ...
    def _changed_slot(self, slot: int, gone: bool = False) -> None: ...
    def slot_of(self, block_id: BlockId) -> int: ...
    def add_record(
        self,
        block_id: BlockId,
        size_bytes: int,
        xxh3_64: int,
        generation: int,
        record_bytes: int,
        location: int = 0,
    ) -> int: ...


def add_records(cat: CatalogInternals, cols: RecordColumns) -> np.ndarray:
    """`add_record` for many NVMe-only blocks at once (recovery: a chunk of a fan):
    the same slots, fields, accounting, events and index as adding them one by one in
    order, with the hashing, the column writes and the hash-table inserts done on
    arrays. Returns each row's slot (int64), NO_SLOT for a block catalogued already,
    which is not added. Rows must name distinct blocks (else ValueError)."""
    n = len(cols)
    out = np.full(n, NO_SLOT, dtype=np.int64)
    if not n:
        return out
    # Namespaces interned in the order rows first name them, as one by one would.
    used, first_row = np.unique(cols.ns, return_index=True)
    ns_map = np.zeros(len(cols.ns_names), dtype=np.uint32)
    for u in used[np.argsort(first_row)].tolist():
        ns_map[u] = cat._ns_id(cols.ns_names[u])
    ns = ns_map[cols.ns.astype(np.intp)]
    digest = _digests_of(cat, cols)
    if len(np.unique(digest)) != n:
        # Two rows with one digest: the same block twice (an error), or a collision,
        # which the per-record path resolves by comparing keys.
        ids = {cols.block_id(i) for i in range(n)}
        if len(ids) != n:
            raise ValueError("add_records: a block appears twice")
        for i in range(n):
            if cat.slot_of(cols.block_id(i)) == NO_SLOT:
                out[i] = cat.add_record(
                    cols.block_id(i),
                    int(cols.size_bytes[i]),
                    int(cols.xxh3_64[i]),
                    int(cols.generation[i]),
                    int(cols.record_bytes[i]),
                    int(cols.location[i]),
                )
        return out
    new = ~_present(cat, cols, ns, digest)
    rows = np.nonzero(new)[0]
    m = len(rows)
    if not m:
        return out
    fresh = cat._free == NO_SLOT and not cat._to_free and not cat._held
    if fresh:
        # No slot to reuse, and _new_slot's reclaim would find none: the next m slots.
        while cat._slots + m > cat._capacity:
            cat._grow()
        slots = np.arange(cat._slots, cat._slots + m, dtype=np.int64)
        cat._slots += m
    else:
        slots = np.array([cat._new_slot() for _ in range(m)], dtype=np.int64)
    out[rows] = slots
    _write_rows(cat, cols, rows, slots, ns[rows], digest[rows], fresh)
    record = cols.record_bytes[rows]
    cat._nvme_count += int(np.count_nonzero(record))
    local_ns = cols.ns[rows]
    for u in np.unique(local_ns).tolist():
        added_bytes = int(record[local_ns == u].sum())
        if added_bytes:
            cat.nvme_used_bytes += added_bytes
            cat.nvme_used_by_tenant[cat._ns_tenants[int(ns_map[u])]] += added_bytes
    _link_many(cat, slots)
    if cat._on_changes is not None and cat._on_change is not None and bool(record.all()):
        # Each new block is on NVMe only, so each event is the same set: told at once.
        names = cols.ns_names
        cat._on_changes(
            [names[u] for u in local_ns.tolist()],
            [cols.key(row) for row in rows.tolist()],
            [TierName.NVME],
        )
    elif cat._on_change is not None:
        for slot in slots.tolist():
            cat._changed_slot(slot)
    return out


def _digests_of(cat: CatalogInternals, cols: RecordColumns) -> np.ndarray:
    if cols.digest is not None and cat._fast:
        return cols.digest.astype(np.uint64, copy=False)
    view, names = memoryview(cols.blob), cols.ns_names
    if cat._fast:
        seeds = [cat._seed(name) for name in names]
        h = xxhash.xxh3_64_intdigest
        values = (
            h(view[o : o + k], seeds[s])
            for o, k, s in zip(
                cols.key_off.tolist(), cols.key_len.tolist(), cols.ns.tolist(), strict=True
            )
        )
    else:
        fn = cat._digest_fn
        values = (fn(cols.block_id(i)) for i in range(len(cols)))
    return np.fromiter(values, dtype=np.uint64, count=len(cols))


def _buckets(cat: CatalogInternals, digest: np.ndarray) -> np.ndarray:
    """`_bucket` of each digest (int64)."""
    low = digest & np.uint64(cat._base - 1)
    high = digest & np.uint64(2 * cat._base - 1)
    return np.where(low < np.uint64(cat._split), high, low).astype(np.int64)


def _present(
    cat: CatalogInternals, cols: RecordColumns, ns: np.ndarray, digest: np.ndarray
) -> np.ndarray:
    """Whether each row's block is catalogued: every bucket chain walked at once, the
    key compared only where digest and namespace match."""
    found = np.zeros(len(digest), dtype=bool)
    heads = np.frombuffer(cat._heads, dtype=np.int32)
    chain, digests, nss = cat._np("_chain"), cat._np("_digest"), cat._np("_ns")
    rows = np.arange(len(digest))
    cur = heads[_buckets(cat, digest)].astype(np.int64)
    while len(rows):
        keep = cur >= 0
        rows, cur = rows[keep], cur[keep]
        hit = (digests[cur] == digest[rows]) & (nss[cur] == ns[rows])
        for i, s in zip(rows[hit].tolist(), cur[hit].tolist(), strict=True):
            if cat._key_is(s, cols.key(i)):
                found[i] = True
        cur = chain[cur].astype(np.int64)
    del heads, chain, digests, nss
    return found


def _write_rows(
    cat: CatalogInternals,
    cols: RecordColumns,
    rows: np.ndarray,
    slots: np.ndarray,
    ns: np.ndarray,
    digest: np.ndarray,
    fresh: bool,
) -> None:
    """_put's column writes for these rows, into these slots."""
    if fresh:
        # The keys, in order, appended to the heap (as _store_key does for new slots).
        lens = cols.key_len[rows].astype(np.int64)
        starts = cols.key_off[rows].astype(np.int64)
        ends = np.cumsum(lens)
        total = int(ends[-1]) if len(ends) else 0
        begins = ends - lens
        gather = np.repeat(starts - begins, lens) + np.arange(total, dtype=np.int64)
        data = np.frombuffer(cols.blob, dtype=np.uint8)[gather].tobytes()
        off = cat._keys_used
        if off + total > len(cat._keys):
            size = len(cat._keys)
            while size < off + total:
                size = max(2 * size, off + total)
            cat._keys = remap(cat._keys, size)
        cat._keys[off : off + total] = data
        cat._keys_used = off + total
        key_off = begins + off
    else:
        for i, slot in zip(rows.tolist(), slots.tolist(), strict=True):
            cat._store_key(slot, cols.key(i))
    loc = cols.location[rows]
    col = cat._np("_loc")
    # Written only where set (or stale from a reused slot): see _put.
    where = loc != 0 if fresh else (loc != 0) | (col[slots] != 0)
    col[slots[where]] = loc[where]
    values = (
        ("_digest", digest),
        ("_ns", ns),
        ("_size", cols.size_bytes[rows]),
        ("_xxh3", cols.xxh3_64[rows]),
        ("_gen", cols.generation[rows]),
        ("_record", cols.record_bytes[rows]),
        ("_pins", 0),
    )
    for name, value in values:
        col = cat._np(name)
        col[slots] = value
    if fresh:
        col = cat._np("_key_off")
        col[slots] = key_off
        col = cat._np("_key_len")
        col[slots] = lens
    del col
    for name, value in (("_errors", 0), ("_flags", LIVE)):
        view = np.frombuffer(getattr(cat, name), dtype=np.uint8, count=cat._capacity)
        view[slots] = value
        del view


def _link_many(cat: CatalogInternals, slots: np.ndarray) -> None:
    """`_link` of each slot: the same buckets, table size and split point after (the
    order within a bucket's chain may differ; nothing depends on it). The buckets the
    table splits meanwhile are emptied and their blocks placed again with the new."""
    m = len(slots)
    before = cat._base + cat._split
    after = max(before, cat._len + m)
    base, split = cat._base, cat._split
    affected: list[np.ndarray] = []
    left = after - before
    while left:
        k = min(base - split, left)
        affected.append(np.arange(split, split + k, dtype=np.int64))
        left -= k
        split += k
        if split == base:
            base, split = 2 * base, 0
    if after > before:
        cat._heads.extend(array("i", [NO_SLOT]) * (after - before))
    heads = np.frombuffer(cat._heads, dtype=np.int32)
    chain = cat._np("_chain")
    moved: list[np.ndarray] = []
    if affected:
        old = np.concatenate(affected)
        old = old[old < before]
        cur = heads[old].astype(np.int64)
        heads[old] = NO_SLOT
        cur = cur[cur >= 0]
        while len(cur):
            moved.append(cur)
            cur = chain[cur].astype(np.int64)
            cur = cur[cur >= 0]
    cat._base, cat._split = base, split
    items = np.concatenate([*moved, slots]) if moved else slots
    bucket = _buckets(cat, cat._np("_digest")[items])
    order = np.argsort(bucket, kind="stable")
    b, s = bucket[order], items[order]
    nxt = np.empty(len(s), dtype=np.int64)
    same = b[1:] == b[:-1]
    nxt[:-1] = np.where(same, s[1:], heads[b[:-1]])
    nxt[-1] = heads[b[-1]]
    chain[s] = nxt
    first = np.ones(len(s), dtype=bool)
    first[1:] = ~same
    heads[b[first]] = s[first]
    cat._len += m
    del heads, chain
