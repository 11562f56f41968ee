"""The catalog's kept chain probes: an engine asks about each waiting prompt's chain every
scheduler step, so `Catalog.slots_of` keeps the answer for a chain of CHAIN_MIN_KEYS or
more (CHAIN_KEYS_KEPT keys' worth) and, asked again, probes again only what may have
changed: the misses if a block was indexed since, the hits if one was taken out (a hit
still live in a slot not freed since, by its era, is the same block; past 255 frees an
era may have wrapped, so all). docs/design.md, "A chain asked again"."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvtier.index.entry import LIVE

# Keys of the chains whose probe is kept (the least recently asked go first), each chain
# counted CHAIN_OVERHEAD_KEYS more for its arrays (~0.5 KiB): 240 chains of 256 keys, ~22
# KiB each with 32-byte keys; at most ~4 k short ones.
CHAIN_KEYS_KEPT = 1 << 16
CHAIN_OVERHEAD_KEYS = 16
# A chain shorter than this is probed each time (a few keys cost less than keeping them).
CHAIN_MIN_KEYS = 16


class CatalogCounts(Protocol):
    """What the kept probes read of a `Catalog` (its own fields)."""

    _len: int  # blocks indexed now
    _unlinked: int  # blocks ever taken out of the index
    _freed: int  # slots ever freed
    _era: mmap.mmap
    _flags: mmap.mmap
    chain_min_keys: int

    def _probe(self, ns_id: str, keys: list[bytes]) -> list[int]: ...


@dataclass(slots=True)
class _ChainProbe:
    """A chain's probe as `slots_of` answered it, and the catalog's counts then."""

    keys: list[bytes]
    slots: list[int]  # each key's slot, or NO_SLOT
    found: np.ndarray  # the same, int64
    hits: np.ndarray  # bool: found >= 0
    eras: np.ndarray  # uint8: each hit's slot's era
    linked: int  # blocks ever indexed (`_len + _unlinked`)
    unlinked: int
    freed: int


class ChainProbes:
    """The kept probes of one catalog, by (namespace, last key, length)."""

    def __init__(self) -> None:
        self._chains: dict[tuple[str, bytes, int], _ChainProbe] = {}
        self._keys = 0  # held, with CHAIN_OVERHEAD_KEYS a chain

    def __len__(self) -> int:
        return len(self._chains)

    def slots_of(self, cat: CatalogCounts, ns_id: str, keys: list[bytes]) -> list[int]:
        if len(keys) < cat.chain_min_keys:
            return cat._probe(ns_id, keys)
        memo_key = (ns_id, keys[-1], len(keys))
        chains = self._chains
        kept = chains.pop(memo_key, None)
        if kept is not None:
            self._keys -= len(kept.keys) + CHAIN_OVERHEAD_KEYS
            if kept.keys != keys:
                kept = None
        if kept is None:
            kept = _kept(cat, keys, np.array(cat._probe(ns_id, keys), dtype=np.int64))
        elif kept.linked != cat._len + cat._unlinked or kept.unlinked != cat._unlinked:
            kept = _kept(cat, keys, _reprobe(cat, ns_id, keys, kept))
        chains[memo_key] = kept
        self._keys += len(keys) + CHAIN_OVERHEAD_KEYS
        while self._keys > CHAIN_KEYS_KEPT:
            oldest = chains.pop(next(iter(chains)))  # the least recently asked
            self._keys -= len(oldest.keys) + CHAIN_OVERHEAD_KEYS
        return list(kept.slots)


def _kept(cat: CatalogCounts, keys: list[bytes], found: np.ndarray) -> _ChainProbe:
    hits = found >= 0
    eras = np.frombuffer(cat._era, np.uint8)[found[hits]]
    linked = cat._len + cat._unlinked
    return _ChainProbe(
        list(keys), found.tolist(), found, hits, eras, linked, cat._unlinked, cat._freed
    )


def _reprobe(cat: CatalogCounts, ns_id: str, keys: list[bytes], kept: _ChainProbe) -> np.ndarray:
    found = kept.found.copy()
    again = np.zeros(len(keys), dtype=bool)
    if cat._len + cat._unlinked != kept.linked:
        again |= ~kept.hits  # a block indexed since may be one of the misses
    if cat._unlinked != kept.unlinked:
        if cat._freed - kept.freed > 0xFF:
            again[:] = True
        else:
            where = np.flatnonzero(kept.hits)
            slots = found[where]
            same = (np.frombuffer(cat._flags, np.uint8)[slots] & LIVE != 0) & (
                np.frombuffer(cat._era, np.uint8)[slots] == kept.eras
            )
            again[where[~same]] = True
    redo = np.flatnonzero(again)
    if len(redo):
        found[redo] = cat._probe(ns_id, [keys[i] for i in redo.tolist()])
    return found
