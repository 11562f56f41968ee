"""SharedTier: the store's flows with the cluster's shared store (the remote tier), over
the RemoteLink driver (kvtier/engine/remote.py).

The shared store has its own eviction, so this node cannot know what it holds: a block
missing here is probed there (Plan/Lookup, one round trip) and fetched (Get/Acquire) into
an ordinary DRAM entry of this node. Puts go out write-through or on eviction
(`remote.admission`), pinned only while their value is copied out of DRAM.
"""

from __future__ import annotations

import asyncio
import time

from kvtier.engine.core import StoreCore
from kvtier.engine.remote import RemoteLink
from kvtier.errors import CorruptRecord
from kvtier.index.catalog import Entry
from kvtier.keys import tenant_of
from kvtier.types import BlockId, TierName


class SharedTier:
    """Used only when a remote tier is configured (`store.remote` is its link)."""

    def __init__(self, store: StoreCore) -> None:
        self._store = store
        self._fetches: dict[BlockId, asyncio.Future[Entry | None]] = {}

    @property
    def _remote(self) -> RemoteLink:
        assert self._store.remote is not None
        return self._store.remote

    async def probe(
        self, ns_id: str, keys: list[bytes], tiers: list[TierName | None]
    ) -> list[TierName | None]:
        """`tiers` with "remote" for the blocks missing here that the remote store holds:
        those after the local prefix, at most remote.max_probe_blocks, in one round trip."""
        store = self._store
        remote = self._remote
        missing = [i for i, t in enumerate(tiers) if t is None]
        missing = missing[: store.config.remote.max_probe_blocks]
        found = await remote.probe([(ns_id, keys[i]) for i in missing])
        out = list(tiers)
        for i, held in zip(missing, found, strict=True):
            if held:
                out[i] = TierName.REMOTE
        return out

    async def fetch(self, block_id: BlockId) -> Entry | None:
        """Fetch a block this node does not hold from the remote tier into DRAM (verified)
        and catalogue it; None for a miss. One fetch per block at a time (`Store.once`)."""
        return await self._store.tasks.once(self._fetches, block_id, lambda: self._fetch(block_id))

    async def _fetch(self, block_id: BlockId) -> Entry | None:
        store = self._store
        remote = self._remote
        tenant = tenant_of(block_id[0])
        largest = store.space.largest_block_bytes(tenant, store.config.limits.max_block_bytes)
        try:
            fetched = await remote.fetch(block_id, largest)
        except CorruptRecord as err:
            self._bad_value(block_id, err)
            return None
        if fetched is None:
            return None
        extent = await store.reserve_dram(tenant, fetched.payload_bytes)
        view = store.arena(tenant).view(extent)
        try:
            fill_s = await remote.fill(fetched, view)
        except BaseException as err:
            store.space.free(block_id, extent)
            if not isinstance(err, CorruptRecord):
                raise
            self._bad_value(block_id, err)
            return None
        finally:
            view.release()
        read_s = fetched.fetch_s + fill_s
        store.costs.observe("remote", fetched.payload_bytes, read_s)
        store.telemetry.transfer("remote", "dram", len(fetched.value), read_s)
        existing = store.residency.get(block_id)
        if existing is not None:  # put here while it was on its way: keep that one
            store.space.free(block_id, extent)
            return existing
        header = fetched.header
        entry = Entry(
            block_id,
            header.payload_bytes,
            header.xxh3_64,
            store.take_generation(),
            dram_extent=extent,
            in_remote=True,
        )
        store.residency.add(entry)
        store.counters.remote_fetches += 1
        return entry

    def _bad_value(self, block_id: BlockId, err: CorruptRecord) -> None:
        store = self._store
        remote = self._remote
        store.counters.checksum_failures += 1
        store.tasks.spawn(remote.discard_bad(block_id, err))

    async def put(self, entry: Entry) -> None:
        """Put a block into the remote tier: pinned while its value is copied out of DRAM
        (what an eviction waits for), then sent from that copy in the background."""
        store = self._store
        remote = self._remote
        if entry.dram_extent is None or entry.in_remote or not store.residency.is_live(entry):
            return
        started_s = time.perf_counter()
        store.residency.pin(entry)
        view = store.arena_of(entry.block_id).view(entry.dram_extent)
        try:
            value = await remote.encode(
                entry.block_id, entry.generation, view[: entry.size_bytes], entry.xxh3_64
            )
        finally:
            view.release()
            store.unpin(entry)
        if value is None:
            return
        store.residency.set_in_remote(entry, True)  # on its way: an eviction need not put it
        store.tasks.spawn(self._send(entry, value, started_s))

    async def _send(self, entry: Entry, value: bytes, started_s: float) -> None:
        store = self._store
        remote = self._remote
        if await remote.send(entry.block_id, value, entry.size_bytes):
            store.counters.remote_puts += 1
            store.telemetry.transfer("dram", "remote", len(value), time.perf_counter() - started_s)
        else:
            store.residency.set_in_remote(entry, False)
