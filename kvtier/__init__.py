"""kvtier: a per-node KV-cache tiering daemon and its clients.

`import kvtier` is cheap: no torch, no cupy, no CUDA.
"""

from __future__ import annotations

__version__ = "0.1.0"

from kvtier.client import AsyncClient, Client
from kvtier.errors import (
    AlreadyExists,
    DataLoss,
    InvalidArgument,
    KVTierError,
    NotFound,
    RateLimited,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from kvtier.index.catalog import LookupResult
from kvtier.keys import chain_keys

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "Client",
    "DataLoss",
    "InvalidArgument",
    "KVTierError",
    "LookupResult",
    "NotFound",
    "RateLimited",
    "ResourceExhausted",
    "Unavailable",
    "Unimplemented",
    "__version__",
    "chain_keys",
]
