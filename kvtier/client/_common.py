"""What the blocking and asyncio clients share: targets, message building, result shapes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import xxhash

from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier._wire import (
    GET_METHOD,
    PUT_METHOD,
    RawChunk,
    get_response_deserializer,
    put_request_serializer,
)
from kvtier.config import ENV_TOKEN, default_target
from kvtier.errors import DataLoss, KVTierError, from_grpc_code
from kvtier.index.planner import BlockPlan

CHUNK_BYTES = 1 << 20
MESSAGE_LIMIT_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_LIMIT_BYTES),
    ("grpc.max_send_message_length", MESSAGE_LIMIT_BYTES),
]
PB_TO_TIER: dict[int, str | None] = {
    pb.TIER_UNSPECIFIED: None,
    pb.TIER_HBM: "hbm",
    pb.TIER_DRAM: "dram",
    pb.TIER_NVME: "nvme",
}
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Calls:
    """The callables of one channel (blocking or asyncio: their construction is the same)."""

    stub: Any  # KVTierStub or its asyncio twin, by channel type
    put: Any
    get: Any


def make_calls(channel: Any) -> Calls:
    """Stubs for `channel`, with the copy-saving chunk codecs on Put and Get."""
    return Calls(
        stub=pb_grpc.KVTierStub(channel),
        put=channel.stream_unary(
            PUT_METHOD,
            request_serializer=put_request_serializer,
            response_deserializer=pb.PutResponse.FromString,
        ),
        get=channel.unary_stream(
            GET_METHOD,
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=get_response_deserializer,
        ),
    )


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying the bearer token (`token`, else $KVTIER_TOKEN), if any."""
    token = token or os.environ.get(ENV_TOKEN)
    return (("authorization", f"Bearer {token}"),) if token else None


def normalize_target(target: str | None) -> str:
    """gRPC target for `target`: unix:///path, host:port, or a bare socket path."""
    target = target or default_target()
    if target.startswith("/") or (os.sep in target and ":" not in target):
        return f"unix://{os.path.abspath(target)}"
    return target


@dataclass(frozen=True, slots=True)
class BlockStat:
    """Metadata of one stored block."""

    namespace: str
    key: bytes
    size_bytes: int
    xxh3_64: int
    tiers: list[str]
    generation: int


@dataclass(frozen=True, slots=True)
class PlanResult:
    """The daemon's fetch-or-recompute decision for a chain (see kvtier.index.planner):
    blocks [0, engine_blocks) are held by the engine, [fetch_start, fetch_end) fetched,
    the others recomputed."""

    total_s: float
    recompute_all_s: float
    fetch_all_s: float
    engine_blocks: int
    fetch_start: int
    fetch_end: int
    reason: str
    tiers: list[str | None]
    fetch_s: list[float]
    recompute_s: list[float]

    @property
    def fetch_blocks(self) -> int:
        return self.fetch_end - self.fetch_start

    @property
    def blocks(self) -> list[BlockPlan]:
        return [
            BlockPlan(
                index=i,
                action="engine"
                if i < self.engine_blocks
                else "fetch"
                if self.fetch_start <= i < self.fetch_end
                else "recompute",
                tier=tier,
                fetch_s=self.fetch_s[i] if tier else None,
                recompute_s=self.recompute_s[i],
            )
            for i, tier in enumerate(self.tiers)
        ]


def plan_request(
    namespace: str,
    keys: list[bytes],
    tokens_per_block: int,
    engine_cached_blocks: int,
    overlap: str,
    prompt_tokens: int | None,
    kv_bytes_per_token: int | None,
) -> pb.PlanRequest:
    return pb.PlanRequest(
        namespace=namespace,
        keys=keys,
        tokens_per_block=tokens_per_block,
        prompt_tokens=prompt_tokens or 0,
        engine_cached_blocks=engine_cached_blocks,
        overlap=overlap,
        kv_bytes_per_token=kv_bytes_per_token or 0,
    )


def plan_result(resp: pb.PlanResponse) -> PlanResult:
    return PlanResult(
        total_s=resp.total_s,
        recompute_all_s=resp.recompute_all_s,
        fetch_all_s=resp.fetch_all_s,
        engine_blocks=resp.engine_blocks,
        fetch_start=resp.fetch_start,
        fetch_end=resp.fetch_end,
        reason=resp.reason,
        tiers=[PB_TO_TIER[t] for t in resp.tiers],
        fetch_s=list(resp.fetch_s),
        recompute_s=list(resp.recompute_s),
    )


def block_stat(info: pb.BlockInfo) -> BlockStat:
    return BlockStat(
        namespace=info.namespace,
        key=info.key,
        size_bytes=info.size_bytes,
        xxh3_64=info.xxh3_64,
        tiers=[t for t in (PB_TO_TIER[x] for x in info.tiers) if t],
        generation=info.generation,
    )


def put_messages(
    namespace: str, key: bytes, data: Buffer, overwrite: bool, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.PutRequest | RawChunk]:
    view = memoryview(data).cast("B")
    yield pb.PutRequest(
        header=pb.PutHeader(
            namespace=namespace,
            key=key,
            size_bytes=view.nbytes,
            xxh3_64=xxhash.xxh3_64_intdigest(view),
            overwrite=overwrite,
        )
    )
    for start in range(0, view.nbytes, chunk_bytes):
        yield RawChunk(view[start : start + chunk_bytes])


class GetAssembler:
    """Collects a Get stream into one buffer and checks it against the header's checksum."""

    def __init__(self) -> None:
        self._header: pb.GetHeader | None = None
        self._chunks: list[Buffer] = []
        self._received = 0
        self.tier: str | None = None

    def feed(self, msg: pb.GetResponse | RawChunk) -> None:
        if isinstance(msg, RawChunk):
            data: Buffer = msg.data
        elif msg.WhichOneof("msg") == "header":
            self._header = msg.header
            self.tier = PB_TO_TIER[msg.header.tier]
            return
        else:
            data = msg.chunk
        if self._header is None:
            raise KVTierError("protocol error: data before header in a Get stream")
        self._received += len(data)
        if self._received > self._header.size_bytes:
            raise DataLoss("the daemon sent more bytes than the block holds")
        self._chunks.append(data)

    def result(self) -> bytes:
        if self._header is None:
            raise KVTierError("protocol error: empty Get stream")
        data = b"".join(self._chunks)
        if len(data) != self._header.size_bytes or (
            xxhash.xxh3_64_intdigest(data) != self._header.xxh3_64
        ):
            raise DataLoss("block bytes did not arrive intact; retry the get")
        return data


def stats_dict(resp: pb.StatsResponse) -> dict[str, Any]:
    return {
        "version": resp.version,
        "uptime_s": resp.uptime_s,
        "hits": resp.hits,
        "misses": resp.misses,
        "puts": resp.puts,
        "demotions": resp.demotions,
        "checksum_failures": resp.checksum_failures,
        "dropped_blocks": resp.dropped_blocks,
        "nvme_direct_io": resp.nvme_direct_io,
        "leases": resp.leases,
        "promotions": resp.promotions,
        "recompute_avoided_s": resp.recompute_avoided_s,
        "fetch_regret_s": resp.fetch_regret_s,
        "planned_fetch_blocks": resp.planned_fetch_blocks,
        "planned_recompute_blocks": resp.planned_recompute_blocks,
        "lost_reuse": resp.lost_reuse,
        "nvme_admitted": resp.nvme_admitted,
        "nvme_not_admitted": resp.nvme_not_admitted,
        "policy": resp.policy,
        "tiers": {
            t.name: {
                "used_bytes": t.used_bytes,
                "capacity_bytes": t.capacity_bytes,
                "blocks": t.blocks,
                "hits": t.hits,
                "evictions": t.evictions,
            }
            for t in resp.tiers
        },
    }


def translate(err: grpc.RpcError) -> KVTierError:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return from_grpc_code(code, details or "")


def as_key(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)
