"""Blocking client: `kvtier.Client(target)`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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


class Client:
    """A connection to one kvtier daemon. Missing blocks are None, errors are KVTierError.

    `target`: unix:///path/to.sock, host:port, or None for the default socket.
    """

    def __init__(self, target: str | None = None, timeout_s: float | None = 60.0) -> None:
        self.target = normalize_target(target)
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        calls = make_calls(self._channel)
        self._stub, self._put, self._get = calls.stub, calls.put, calls.get

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def put(self, namespace: str, key: bytes | str, data: Buffer, overwrite: bool = False) -> bool:
        """Store `data`; True if stored now, False if these exact bytes were already there."""
        try:
            resp = self._put(
                put_messages(namespace, as_key(key), data, overwrite), timeout=self.timeout_s
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return not resp.already_present

    def get(self, namespace: str, key: bytes | str) -> bytes | None:
        """The block's bytes, exactly as put, or None when it is not cached."""
        out = GetAssembler()
        try:
            for msg in self._get(
                pb.GetRequest(namespace=namespace, key=as_key(key)), timeout=self.timeout_s
            ):
                out.feed(msg)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise translate(err) from None
        return out.result()

    def lookup(self, namespace: str, keys: Sequence[bytes | str]) -> LookupResult:
        """How many leading keys of the chain are cached, and the tier of each key."""
        try:
            resp = self._stub.Lookup(
                pb.LookupRequest(namespace=namespace, keys=[as_key(k) for k in keys]),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return LookupResult(resp.prefix_blocks, [PB_TO_TIER[t] for t in resp.tiers])

    def stat(self, namespace: str, key: bytes | str) -> BlockStat | None:
        try:
            resp = self._stub.Stat(
                pb.StatRequest(namespace=namespace, key=as_key(key)), timeout=self.timeout_s
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise translate(err) from None
        return block_stat(resp.info)

    def list(self, namespace: str = "", limit: int = 0) -> Iterator[BlockStat]:
        try:
            for entry in self._stub.List(
                pb.ListRequest(namespace=namespace, limit=limit), timeout=self.timeout_s
            ):
                yield block_stat(entry.info)
        except grpc.RpcError as err:
            raise translate(err) from None

    def delete(self, namespace: str, key: bytes | str) -> bool:
        """True if a block was removed, False if there was none."""
        try:
            resp = self._stub.Delete(
                pb.DeleteRequest(namespace=namespace, key=as_key(key)), timeout=self.timeout_s
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return bool(resp.deleted)

    def stats(self) -> dict[str, Any]:
        """Counters and, under "tiers", each tier's used_bytes and capacity_bytes."""
        try:
            resp = self._stub.Stats(pb.StatsRequest(), timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise translate(err) from None
        return stats_dict(resp)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the daemon accepts calls (or raise Unavailable after `timeout_s`)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            from kvtier.errors import Unavailable

            raise Unavailable(f"no kvtier daemon answered on {self.target}") from None
