"""Bad input gets the right status code and a message; nothing stored is damaged."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import xxhash

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from tests.conftest import DaemonProcess, block_bytes

NS = "model/layout"
StartDaemon = Callable[..., DaemonProcess]


@pytest.fixture
def daemon(start_daemon: StartDaemon) -> DaemonProcess:
    d = start_daemon(dram="32MiB", nvme="128MiB", extra=[])
    with d.client() as client:
        for i in range(6):
            client.put(NS, f"keep{i}", block_bytes(i, 3 << 20))  # some spill to NVMe
    return d


def assert_intact(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        for i in range(6):
            assert client.get(NS, f"keep{i}") == block_bytes(i, 3 << 20)


def raw_stub(daemon: DaemonProcess) -> tuple[grpc.Channel, pb_grpc.KVTierStub]:
    target = daemon.target
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
    return channel, pb_grpc.KVTierStub(channel)


def put_stream(
    ns: str, key: bytes, data: bytes, declared: int | None = None, checksum: int | None = None
) -> Iterator[pb.PutRequest]:
    yield pb.PutRequest(
        header=pb.PutHeader(
            namespace=ns,
            key=key,
            size_bytes=len(data) if declared is None else declared,
            xxh3_64=xxhash.xxh3_64_intdigest(data) if checksum is None else checksum,
        )
    )
    for start in range(0, len(data), 1 << 20):
        yield pb.PutRequest(chunk=data[start : start + (1 << 20)])


@pytest.mark.parametrize(
    ("namespace", "key", "size", "code", "words"),
    [
        (NS, b"", 10, grpc.StatusCode.INVALID_ARGUMENT, "key is empty"),
        (NS, b"k" * (1 << 20), 10, grpc.StatusCode.INVALID_ARGUMENT, "limit is 128"),
        ("", b"k", 10, grpc.StatusCode.INVALID_ARGUMENT, "namespace is empty"),
        ("has space/x", b"k", 10, grpc.StatusCode.INVALID_ARGUMENT, "namespace must be"),
        ("../etc", b"k", 10, grpc.StatusCode.INVALID_ARGUMENT, "namespace must be"),
        ("a//b", b"k", 10, grpc.StatusCode.INVALID_ARGUMENT, "namespace must be"),
        ("x" * 300, b"k", 10, grpc.StatusCode.INVALID_ARGUMENT, "max_namespace_chars"),
        (NS, b"big", 33 << 20, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than the largest"),
    ],
)
def test_bad_put_is_refused_with_code_and_message(
    daemon: DaemonProcess,
    namespace: str,
    key: bytes,
    size: int,
    code: grpc.StatusCode,
    words: str,
) -> None:
    channel, stub = raw_stub(daemon)
    with channel, pytest.raises(grpc.RpcError) as info:
        stub.Put(put_stream(namespace, key, b"\0" * size))
    assert info.value.code() == code
    assert words in info.value.details()
    assert_intact(daemon)


@pytest.mark.parametrize(("key", "namespace"), [(b"", NS), (b"k" * (1 << 20), NS), (b"k", "a b")])
def test_bad_get_lookup_stat_delete_are_invalid_argument(
    daemon: DaemonProcess, key: bytes, namespace: str
) -> None:
    with daemon.client() as client:
        for call in (client.get, client.stat, client.delete):
            with pytest.raises(kvtier.InvalidArgument):
                call(namespace, key)
        with pytest.raises(kvtier.InvalidArgument):
            client.lookup(namespace, [b"ok", key])
    assert_intact(daemon)


def test_put_stream_that_ends_early_stores_nothing(daemon: DaemonProcess) -> None:
    data = block_bytes(99, 10 << 20)
    channel, stub = raw_stub(daemon)
    with channel, pytest.raises(grpc.RpcError) as info:
        stub.Put(
            put_stream(
                NS,
                b"short",
                data[: 3 << 20],
                declared=len(data),
                checksum=xxhash.xxh3_64_intdigest(data),
            )
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ended after 3145728 of the 10485760 bytes" in info.value.details()
    with daemon.client() as client:
        assert client.get(NS, b"short") is None
        assert client.stats()["tiers"]["dram"]["used_bytes"] <= 32 << 20
    assert_intact(daemon)


def test_put_stream_cut_off_midway_releases_its_reservation(daemon: DaemonProcess) -> None:
    channel, stub = raw_stub(daemon)
    sent = threading.Event()

    def slow_stream() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.PutHeader(namespace=NS, key=b"cut", size_bytes=20 << 20))
        for _ in range(4):
            yield pb.PutRequest(chunk=b"\1" * (1 << 20))
        sent.set()
        time.sleep(30)  # never finishes: the client goes away instead

    future = stub.Put.future(slow_stream())
    assert sent.wait(10)
    time.sleep(0.3)
    with daemon.client() as client:
        reserved = client.stats()["tiers"]["dram"]["used_bytes"]
    future.cancel()
    channel.close()
    with daemon.client() as client:
        deadline = time.monotonic() + 10
        while client.stats()["tiers"]["dram"]["used_bytes"] > reserved - (20 << 20):
            assert time.monotonic() < deadline, "the reservation of a cut-off put leaked"
            time.sleep(0.05)
        assert client.get(NS, b"cut") is None
        # All of DRAM is usable again: a block as large as the arena allows still fits.
        client.put(NS, b"after", block_bytes(7, 30 << 20))
        assert client.get(NS, b"after") == block_bytes(7, 30 << 20)
    assert_intact(daemon)


def test_stream_protocol_errors(daemon: DaemonProcess) -> None:
    channel, stub = raw_stub(daemon)
    with channel:
        cases: list[tuple[list[pb.PutRequest], grpc.StatusCode, str]] = [
            ([], grpc.StatusCode.INVALID_ARGUMENT, "must start with a header"),
            ([pb.PutRequest(chunk=b"x")], grpc.StatusCode.INVALID_ARGUMENT, "start with a header"),
            (
                list(put_stream(NS, b"over", b"x" * 100, declared=50)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "more than the 50 bytes",
            ),
            (
                [
                    *put_stream(NS, b"two-headers", b"abc"),
                    pb.PutRequest(header=pb.PutHeader(namespace=NS, key=b"x")),
                ],
                grpc.StatusCode.INVALID_ARGUMENT,
                "only data chunks",
            ),
            (
                list(put_stream(NS, b"badsum", b"payload", checksum=12345)),
                grpc.StatusCode.DATA_LOSS,
                "do not match the checksum",
            ),
        ]
        for messages, code, words in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.Put(iter(messages))
            assert info.value.code() == code, words
            assert words in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Get(pb.GetRequest(namespace=NS, key=b"absent")))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as info:
            stub.Stat(pb.StatRequest(namespace=NS, key=b"absent"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with daemon.client() as client:
        for key in (b"over", b"two-headers", b"badsum"):
            assert client.get(NS, key) is None
    assert_intact(daemon)


def test_health_service_reports_serving(daemon: DaemonProcess) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel, _ = raw_stub(daemon)
    with channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvtier.v1.KVTier"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
