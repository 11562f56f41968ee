"""PutBlock / GetBlock, the byte path's one-message form, against a real daemon: blocks at
every chunk and message boundary come back exact over both transports and both clients,
a damaged block is a miss, and bad requests get their status with nothing stored."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
import xxhash

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier._wire import DEFAULT_INLINE_BYTES, INLINE_MAX_BYTES
from tests.conftest import DaemonProcess, block_bytes
from tests.integration.test_restart import _flip_byte, record_of

NS = "llama3-8b/blocks"
StartDaemon = Callable[..., DaemonProcess]
CHUNK = 1 << 20  # server.chunk_bytes's default: the Get stream's chunk
SIZES = [
    0,
    1,
    CHUNK - 1,
    CHUNK,
    CHUNK + 1,
    4 << 20,
    INLINE_MAX_BYTES - 1,
    INLINE_MAX_BYTES,  # the largest block in one message
    INLINE_MAX_BYTES + 1,  # the smallest streamed
    16 << 20,
]


def _daemon(start_daemon: StartDaemon, transport: str) -> DaemonProcess:
    if transport == "uds":
        return start_daemon(dram="256MiB", nvme="512MiB")
    env = {"KVTIER_SERVER__TLS_INSECURE": "true"}  # the byte path, not TLS
    return start_daemon(dram="256MiB", nvme="512MiB", listen="127.0.0.1:0", env=env)


def _stub(daemon: DaemonProcess) -> tuple[grpc.Channel, pb_grpc.KVTierStub]:
    """Plain generated protobuf code, as a client in another language would send."""
    limit = [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),
    ]
    channel = grpc.insecure_channel(daemon.target, options=limit)
    return channel, pb_grpc.KVTierStub(channel)


@pytest.mark.parametrize("transport", ["uds", "tcp"])
def test_blocks_at_every_boundary_come_back_exact(
    start_daemon: StartDaemon, transport: str
) -> None:
    daemon = _daemon(start_daemon, transport)
    channel, stub = _stub(daemon)
    with daemon.client() as client, channel:
        for i, size in enumerate(SIZES):
            data = block_bytes(i, size)
            assert client.put(NS, f"b{size}", data) is True
            assert client.put(NS, f"b{size}", data) is False  # the same bytes: already there
            assert client.get(NS, f"b{size}") == data, f"{size} bytes"
            # What went over the wire: one message up to the limit, the stream past it.
            request = pb.GetBlockRequest(
                namespace=NS, key=f"b{size}".encode(), max_inline_bytes=INLINE_MAX_BYTES
            )
            reply = stub.GetBlock(request)
            assert reply.header.size_bytes == size
            assert reply.header.xxh3_64 == xxhash.xxh3_64_intdigest(data)
            assert reply.use_stream is (size > INLINE_MAX_BYTES)
            assert reply.data == (b"" if reply.use_stream else data)
            streamed = list(stub.Get(pb.GetRequest(namespace=NS, key=f"b{size}".encode())))
            assert b"".join(m.chunk for m in streamed[1:]) == data
        assert client.get(NS, b"absent") is None
        assert client.stats()["checksum_failures"] == 0


async def test_the_async_client_puts_and_gets_at_the_boundaries(
    start_daemon: StartDaemon,
) -> None:
    daemon = _daemon(start_daemon, "tcp")
    async with kvtier.AsyncClient(daemon.target) as client:
        for i, size in enumerate([0, 1, CHUNK + 1, INLINE_MAX_BYTES, INLINE_MAX_BYTES + 1]):
            data = block_bytes(100 + i, size)
            assert await client.put(NS, f"a{size}", data) is True
            assert await client.get(NS, f"a{size}") == data, f"{size} bytes"
        assert await client.get(NS, b"absent") is None


def test_get_block_inlines_only_what_the_caller_accepts(start_daemon: StartDaemon) -> None:
    daemon = _daemon(start_daemon, "uds")
    small, large = block_bytes(1, DEFAULT_INLINE_BYTES), block_bytes(2, DEFAULT_INLINE_BYTES + 1)
    channel, stub = _stub(daemon)
    with daemon.client() as client, channel:
        client.put(NS, b"small", small)
        client.put(NS, b"large", large)
        # 0: gRPC's default 4 MiB message limit, less room for the header.
        assert stub.GetBlock(pb.GetBlockRequest(namespace=NS, key=b"small")).data == small
        reply = stub.GetBlock(pb.GetBlockRequest(namespace=NS, key=b"large"))
        assert reply.use_stream and reply.data == b"" and reply.header.size_bytes == len(large)
        # A default-limit channel (4 MiB) takes that answer: nothing above its limit is sent.
        with grpc.insecure_channel(daemon.target) as plain:
            reply = pb_grpc.KVTierStub(plain).GetBlock(
                pb.GetBlockRequest(namespace=NS, key=b"small")
            )
            assert reply.data == small
        # Asking for more than the daemon carries in one message gets its cap.
        huge = block_bytes(3, INLINE_MAX_BYTES + 1)
        client.put(NS, b"huge", huge)
        request = pb.GetBlockRequest(namespace=NS, key=b"huge", max_inline_bytes=1 << 40)
        assert stub.GetBlock(request).use_stream
        request = pb.GetBlockRequest(namespace=NS, key=b"small", max_inline_bytes=1024)
        assert stub.GetBlock(request).use_stream


def test_a_damaged_record_read_by_get_block_is_a_miss(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="8MiB", nvme="256MiB")
    blocks = {f"r{i}".encode(): block_bytes(i, 1 << 20) for i in range(16)}
    channel, stub = _stub(daemon)
    with daemon.client() as client, channel:
        for key, data in blocks.items():
            client.put(NS, key, data)
        assert client.lookup(NS, [b"r0"]).tiers == ["nvme"]  # spilled: read from its record
        _flip_byte(record_of(daemon.nvme_path, b"r0"), 4096 + 777)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetBlock(pb.GetBlockRequest(namespace=NS, key=b"r0"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert client.get(NS, b"r0") is None
        assert client.stats()["checksum_failures"] == 1
        for key, data in blocks.items():
            if key != b"r0":
                assert client.get(NS, key) == data


def _put_block(ns: str, key: bytes, data: bytes, **header: int) -> pb.PutBlockRequest:
    fields = {"size_bytes": len(data), "xxh3_64": xxhash.xxh3_64_intdigest(data), **header}
    return pb.PutBlockRequest(header=pb.PutHeader(namespace=ns, key=key, **fields), data=data)


@pytest.mark.parametrize(
    ("request_", "code", "words"),
    [
        (_put_block(NS, b"short", b"abc", size_bytes=4), "INVALID_ARGUMENT", "carries 3 bytes"),
        (_put_block(NS, b"long", b"abcde", size_bytes=4), "INVALID_ARGUMENT", "declares 4"),
        (_put_block(NS, b"sum", b"abcd", xxh3_64=12345), "DATA_LOSS", "do not match the checksum"),
        (_put_block("", b"k", b"abcd"), "INVALID_ARGUMENT", "namespace is empty"),
        (_put_block(NS, b"", b"abcd"), "INVALID_ARGUMENT", "key is empty"),
        (pb.PutBlockRequest(data=b"abcd"), "INVALID_ARGUMENT", "namespace is empty"),
        (_put_block(NS, b"big", bytes(33 << 20)), "RESOURCE_EXHAUSTED", "larger than"),
        (b"\x0a\x05ab", "INVALID_ARGUMENT", "not a valid protobuf message"),
        (b"\x0a\x02\x0a\xff\x12\x01x", "INVALID_ARGUMENT", "not a valid protobuf message"),
    ],
)
def test_a_bad_put_block_gets_its_status_and_stores_nothing(
    start_daemon: StartDaemon, request_: pb.PutBlockRequest | bytes, code: str, words: str
) -> None:
    daemon = start_daemon(dram="32MiB", nvme="128MiB")
    with daemon.client() as client:
        client.put(NS, b"keep", block_bytes(7, 3 << 20))
        used_bytes = client.stats()["tiers"]["dram"]["used_bytes"]
        with grpc.insecure_channel(
            daemon.target, options=[("grpc.max_send_message_length", 64 << 20)]
        ) as channel:
            call = channel.unary_unary(
                "/kvtier.v1.KVTier/PutBlock",
                request_serializer=None
                if isinstance(request_, bytes)
                else type(request_).SerializeToString,
                response_deserializer=pb.PutResponse.FromString,
            )
            with pytest.raises(grpc.RpcError) as info:
                call(request_)
        assert info.value.code().name == code
        assert words in (info.value.details() or "")
        for key in (b"short", b"long", b"sum", b"big", b"k"):
            assert client.get(NS, key) is None
        assert client.stats()["tiers"]["dram"]["used_bytes"] == used_bytes, "a reservation leaked"
        assert client.get(NS, b"keep") == block_bytes(7, 3 << 20)
