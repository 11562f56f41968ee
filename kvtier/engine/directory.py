"""Per-tenant directories: where each DRAM block of a tenant is, for its clients to read
without asking (direct reads, docs/design.md).

A directory is a sealed memfd (`F_SEAL_FUTURE_WRITE`, like the arena: only this process's
mapping writes it) that a tenant's sessions map read-only, received at the handshake
beside the arena. It is an open-addressed table of ENTRY_BYTES entries, each eight
little-endian u64 words:

    seq | digest_lo | digest_hi | offset | size_bytes | xxh3_64 | generation | 0

`digest` is the xxh3-128 of `key_encoding(namespace, key)`; a client trusts a digest match
as a key match (a 2^-128 chance per pair of keys of reading another key of the same
tenant, which that client could read anyway). A block's entry is one of the PROBE_SLOTS
entries from `digest_lo % entries`; when all of them hold other blocks it is not
published and readers take the Acquire path.

Seqlock: the writer makes `seq` odd, writes the other words, and makes it even again
(+2 in all); unpublishing makes it odd, clears the entry and makes it even. A reader
reads `seq` (even, non-zero), the entry, the block's bytes, then `seq` again, and keeps
the copy only if both reads agree. Every extent is unpublished before it is freed
(`DramSpace`'s arenas call `unpublish_extent` first), and an extent is only written
after it is allocated again, so bytes a reader copied from a rewritten extent always
come with a changed `seq`. That needs the stores to become visible in program order
(x86-64's TSO); clients elsewhere do not read directories (`kvtier.client.zerocopy`).

Lifecycle: `new_directory(entries)` -> `publish`/`unpublish` from the catalog's changes,
and `unpublish_extent` from the arena's frees -> `close()`. `new_directory` gives
NativeDirectory where kvtier/engine/_directory_native.c was built: the same table after
the same calls (tests/engine/test_directory_native.py compares them byte for byte), its
per-block work in C and its block ids out of the garbage collector's walks; Directory,
this module's Python, where it was not or KVTIER_NATIVE=0.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from kvtier._directory import (
    DIGEST_HI,
    DIGEST_LO,
    ENTRY_BYTES,
    ENTRY_WORDS,
    GENERATION,
    OFFSET,
    PROBE_SLOTS,
    SEQ,
    SIZE,
    XXH3,
    key_digest,
)
from kvtier.env import python_twins_asked_for
from kvtier.keys import namespace_of, tenant_of
from kvtier.tiers.dram import ALIGN_BYTES, ARENA_SEALS
from kvtier.types import BlockId, Extent

if TYPE_CHECKING:
    from kvtier.engine.dram import Arena

# Sized from the arena: an entry for every DIRECTORY_BLOCK_BYTES of it, twice over (the
# table at most half full for blocks of that size or larger), a power of two within the
# bounds. 64 KiB is a small KV block (16 tokens of a 1B model); smaller blocks beyond the
# table's room are simply not published.
DIRECTORY_BLOCK_BYTES = 64 << 10
MIN_ENTRIES = 1024
MAX_ENTRIES = 1 << 22  # 256 MiB of table at most
_FIELDS = struct.Struct("<6Q")  # digest_lo .. generation


def entries_for(arena_bytes: int) -> int:
    wanted = max(MIN_ENTRIES, 2 * arena_bytes // DIRECTORY_BLOCK_BYTES)
    return min(MAX_ENTRIES, 1 << (wanted - 1).bit_length())


class DirectoryTable(Protocol):
    """What the store asks of a tenant's directory: Directory, or NativeDirectory (the
    same table, its per-block work in C)."""

    entries: int

    @property
    def fd(self) -> int: ...

    @property
    def unpublished_full(self) -> int: ...

    def publish(
        self,
        block_id: BlockId,
        offset: int,
        size_bytes: int,
        xxh3_64: int,
        generation: int,
        namespace: bytes | None = None,
    ) -> bool: ...

    def unpublish(self, block_id: BlockId) -> None: ...

    def unpublish_extent(self, extent: Extent) -> None: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


class _Table:
    """A directory's sealed memfd and this process's one writable mapping of it."""

    def __init__(self, entries: int) -> None:
        if entries <= 0 or entries & (entries - 1):
            raise ValueError("a directory's entries must be a power of two")
        self.entries = entries
        self._fd = os.memfd_create("kvtier-directory", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, entries * ENTRY_BYTES)
        self._map = mmap.mmap(self._fd, entries * ENTRY_BYTES, flags=mmap.MAP_SHARED)
        # Sealed once this writable mapping exists: any other mapping is read-only.
        fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, ARENA_SEALS)

    @property
    def fd(self) -> int:
        """The sealed memfd handed to this tenant's sessions (mapped read-only there)."""
        return self._fd

    def _close_table(self) -> None:
        self._map.close()
        os.close(self._fd)


class Directory(_Table):
    """One tenant's directory: written only here, on the event loop's thread."""

    def __init__(self, entries: int) -> None:
        super().__init__(entries)
        self._words = memoryview(self._map).cast("Q")  # an item store is one 8-byte store
        self._owner: list[BlockId | None] = [None] * entries
        self._slot_of: dict[BlockId, int] = {}
        self._at_offset: dict[int, int] = {}  # extent offset -> slot
        self.unpublished_full = 0  # blocks not published: their probe window was full

    def publish(
        self,
        block_id: BlockId,
        offset: int,
        size_bytes: int,
        xxh3_64: int,
        generation: int,
        namespace: bytes | None = None,
    ) -> bool:
        """Make a DRAM block readable at `offset` (replacing what its key had); False
        when its probe window is full of other blocks (not published). `namespace`: the
        block's namespace encoded, when the caller has it."""
        slot = self._slot_of.get(block_id)
        if slot is not None:
            base = slot * ENTRY_WORDS
            words = self._words
            if words[base + OFFSET] == offset and words[base + GENERATION] == generation:
                return True  # published already: a put's before its reply, then the catalog's
        if namespace is None:
            namespace = namespace_of(block_id[0]).encode()
        low, high = key_digest(namespace, block_id[1])
        if slot is None:
            slot = self._free_slot(low, high)
            if slot is None:
                self.unpublished_full += 1
                return False
        else:
            self._at_offset.pop(self._words[slot * ENTRY_WORDS + OFFSET], None)
        base = slot * ENTRY_WORDS
        words = self._words
        seq = words[base + SEQ]
        words[base + SEQ] = seq + 1 | 1  # odd: readers of this entry retry
        _FIELDS.pack_into(
            self._map, (base + DIGEST_LO) * 8, low, high, offset, size_bytes, xxh3_64, generation
        )
        words[base + SEQ] = (seq | 1) + 1  # even again, and never 0
        self._owner[slot] = block_id
        self._slot_of[block_id] = slot
        self._at_offset[offset] = slot
        return True

    def _free_slot(self, low: int, high: int) -> int | None:
        mask = self.entries - 1
        free: int | None = None
        for i in range(PROBE_SLOTS):
            slot = (low + i) & mask
            owner = self._owner[slot]
            if owner is None:
                if free is None:
                    free = slot
            elif self._words[slot * ENTRY_WORDS + DIGEST_LO] == low and (
                self._words[slot * ENTRY_WORDS + DIGEST_HI] == high
            ):
                return None  # another key with this digest: neither is told apart, skip
        return free

    def unpublish(self, block_id: BlockId) -> None:
        """Readers stop finding `block_id` here (before its extent may be rewritten)."""
        slot = self._slot_of.pop(block_id, None)
        if slot is None:
            return
        base = slot * ENTRY_WORDS
        words = self._words
        self._at_offset.pop(words[base + OFFSET], None)
        seq = words[base + SEQ]
        words[base + SEQ] = seq + 1  # odd: a reader copying this block now will not keep it
        _FIELDS.pack_into(self._map, (base + DIGEST_LO) * 8, 0, 0, 0, 0, 0, 0)
        words[base + SEQ] = seq + 2
        self._owner[slot] = None

    def unpublish_extent(self, extent: Extent) -> None:
        """`extent` is about to be freed: unpublish every block that starts inside it (one
        block's extent, or a run of several coalesced by the caller; blocks start on
        pages). The cheaper of walking its pages and walking the published offsets."""
        at = self._at_offset
        if not at:
            return
        start, end = extent.offset, extent.offset + extent.size_bytes
        if extent.size_bytes // ALIGN_BYTES <= len(at):
            inside = [o for o in range(start, end, ALIGN_BYTES) if o in at]
        else:
            inside = [o for o in at if start <= o < end]
        for offset in inside:
            owner = self._owner[at[offset]]
            assert owner is not None
            self.unpublish(owner)

    def __len__(self) -> int:
        return len(self._slot_of)

    def close(self) -> None:
        self._words.release()
        self._close_table()


def _namespace_bytes(ns_id: str) -> bytes:
    return namespace_of(ns_id).encode()


def _native_type() -> Callable[[int], DirectoryTable] | None:
    """NativeDirectory, or None where kvtier/engine/_directory_native.c was not built (or
    was built for another entry layout than kvtier/_directory.py's)."""
    try:
        from kvtier.engine._directory_native import LAYOUT, DirectoryCore
    except ImportError:
        return None
    words = (SEQ, DIGEST_LO, DIGEST_HI, OFFSET, SIZE, XXH3, GENERATION)
    if (*words, ENTRY_WORDS, PROBE_SLOTS) != LAYOUT:  # built for another layout
        return None

    class NativeDirectory(DirectoryCore, _Table):
        """Directory with its per-block work in C: the same table after the same calls."""

        def __init__(self, entries: int) -> None:
            _Table.__init__(self, entries)
            DirectoryCore.__init__(
                self, self._map, entries, key_digest, _namespace_bytes, ALIGN_BYTES
            )

        def close(self) -> None:
            self.release()  # lets go of the mapping: it can be closed
            self._close_table()

    return NativeDirectory


NATIVE_DIRECTORY = _native_type()


def new_directory(entries: int) -> DirectoryTable:
    """A tenant's directory: NativeDirectory where it was built (and KVTIER_NATIVE is not
    "0"), else Directory."""
    if NATIVE_DIRECTORY is None or python_twins_asked_for():
        return Directory(entries)
    return NATIVE_DIRECTORY(entries)


class Directories:
    """Every tenant's directory, kept in step with the catalog (`dram_changed`, its DRAM
    hook: a block whose DRAM copy appears is published, one whose DRAM copy goes or that
    is removed is unpublished) and with the arenas (each unpublishes an extent before
    freeing it: the one place every free passes, so no path can free a published
    extent)."""

    def __init__(self, arenas: Mapping[str, Arena], enabled: bool, max_key_bytes: int) -> None:
        self._by_tenant: dict[str, DirectoryTable] = {}
        # namespace id -> (its tenant, its namespace encoded): the key digest's input
        self._ns: dict[str, tuple[str, bytes]] = {}
        # A direct read asks the daemon nothing, so no request check sees its key: a
        # block whose key the limits refuse (lowered by a reload) is never published.
        self.max_key_bytes = max_key_bytes
        if not enabled:
            return
        for tenant, arena in arenas.items():
            directory = self._by_tenant[tenant] = new_directory(entries_for(arena.capacity_bytes))
            arena.before_free = directory.unpublish_extent

    def fd(self, tenant: str) -> int | None:
        """The memfd of `tenant`'s directory, for its sessions only; None when off."""
        directory = self._by_tenant.get(tenant)
        return directory.fd if directory is not None else None

    def of(self, tenant: str) -> DirectoryTable | None:
        return self._by_tenant.get(tenant)

    def dram_changed(
        self, block_id: BlockId, extent: Extent | None, size_bytes: int, xxh3_64: int, gen: int
    ) -> None:
        """The catalog's DRAM hook: a live block's DRAM copy appeared at `extent` (publish
        it) or went (`extent` None: unpublish it)."""
        ns_id, key = block_id
        known = self._ns.get(ns_id)
        if known is None:
            tenant = tenant_of(ns_id)
            known = self._ns[ns_id] = (tenant, namespace_of(ns_id).encode())
        directory = self._by_tenant.get(known[0])
        if directory is None:
            return
        if extent is None or len(key) > self.max_key_bytes:
            directory.unpublish(block_id)
            return
        directory.publish(block_id, extent.offset, size_bytes, xxh3_64, gen, known[1])

    def limit_keys(self, max_key_bytes: int, blocks: Iterable[BlockId]) -> int:
        """A reload's new `limits.max_key_bytes`: unpublish the `blocks` (those in DRAM)
        whose keys it now refuses, so that their gets take the Acquire path and its
        InvalidArgument, as every other request of such a key does. How many."""
        self.max_key_bytes = max_key_bytes
        if not self._by_tenant:
            return 0
        withdrawn = 0
        for block_id in blocks:
            if len(block_id[1]) > max_key_bytes:
                directory = self._by_tenant.get(tenant_of(block_id[0]))
                if directory is not None:
                    directory.unpublish(block_id)
                    withdrawn += 1
        return withdrawn

    def close(self) -> None:
        for directory in self._by_tenant.values():
            directory.close()
        self._by_tenant.clear()
