"""What the store's flow modules (zerocopy.py, shared.py) need of the store: its units
and the few flows they build on. A Protocol rather than the `Store` class itself, so the
flow modules do not import the module that imports them."""

from __future__ import annotations

from typing import Protocol

from kvtier.config import Config
from kvtier.engine.blocks import PutWriter
from kvtier.engine.costs import CostModel
from kvtier.engine.dram import DramSpace
from kvtier.engine.remote import RemoteLink
from kvtier.engine.residency import Residency
from kvtier.engine.results import Counters, PutResult
from kvtier.engine.tasks import Tasks
from kvtier.engine.telemetry import Telemetry
from kvtier.index.catalog import Entry
from kvtier.tiers.dram import DramTier
from kvtier.types import BlockId, Extent


class StoreCore(Protocol):
    config: Config
    space: DramSpace
    costs: CostModel
    residency: Residency
    counters: Counters
    tasks: Tasks
    telemetry: Telemetry
    remote: RemoteLink | None

    def arena(self, tenant: str) -> DramTier: ...

    def arena_of(self, block_id: BlockId) -> DramTier: ...

    async def reserve_dram(self, tenant: str, size_bytes: int, put: bool = False) -> Extent: ...

    def take_generation(self) -> int: ...

    def unpin(self, entry: Entry) -> None: ...

    async def put_begin(self, block_id: BlockId, size_bytes: int, overwrite: bool) -> PutWriter: ...

    async def put_commit(
        self, writer: PutWriter, client_xxh3_64: int, defer: bool = False
    ) -> PutResult: ...

    def put_abort(self, writer: PutWriter) -> None: ...

    async def promote(self, entry: Entry) -> bool: ...

    async def fetch_remote(self, block_id: BlockId) -> Entry | None: ...
