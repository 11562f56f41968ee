"""asyncio client: `kvtier.AsyncClient(target)`, the same calls as `Client`, awaited."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

import grpc

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client._common import (
    CHANNEL_OPTIONS,
    PB_TO_TIER,
    BlockStat,
    Buffer,
    GetAssembler,
    as_key,
    block_stat,
    make_calls,
    normalize_target,
    put_messages,
    stats_dict,
    translate,
)
from kvtier.index.catalog import LookupResult


class AsyncClient:
    """A connection to one kvtier daemon for asyncio code; use `async with` or `await close()`."""

    def __init__(self, target: str | None = None, timeout_s: float | None = 60.0) -> None:
        self.target = normalize_target(target)
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        calls = make_calls(self._channel)
        self._stub, self._put, self._get = calls.stub, calls.put, calls.get

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def put(
        self, namespace: str, key: bytes | str, data: Buffer, overwrite: bool = False
    ) -> bool:
        try:
            resp = await self._put(
                put_messages(namespace, as_key(key), data, overwrite), timeout=self.timeout_s
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return not resp.already_present

    async def get(self, namespace: str, key: bytes | str) -> bytes | None:
        out = GetAssembler()
        try:
            async for msg in self._get(
                pb.GetRequest(namespace=namespace, key=as_key(key)), timeout=self.timeout_s
            ):
                out.feed(msg)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise translate(err) from None
        return out.result()

    async def lookup(self, namespace: str, keys: Sequence[bytes | str]) -> LookupResult:
        try:
            resp = await self._stub.Lookup(
                pb.LookupRequest(namespace=namespace, keys=[as_key(k) for k in keys]),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return LookupResult(resp.prefix_blocks, [PB_TO_TIER[t] for t in resp.tiers])

    async def stat(self, namespace: str, key: bytes | str) -> BlockStat | None:
        try:
            resp = await self._stub.Stat(
                pb.StatRequest(namespace=namespace, key=as_key(key)), timeout=self.timeout_s
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise translate(err) from None
        return block_stat(resp.info)

    async def list(self, namespace: str = "", limit: int = 0) -> AsyncIterator[BlockStat]:
        try:
            async for entry in self._stub.List(
                pb.ListRequest(namespace=namespace, limit=limit), timeout=self.timeout_s
            ):
                yield block_stat(entry.info)
        except grpc.RpcError as err:
            raise translate(err) from None

    async def delete(self, namespace: str, key: bytes | str) -> bool:
        try:
            resp = await self._stub.Delete(
                pb.DeleteRequest(namespace=namespace, key=as_key(key)), timeout=self.timeout_s
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return bool(resp.deleted)

    async def stats(self) -> dict[str, Any]:
        try:
            resp = await self._stub.Stats(pb.StatsRequest(), timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise translate(err) from None
        return stats_dict(resp)
