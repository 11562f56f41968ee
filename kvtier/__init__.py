"""kvtier: a per-node KV-cache tiering daemon and its clients.

`import kvtier` is cheap: no torch, no cupy, no CUDA.
"""

from __future__ import annotations

__version__ = "0.1.0"

from kvtier.client import (
    AsyncClient,
    BlockEvent,
    BlockStat,
    Client,
    CudaGetGroups,
    EventBatch,
    PlanResult,
    Snapshot,
    Stats,
    TierStats,
)
from kvtier.errors import (
    AlreadyExists,
    ConfigError,
    CorruptRecord,
    DataLoss,
    InvalidArgument,
    KVTierError,
    NotFound,
    PermissionDenied,
    RateLimited,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from kvtier.keys import chain_keys
from kvtier.types import BlockPlan, LookupResult, PrefillCost

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "BlockEvent",
    "BlockPlan",
    "BlockStat",
    "Client",
    "ConfigError",
    "CorruptRecord",
    "CudaGetGroups",
    "DataLoss",
    "EventBatch",
    "InvalidArgument",
    "KVTierError",
    "LookupResult",
    "NotFound",
    "PermissionDenied",
    "PlanResult",
    "PrefillCost",
    "RateLimited",
    "ResourceExhausted",
    "Snapshot",
    "Stats",
    "TierStats",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "__version__",
    "chain_keys",
]
