"""Remote tier: blocks in a store the cluster's nodes share (Redis/Valkey or Mooncake
Store), so a node can fetch a prefix another node computed. kvtier is a client of the
store; the store keeps its own capacity (its eviction, its leases).

A value is one record in the NVMe tier's format (kvtier/tiers/record.py) with the header
packed to 8 bytes instead of a page:

    header region (header_bytes) | payload, as is or encoded (header.codec)

and every fetch is verified as a disk read is: header checksum, namespace and key equal to
what was asked for, the payload's length and xxh3 (of the decoded bytes: what is checked
is what is served). A store can return stale, foreign, truncated or damaged bytes; each is
CorruptRecord, which the store turns into a miss. Nobody else's block can be served for
ours: the header names the namespace (tenant included) and key it belongs to.

Object names: `kvtier/v1/<tenant>/<sha256(namespace)[:16]>/<key hex>`. The tenant leads
so a store-side ACL or key-prefix policy can isolate tenants; the namespace is hashed as it
is free text. Unlike NVMe file names they carry no generation: a node fetching a block
another node wrote cannot know the writer's generation, and each store replaces a value
atomically (SET, upsert), so a reader sees the old record or the new one, both verified.

With `remote.auth_key_file`, a value ends with a 32-byte keyed BLAKE2b of everything
before it, and a value without the right one is CorruptRecord: checksums catch damage, the
key catches forgery by anyone who can write to the store but does not hold it.

Backends are blocking and thread-safe: the store calls them from the remote I/O pool. A
backend that cannot reach its store raises ConnectionError (an OSError).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvtier import failpoints
from kvtier.errors import ConfigError, CorruptRecord
from kvtier.keys import tenant_of
from kvtier.tiers import codec
from kvtier.tiers.crypto import load_key_file
from kvtier.tiers.record import (
    RecordHeader,
    encode_header,
    header_size_for,
    parse_header,
    payload_xxh3,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvtier.config import RemoteConfig

logger = logging.getLogger(__name__)

HEADER_ALIGN_BYTES = 8
NAME_PREFIX = "kvtier/v1"
SIGNATURE_BYTES = 32


class RemoteBackend(Protocol):
    """A key-value store for whole values (blocking; called from I/O threads)."""

    name: str

    def put(self, name: str, value: bytes) -> None: ...
    def get(self, name: str) -> bytes | None: ...  # None: no such value
    def exists(self, names: Sequence[str]) -> list[bool]: ...
    def delete(self, name: str) -> None: ...
    def close(self) -> None: ...


def object_name(ns_id: str, key: bytes) -> str:
    ns_digest = hashlib.sha256(ns_id.encode()).hexdigest()[:16]
    return f"{NAME_PREFIX}/{tenant_of(ns_id)}/{ns_digest}/{key.hex()}"


@dataclass(frozen=True, slots=True)
class Fetched:
    """A value whose header was verified; its payload is checked by `RemoteTier.fill`."""

    header: RecordHeader
    value: bytes
    fetch_s: float  # the store's round trip

    @property
    def payload_bytes(self) -> int:
        return self.header.payload_bytes


class RemoteTier:
    """Records in a shared store over `backend`; blocking methods, run on an I/O pool."""

    def __init__(
        self,
        backend: RemoteBackend,
        codec_mode: str = "auto",
        element_bytes: int = 2,
        meter: codec.CodecMeter | None = None,
        signing_key: bytes | None = None,
    ) -> None:
        self.backend = backend
        self.codec_mode = codec_mode
        self.element_bytes = element_bytes
        self.meter = meter or codec.CodecMeter()
        self.signing_key = signing_key

    @classmethod
    def from_config(cls, config: RemoteConfig) -> RemoteTier:
        key = (
            load_key_file(Path(config.auth_key_file), "remote.auth_key_file")
            if config.auth_key_file
            else None
        )
        return cls(connect(config), config.codec, config.codec_element_bytes, signing_key=key)

    def _signature(self, value: bytes | memoryview) -> bytes:
        assert self.signing_key is not None
        return hashlib.blake2b(
            value, key=self.signing_key, digest_size=SIGNATURE_BYTES, person=b"kvtier-remote"
        ).digest()

    @property
    def name(self) -> str:
        return self.backend.name

    def use_codec(self, bandwidth_bytes_per_s: float) -> bool:
        """Whether records written now are encoded (codec = auto: if it makes reads over
        a path of this measured bandwidth faster)."""
        if self.codec_mode == "on":
            return True
        if self.codec_mode == "off":
            return False
        return self.meter.worth_it(bandwidth_bytes_per_s)

    def encode(
        self,
        ns_id: str,
        key: bytes,
        generation: int,
        payload: memoryview,
        xxh3_64: int,
        encoded: bool,
    ) -> bytes:
        """One block's value: its record, payload copied (or encoded) out of `payload`, so
        the caller's buffer is free again before the value goes over the network."""
        body: bytes | memoryview = payload
        code = codec.CODEC_NONE
        if encoded or (self.codec_mode == "auto" and self.meter.due_for_trial()):
            blob, encode_s, decode_s = codec.trial(payload, self.element_bytes)
            self.meter.observe(len(payload), len(blob), encode_s, decode_s)
            if encoded:
                body = blob
                code = codec.CODEC_SHUFFLE_LZ4 | (self.element_bytes << 8)
        header = RecordHeader(
            ns_id=ns_id,
            key=key,
            generation=generation,
            payload_bytes=len(payload),
            xxh3_64=xxh3_64,
            header_bytes=header_size_for(ns_id, key, HEADER_ALIGN_BYTES),
            codec=code,
        )
        head = encode_header(header)
        value = b"".join((memoryview(head)[: header.header_bytes], body))
        return value + self._signature(value) if self.signing_key is not None else value

    def send(self, ns_id: str, key: bytes, value: bytes) -> None:
        """Put a value from `encode` under the block's name (replacing any there)."""
        self.backend.put(object_name(ns_id, key), value)

    def fetch(self, ns_id: str, key: bytes, max_payload_bytes: int) -> Fetched | None:
        """The value stored for this block, its header verified; None if there is none."""
        started_s = time.perf_counter()
        if failpoints.ACTIVE:
            failpoints.fire("remote.get")  # inside the timed read: a slow network is measured
        value = self.backend.get(object_name(ns_id, key))
        fetch_s = time.perf_counter() - started_s
        if value is None:
            return None
        if self.signing_key is not None:
            value, signature = value[:-SIGNATURE_BYTES], value[-SIGNATURE_BYTES:]
            if len(signature) != SIGNATURE_BYTES or not hmac.compare_digest(
                signature, self._signature(value)
            ):
                raise CorruptRecord("remote record is not signed with remote.auth_key_file")
        parsed = parse_header(value, HEADER_ALIGN_BYTES)
        if parsed.seal is not None:
            raise CorruptRecord("remote record is sealed; this tier serves plaintext only")
        header = parsed.header
        if header.ns_id != ns_id or header.key != key:
            raise CorruptRecord("remote record belongs to another block")
        if header.payload_bytes > max_payload_bytes:
            raise CorruptRecord(f"remote record of {header.payload_bytes} bytes is too large")
        body_bytes = len(value) - header.header_bytes
        if header.codec == codec.CODEC_NONE:
            if body_bytes != header.payload_bytes:
                raise CorruptRecord(
                    f"remote record holds {body_bytes} payload bytes, header says "
                    f"{header.payload_bytes}"
                )
        elif header.codec & 0xFF != codec.CODEC_SHUFFLE_LZ4 or not 1 <= header.codec >> 8 <= 8:
            raise CorruptRecord(f"unknown remote record codec {header.codec:#x}")
        return Fetched(header, value, fetch_s)

    def fill(self, fetched: Fetched, dest: memoryview) -> None:
        """Decode `fetched`'s payload into `dest` (at least payload_bytes; the rest is
        zeroed) and verify its checksum; on a mismatch `dest` is zeroed, CorruptRecord."""
        header = fetched.header
        end = header.payload_bytes
        body = memoryview(fetched.value)[header.header_bytes :]
        if header.codec == codec.CODEC_NONE:
            dest[:end] = body
        else:
            started_s = time.perf_counter()
            codec.decode(body, header.codec >> 8, end, dest[:end])
            self.meter.observe_decode(end, time.perf_counter() - started_s)
        if len(dest) > end:
            dest[end:] = bytes(len(dest) - end)
        if payload_xxh3(dest[:end]) != header.xxh3_64:
            dest[:end] = bytes(end)
            raise CorruptRecord("remote record's payload checksum mismatch")

    def exists(self, block_ids: Sequence[tuple[str, bytes]]) -> list[bool]:
        if not block_ids:
            return []
        return self.backend.exists([object_name(ns, key) for ns, key in block_ids])

    def delete(self, ns_id: str, key: bytes) -> None:
        self.backend.delete(object_name(ns_id, key))

    def close(self) -> None:
        self.backend.close()


def connect(config: RemoteConfig) -> RemoteBackend:
    """The backend `config` names (its client library imported now: a missing one is a
    ConfigError that says what to install). Checked here, not field by field: settings
    arrive one environment variable at a time."""
    if config.backend != "none" and not config.url:
        example = "redis://127.0.0.1:6379/0" if config.backend == "redis" else "host:50051"
        raise ConfigError(f"remote.backend = {config.backend} needs remote.url (e.g. {example})")
    if config.backend == "mooncake" and not config.metadata_server:
        raise ConfigError(
            "remote.backend = mooncake needs remote.metadata_server (e.g. http://host:8080/metadata)"
        )
    if config.backend == "redis":
        return RedisBackend(config.url, config.timeout_s, config.io_threads)
    if config.backend == "mooncake":
        return MooncakeBackend(
            config.url,
            config.metadata_server,
            config.local_hostname,
            config.protocol,
            config.buffer_bytes,
            config.segment_bytes,
        )
    raise ConfigError(f"remote.backend {config.backend!r} has no client")


class RedisBackend:
    """Redis or Valkey through redis-py (hiredis parses replies when installed)."""

    name = "redis"

    def __init__(self, url: str, timeout_s: float, connections: int) -> None:
        try:
            import redis
        except ImportError:
            raise ConfigError(
                "remote.backend = redis needs redis-py: pip install 'kvtier[remote]'"
            ) from None
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError,)
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=connections + 2,  # the probes of Plan beside the I/O threads
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )
        self._redis = redis.Redis(connection_pool=pool)

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._errors as err:
            raise ConnectionError(f"redis {what}: {err}") from None

    def put(self, name: str, value: bytes) -> None:
        self._call("SET", self._redis.set, name, value)

    def get(self, name: str) -> bytes | None:
        value = self._call("GET", self._redis.get, name)
        return None if value is None else bytes(value)

    def exists(self, names: Sequence[str]) -> list[bool]:
        def run() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return list(pipe.execute())

        return [bool(n) for n in self._call("EXISTS", run)]

    def delete(self, name: str) -> None:
        self._call("DEL", self._redis.delete, name)

    def close(self) -> None:
        self._redis.close()
        self._redis.connection_pool.disconnect()


class MooncakeBackend:
    """Mooncake Store (mooncake-transfer-engine; its CPU/TCP build runs anywhere)."""

    name = "mooncake"

    def __init__(
        self,
        master: str,
        metadata_server: str,
        local_hostname: str,
        protocol: str,
        buffer_bytes: int,
        segment_bytes: int,
    ) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError:
            raise ConfigError(
                "remote.backend = mooncake needs Mooncake Store: pip install 'kvtier[mooncake]' "
                "(mooncake-transfer-engine-non-cuda; the CUDA build on GPU nodes)"
            ) from None
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            local_hostname, metadata_server, segment_bytes, buffer_bytes, protocol, "", master
        )
        if rc != 0:
            raise ConfigError(
                f"could not join the Mooncake store (master {master}, metadata "
                f"{metadata_server}): setup returned {rc}; check remote.url and "
                "remote.metadata_server, and MC_TCP_BIND_ADDRESS on a host without a LAN address"
            )

    def put(self, name: str, value: bytes) -> None:
        rc = self._store.upsert(name, value)
        if rc != 0:
            raise ConnectionError(f"mooncake upsert returned {rc}")

    def get(self, name: str) -> bytes | None:
        value = self._store.get(name)
        return bytes(value) if value else None

    def exists(self, names: Sequence[str]) -> list[bool]:
        codes = self._store.batch_is_exist(list(names))
        if any(c < 0 for c in codes):
            raise ConnectionError("mooncake batch_is_exist failed")
        return [c == 1 for c in codes]

    def delete(self, name: str) -> None:
        # force: a value another node is reading holds a lease (500 ms here, 10 s by
        # default) that would otherwise refuse the removal; that reader gets a miss.
        self._store.remove(name, True)

    def close(self) -> None:
        self._store.close()
