"""The `Entry` handle of kvtier/index/catalog.py: a block's catalog state, read and
written in the catalog's columns once the block is added (see the catalog's docstring)."""

from __future__ import annotations

import mmap
from typing import Any, Protocol

from kvtier.index.slots import NO_SLOT
from kvtier.types import BlockId, Extent, TierName

# Flag bits of a slot (the catalog's `_flags` column).
LIVE = 1  # in the index: lookups find it
DOOMED = 4
DEMOTING = 8
IN_REMOTE = 16
FREE = 32  # in the free list
_DOOMED, _DEMOTING, _IN_REMOTE = DOOMED, DEMOTING, IN_REMOTE


class Columns(Protocol):
    """What an Entry reads of its catalog (kvtier.index.catalog.Catalog; a protocol so
    that this module need not import that one, which imports it)."""

    _size: memoryview[int]
    _xxh3: memoryview[int]
    _gen: memoryview[int]
    _record: memoryview[int]
    _pins: memoryview[int]
    _loc: memoryview[int]
    _flags: mmap.mmap  # one byte a slot
    _errors: mmap.mmap
    _dram: dict[int, Extent]

    def _put_extent(self, slot: int, extent: Extent | None) -> None: ...


class Entry:
    """Catalog state of one block (identity matters: compare with `is`).

    A handle over a catalog slot once added (`Catalog.add`, or handed out by the
    catalog); before that, its own fields."""

    __slots__ = ("__weakref__", "_catalog", "_own", "_slot", "block_id")

    def __init__(
        self,
        block_id: BlockId,
        size_bytes: int,
        xxh3_64: int,
        generation: int,
        dram_extent: Extent | None = None,
        nvme_record_bytes: int = 0,
        pins: int = 0,
        doomed: bool = False,
        demoting: bool = False,
        read_errors: int = 0,
        in_remote: bool = False,
        nvme_location: int = 0,
    ) -> None:
        self.block_id = block_id
        self._catalog: Columns | None = None  # the Catalog, once added
        self._slot = NO_SLOT
        self._own: list[Any] | None = [
            size_bytes,
            xxh3_64,
            generation,
            dram_extent,
            nvme_record_bytes,
            pins,
            doomed,
            demoting,
            read_errors,
            in_remote,
            nvme_location,
        ]

    @property
    def slot(self) -> int:
        """The entry's catalog slot (NO_SLOT before it is added)."""
        return self._slot

    def __repr__(self) -> str:
        return f"Entry({self.block_id!r}, slot={self._slot})"

    # ---- the fields: the slot's array elements, or the entry's own until it is added ----
    def _get(self, i: int) -> Any:
        assert self._own is not None
        return self._own[i]

    def _set(self, i: int, value: Any) -> None:
        assert self._own is not None
        self._own[i] = value

    @property
    def size_bytes(self) -> int:
        c = self._catalog
        return self._get(0) if c is None else c._size[self._slot]

    @property
    def xxh3_64(self) -> int:
        c = self._catalog
        return self._get(1) if c is None else c._xxh3[self._slot]

    @property
    def generation(self) -> int:
        c = self._catalog
        return self._get(2) if c is None else c._gen[self._slot]

    @property
    def dram_extent(self) -> Extent | None:
        c = self._catalog
        if c is None:
            return self._get(3)  # type: ignore[no-any-return]
        return c._dram.get(self._slot)

    @dram_extent.setter
    def dram_extent(self, extent: Extent | None) -> None:
        c = self._catalog
        if c is None:
            self._set(3, extent)
        else:
            c._put_extent(self._slot, extent)

    @property
    def nvme_record_bytes(self) -> int:
        c = self._catalog
        return self._get(4) if c is None else c._record[self._slot]

    @nvme_record_bytes.setter
    def nvme_record_bytes(self, value: int) -> None:
        c = self._catalog
        if c is None:
            self._set(4, value)
        else:
            c._record[self._slot] = value

    @property
    def nvme_location(self) -> int:
        """Where its NVMe record lies, for the layouts that say (opaque here; 0: found by
        name)."""
        c = self._catalog
        return self._get(10) if c is None else c._loc[self._slot]

    @nvme_location.setter
    def nvme_location(self, value: int) -> None:
        c = self._catalog
        if c is None:
            self._set(10, value)
        else:
            c._loc[self._slot] = value

    @property
    def pins(self) -> int:
        c = self._catalog
        return self._get(5) if c is None else c._pins[self._slot]

    @pins.setter
    def pins(self, value: int) -> None:
        c = self._catalog
        if c is None:
            self._set(5, value)
        else:
            c._pins[self._slot] = value

    def _flag(self, i: int, bit: int) -> bool:
        c = self._catalog
        return bool(self._get(i)) if c is None else bool(c._flags[self._slot] & bit)

    def _set_flag(self, i: int, bit: int, on: bool) -> None:
        c = self._catalog
        if c is None:
            self._set(i, on)
        elif on:
            c._flags[self._slot] |= bit
        else:
            c._flags[self._slot] &= ~bit & 0xFF

    @property
    def doomed(self) -> bool:
        return self._flag(6, _DOOMED)

    @doomed.setter
    def doomed(self, on: bool) -> None:
        self._set_flag(6, _DOOMED, on)

    @property
    def demoting(self) -> bool:
        return self._flag(7, _DEMOTING)

    @demoting.setter
    def demoting(self, on: bool) -> None:
        self._set_flag(7, _DEMOTING, on)

    @property
    def read_errors(self) -> int:
        """I/O errors reading its NVMe record (not checksum failures); saturates at 255."""
        c = self._catalog
        return self._get(8) if c is None else c._errors[self._slot]

    @read_errors.setter
    def read_errors(self, value: int) -> None:
        c = self._catalog
        if c is None:
            self._set(8, value)
        else:
            c._errors[self._slot] = min(value, 255)

    @property
    def in_remote(self) -> bool:
        """This node put it in, or fetched it from, the remote tier."""
        return self._flag(9, _IN_REMOTE)

    @in_remote.setter
    def in_remote(self, on: bool) -> None:
        self._set_flag(9, _IN_REMOTE, on)

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
