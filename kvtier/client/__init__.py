"""Python clients: `Client` (blocking) and `AsyncClient` (asyncio), and what their calls
return. Both are one implementation (kvtier/client/_core.py) on two transports."""

from kvtier.client._results import (
    BlockEvent,
    BlockStat,
    EventBatch,
    PlanResult,
    PrefetchResult,
    Snapshot,
    Stats,
    TierStats,
)
from kvtier.client.aio import AsyncClient
from kvtier.client.cuda import CudaGetGroups
from kvtier.client.sync import Client

__all__ = [
    "AsyncClient",
    "BlockEvent",
    "BlockStat",
    "Client",
    "CudaGetGroups",
    "EventBatch",
    "PlanResult",
    "PrefetchResult",
    "Snapshot",
    "Stats",
    "TierStats",
]
