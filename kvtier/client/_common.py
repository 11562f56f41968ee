"""The connection both clients open and the wire helpers under their calls: targets, TLS,
the bearer token, the chunk codecs of Put and Get, and gRPC status -> KVTierError."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import grpc
import xxhash

from kvtier._malloc import raise_thresholds
from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier._wire import (
    GET_BLOCK_METHOD,
    GET_METHOD,
    INLINE_MAX_BYTES,
    PUT_BLOCK_METHOD,
    PUT_METHOD,
    InlineBlock,
    InlinePut,
    RawChunk,
    get_block_response_deserializer,
    get_response_deserializer,
    put_block_request_serializer,
    put_request_serializer,
)
from kvtier.env import (
    ENV_TARGET,
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    ENV_TOKEN,
    default_target,
)
from kvtier.errors import (
    RETRY_AFTER_METADATA,
    DataLoss,
    InvalidArgument,
    KVTierError,
    RateLimited,
    Unavailable,
    from_grpc_code,
)
from kvtier.types import TierName

CHUNK_BYTES = 1 << 20
MESSAGE_LIMIT_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_LIMIT_BYTES),
    ("grpc.max_send_message_length", MESSAGE_LIMIT_BYTES),
]
PB_TO_TIER: dict[int, TierName | None] = {
    pb.TIER_UNSPECIFIED: None,
    pb.TIER_HBM: TierName.HBM,
    pb.TIER_DRAM: TierName.DRAM,
    pb.TIER_NVME: TierName.NVME,
    pb.TIER_REMOTE: TierName.REMOTE,
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
    put_block: Any
    get_block: Any


def make_calls(channel: Any) -> Calls:
    """Stubs for `channel`, with the copy-saving codecs on Put, Get, PutBlock and GetBlock."""
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
        put_block=channel.unary_unary(
            PUT_BLOCK_METHOD,
            request_serializer=put_block_request_serializer,
            response_deserializer=pb.PutResponse.FromString,
        ),
        get_block=channel.unary_unary(
            GET_BLOCK_METHOD,
            request_serializer=pb.GetBlockRequest.SerializeToString,
            response_deserializer=get_block_response_deserializer,
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


def plan_request(
    namespace: str,
    keys: list[bytes],
    tokens_per_block: int,
    engine_cached_blocks: int,
    overlap: str,
    prompt_tokens: int | None,
    kv_bytes_per_token: int | None,
    family: str = "any",
) -> pb.PlanRequest:
    return pb.PlanRequest(
        namespace=namespace,
        keys=keys,
        tokens_per_block=tokens_per_block,
        prompt_tokens=prompt_tokens or 0,
        engine_cached_blocks=engine_cached_blocks,
        overlap=overlap,
        kv_bytes_per_token=kv_bytes_per_token or 0,
        family=family,
    )


# A client process's allocator, tuned once, on its first byte-path call (kvtier._malloc):
# the thresholds the daemon uses for its own message buffers, with a smaller trim
# threshold, since this is someone else's process.
CLIENT_MMAP_THRESHOLD_BYTES = 32 << 20
CLIENT_TRIM_THRESHOLD_BYTES = 128 << 20
_malloc_tuned = False


def tune_malloc_once() -> None:
    global _malloc_tuned
    if not _malloc_tuned:
        _malloc_tuned = True
        raise_thresholds(CLIENT_MMAP_THRESHOLD_BYTES, CLIENT_TRIM_THRESHOLD_BYTES)


def put_header(namespace: str, key: bytes, view: memoryview, overwrite: bool) -> pb.PutHeader:
    return pb.PutHeader(
        namespace=namespace,
        key=key,
        size_bytes=view.nbytes,
        xxh3_64=xxhash.xxh3_64_intdigest(view),
        overwrite=overwrite,
    )


def put_block(namespace: str, key: bytes, data: Buffer, overwrite: bool) -> InlinePut | None:
    """The PutBlock request for `data`, or None when it is too large for one message."""
    view = memoryview(data).cast("B")
    if view.nbytes > INLINE_MAX_BYTES:
        return None
    return InlinePut(put_header(namespace, key, view, overwrite), view)


def get_block_request(namespace: str, key: bytes) -> pb.GetBlockRequest:
    return pb.GetBlockRequest(namespace=namespace, key=key, max_inline_bytes=INLINE_MAX_BYTES)


def inline_bytes(reply: InlineBlock) -> bytes:
    """The block's bytes from a GetBlock answer (not `use_stream`), checked."""
    data = bytes(reply.data)
    if len(data) != reply.header.size_bytes or (
        xxhash.xxh3_64_intdigest(data) != reply.header.xxh3_64
    ):
        raise DataLoss("block bytes did not arrive intact; retry the get")
    return data


def put_messages(
    namespace: str, key: bytes, data: Buffer, overwrite: bool, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.PutRequest | RawChunk]:
    view = memoryview(data).cast("B")
    yield pb.PutRequest(header=put_header(namespace, key, view, overwrite))
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


# grpc's words when the channel reached no listener: "failed to connect to all addresses;
# last error: FAILED_PRECONDITION: unix:/run/x.sock: connect failed: ... No such file".
_NO_LISTENER = re.compile(
    r"failed to connect to all addresses(?:; last error: [A-Z_]+: (?P<address>\S+?):"
    r" (?P<why>.*))?",
    re.DOTALL,
)


def _no_daemon(details: str) -> str | None:
    """A newcomer's message for a connect failure (what is missing and how to start it),
    or None when `details` is some other UNAVAILABLE (a draining daemon, a tier offline)."""
    found = _NO_LISTENER.search(details)
    if found is None:
        return None
    address = found["address"] or "the target"
    # Spelt as a --target is (grpc writes unix:/path and ipv4:host:port).
    if address.startswith("unix:") and not address.startswith("unix://"):
        address = "unix://" + address.removeprefix("unix:")
    address = unquote(address.removeprefix("ipv4:").removeprefix("ipv6:"))
    why = (found["why"] or "").strip()
    because = f" ({why.rsplit('error: ', 1)[-1]})" if why else ""
    return (
        f"no kvtier daemon at {address}{because}: start one with `kvtier serve` (`make "
        f"serve` in a checkout), or point the client at a running one (--target ADDR, "
        f"${ENV_TARGET}, Client(target))"
    )


def translate(err: grpc.RpcError) -> KVTierError:
    """The KVTierError for a failed gRPC call (both clients' only mapping of a gRPC status;
    the session socket's numeric statuses go through `errors.from_status_value`)."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.UNAVAILABLE and (no_daemon := _no_daemon(details or "")):
        return Unavailable(no_daemon)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and hasattr(err, "trailing_metadata"):
        # (key, value) pairs on both channel kinds; the stubs type them differently.
        trailing: Any = err.trailing_metadata()
        for name, value in trailing or ():
            if name == RETRY_AFTER_METADATA and str(value).isdigit():
                return RateLimited(details or "", int(value) / 1000)
    return from_grpc_code(code, details or "")


def as_key(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def as_keys(keys: Sequence[bytes | str]) -> list[bytes]:
    """`as_key` of each; a chain of bytes keys (the usual case: hashes) is passed as is."""
    if all(type(k) is bytes for k in keys):
        return list(keys)  # type: ignore[arg-type]
    return [as_key(k) for k in keys]
