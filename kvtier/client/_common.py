"""What the blocking and asyncio clients share: targets, message building, result shapes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
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
from kvtier.env import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TOKEN, default_target
from kvtier.errors import DataLoss, InvalidArgument, KVTierError, RateLimited, from_grpc_code
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
    pb.TIER_REMOTE: "remote",
}
Buffer = bytes | bytearray | memoryview
# PEM bytes, PEM text, or the path of a PEM file.
PemSource = bytes | str | os.PathLike[str]


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


@dataclass(frozen=True, slots=True)
class ChannelSecurity:
    """How to open the channel: plain (credentials None) or TLS, plus extra channel options."""

    credentials: grpc.ChannelCredentials | None
    options: list[tuple[str, Any]]


def _pem(source: PemSource | None, what: str) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    if isinstance(source, str) and source.lstrip().startswith("-----BEGIN"):
        return source.encode()
    try:
        return Path(source).read_bytes()
    except OSError as err:
        raise InvalidArgument(f"{what}: cannot read {source}: {err.strerror or err}") from None


def channel_security(
    target: str,
    tls: bool | None,
    tls_ca: PemSource | None,
    tls_cert: PemSource | None,
    tls_key: PemSource | None,
    tls_server_name: str | None,
) -> ChannelSecurity:
    """TLS for a host:port `target`. `tls` None: TLS when any tls_* option is given or
    $KVTIER_TLS_CA / $KVTIER_TLS_CERT / $KVTIER_TLS_KEY is set; True: TLS (the system's
    roots unless `tls_ca`); False: plain. A UNIX socket is never TLS (its permissions are
    the access control), so options for one are an error."""
    explicit = any(v is not None for v in (tls_ca, tls_cert, tls_key, tls_server_name))
    if target.startswith("unix:"):
        if tls or explicit:
            raise InvalidArgument(
                "TLS options apply to host:port targets; a UNIX socket is not encrypted "
                "(its file permissions are the access control)"
            )
        return ChannelSecurity(None, [])
    if tls is False:
        return ChannelSecurity(None, [])
    tls_ca = tls_ca if tls_ca is not None else os.environ.get(ENV_TLS_CA) or None
    tls_cert = tls_cert if tls_cert is not None else os.environ.get(ENV_TLS_CERT) or None
    tls_key = tls_key if tls_key is not None else os.environ.get(ENV_TLS_KEY) or None
    if not tls and not explicit and not (tls_ca or tls_cert or tls_key):
        return ChannelSecurity(None, [])
    if (tls_cert is None) != (tls_key is None):
        raise InvalidArgument("pass tls_cert and tls_key together (the client certificate)")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_pem(tls_ca, "tls_ca"),
        private_key=_pem(tls_key, "tls_key"),
        certificate_chain=_pem(tls_cert, "tls_cert"),
    )
    options: list[tuple[str, Any]] = []
    if tls_server_name:
        options = [
            ("grpc.ssl_target_name_override", tls_server_name),
            ("grpc.default_authority", tls_server_name),
        ]
    return ChannelSecurity(credentials, options)


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
class Snapshot:
    """A node's blocks (of one namespace, or all of the tenant's) as of event `seq`."""

    epoch: str
    seq: int
    blocks: list[BlockStat]


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """A block's new set of tiers, fastest first (empty: it is gone from the node)."""

    seq: int
    namespace: str
    key: bytes
    tiers: list[str]


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events from WatchEvents. `resync`: those asked for are gone; take a snapshot."""

    epoch: str
    events: list[BlockEvent]
    resync: bool = False


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


def snapshot_of(responses: list[pb.SnapshotResponse]) -> Snapshot:
    """One Snapshot from its streamed batches (each carries the same epoch and seq)."""
    last = responses[-1] if responses else pb.SnapshotResponse()
    return Snapshot(
        last.epoch, last.seq, [block_stat(info) for resp in responses for info in resp.blocks]
    )


def event_batch(resp: pb.WatchEventsResponse) -> EventBatch:
    return EventBatch(
        epoch=resp.epoch,
        events=[
            BlockEvent(
                seq=e.seq,
                namespace=e.namespace,
                key=e.key,
                tiers=[t for t in (PB_TO_TIER[x] for x in e.tiers) if t],
            )
            for e in resp.events
        ],
        resync=resp.resync,
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
        "remote_puts": resp.remote_puts,
        "remote_fetches": resp.remote_fetches,
        "tiers": {
            t.name: {
                "used_bytes": t.used_bytes,
                "capacity_bytes": t.capacity_bytes,
                "blocks": t.blocks,
                "hits": t.hits,
                "evictions": t.evictions,
                "online": t.online,
                "io_errors": t.io_errors,
            }
            for t in resp.tiers
        },
    }


def translate(err: grpc.RpcError) -> KVTierError:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and hasattr(err, "trailing_metadata"):
        # (key, value) pairs on both channel kinds; the stubs type them differently.
        trailing: Any = err.trailing_metadata()
        for name, value in trailing or ():
            if name == "retry-after-ms" and str(value).isdigit():
                return RateLimited(details or "", int(value) / 1000)
    return from_grpc_code(code, details or "")


def as_key(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)
