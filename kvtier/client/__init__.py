"""Python clients: `Client` (blocking) and `AsyncClient` (asyncio)."""

from kvtier.client.aio import AsyncClient
from kvtier.client.sync import Client

__all__ = ["AsyncClient", "Client"]
