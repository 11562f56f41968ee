"""One-exchange zero-copy puts (Stage + PutStaged) against a real daemon: the bytes that
become visible are exactly what was hashed, and a request naming anything but its own
staging range, or with a wrong checksum, stores nothing."""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from collections.abc import Callable

import grpc
import pytest
import xxhash

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from kvtier.client.ways import SPIN_S
from kvtier.client.write_area import stream_class
from kvtier.client.zerocopy import SharedArena
from tests.conftest import DaemonProcess, block_bytes

NS = "llama3-8b/bf16-b16"
StartDaemon = Callable[..., DaemonProcess]


def attached(client: kvtier.Client) -> SharedArena:
    arena = client._shared_arena()
    assert arena is not None and arena.write_area is not None
    return arena


def stage(arena: SharedArena, size_bytes: int) -> tuple[int, int]:
    reply = arena.call(Op.STAGE, pb.StageRequest(size_bytes=size_bytes), pb.StageResponse)
    return reply.offset, reply.size_bytes


def put_staged(arena: SharedArena, *items: pb.StagedPutItem) -> list[pb.CommitResult]:
    request = pb.StagedPutRequest(namespace=NS, items=list(items))
    return list(arena.call(Op.PUT_STAGED, request, pb.CommitResponse).results)


@pytest.mark.parametrize("path", ["streamed", "staged", "reserve-commit"])
def test_puts_are_bit_exact_on_every_path(start_daemon: StartDaemon, path: str) -> None:
    daemon = start_daemon(dram="64MiB", nvme="256MiB")
    with daemon.client() as client:
        arena = attached(client)
        assert arena.write_area is not None
        one_exchange = path != "reserve-commit"
        arena.write_area.one_exchange = one_exchange
        arena.write_area.streams = path == "streamed"
        blocks = {f"b{i}": block_bytes(i, size) for i, size in enumerate([1, 4095, 300_001])}
        big = block_bytes(9, 5 << 20)  # over one copy piece, not a multiple of it
        parts = [
            memoryview(big)[:1000],
            memoryview(big)[1000 : 3 << 20],
            memoryview(big)[3 << 20 :],
        ]
        assert client.put_many(NS, list(blocks.items())) == [True] * 3
        assert client.put_from(NS, "parts", parts) is True
        assert client.put_from(NS, "parts", big) is False  # the same bytes: already there
        for key, data in [*blocks.items(), ("parts", big)]:
            sink = bytearray(len(data))
            assert client.get_into(NS, key, sink, verify=True) == len(data)
            assert bytes(sink) == data
            assert client.get(NS, key) == data  # the gRPC path reads the same block
        # Which path ran: only the one-exchange put asks for a staging range.
        assert (arena.write_area.staging is not None) == one_exchange
        assert client.stats()["leases"] == 0


def test_a_staged_put_names_only_its_own_staging_range(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="16MiB", nvme="64MiB")
    with daemon.client() as client, daemon.client() as other:
        arena = attached(client)
        data = block_bytes(1, 8192)
        item = pb.StagedPutItem(key=b"k", size_bytes=len(data), offset=0, xxh3_64=0)
        (result,) = put_staged(arena, item)  # nothing staged yet
        assert result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "staging range" in result.message
        offset, size = stage(arena, len(data))
        assert size >= len(data)
        for bad_offset, bad_size in [
            (offset + 1, size),
            (offset + size, 1),
            (offset + size - 1, 2),
            (1 << 62, 1),
        ]:
            bad = pb.StagedPutItem(key=b"k", size_bytes=bad_size, offset=bad_offset)
            (result,) = put_staged(arena, bad)
            assert result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], (bad_offset, bad_size)
        # Another session's staging range is not this one's, even at the same offset.
        other_arena = attached(other)
        assert other_arena.write_area is not None
        (result,) = put_staged(
            other_arena, item.__class__(key=b"k", size_bytes=8192, offset=offset)
        )
        assert result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert client.get(NS, "k") is None
        assert client.stats()["tiers"]["dram"]["used_bytes"] == 0
        with pytest.raises(kvtier.InvalidArgument, match="staging range of"):
            stage(arena, 1 << 40)  # more than the tenant's arena


def test_a_wrong_checksum_or_a_scribble_after_hashing_stores_nothing(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon(dram="16MiB", nvme="64MiB")
    with daemon.client() as client:
        arena = attached(client)
        assert arena.write_area is not None
        offset, _ = stage(arena, 1 << 20)
        data = block_bytes(2, 1 << 20)
        slot = arena.write_area.slot(offset, len(data))
        slot[:] = data
        digest = xxhash.xxh3_64_intdigest(data)
        (result,) = put_staged(
            arena, pb.StagedPutItem(key=b"bad", size_bytes=len(data), offset=offset, xxh3_64=12345)
        )
        assert result.code == grpc.StatusCode.DATA_LOSS.value[0]
        slot[100:200] = b"\0" * 100  # changed after the client hashed it
        (result,) = put_staged(
            arena,
            pb.StagedPutItem(key=b"torn", size_bytes=len(data), offset=offset, xxh3_64=digest),
        )
        assert result.code == grpc.StatusCode.DATA_LOSS.value[0]
        assert client.get(NS, "bad") is None and client.get(NS, "torn") is None
        slot[:] = data
        (result,) = put_staged(
            arena,
            pb.StagedPutItem(key=b"good", size_bytes=len(data), offset=offset, xxh3_64=digest),
        )
        assert result.code == 0 and result.stored
        slot[:] = b"\1" * len(data)  # after the commit: the stored block does not change
        slot.release()
        assert client.get(NS, "good") == data
        assert client.stats()["leases"] == 0
        assert client.stats()["tiers"]["dram"]["used_bytes"] == 1 << 20


def streamed_request(offset: int, *sizes: int, ticket: int = 7) -> pb.StagedPutRequest:
    items = []
    for i, size in enumerate(sizes):
        items.append(pb.StagedPutItem(key=f"s{i}".encode(), size_bytes=size, offset=offset))
        offset += size
    return pb.StagedPutRequest(namespace=NS, items=items, ticket=ticket)


def test_a_streamed_put_whose_bytes_never_come_times_out_and_stores_nothing(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon(dram="16MiB", nvme="64MiB")
    with daemon.client() as client, daemon.client() as other:
        arena = attached(client)
        assert arena.write_area is not None
        offset, _ = stage(arena, 2 << 20)
        words = arena.write_area.slot(offset, 32)
        words[:] = bytes(32)  # ticket 0: never this request's
        assert other.put_from(NS, "other", b"served meanwhile") is True
        started = time.monotonic()
        request = streamed_request(offset + 4096, 1 << 20)
        (result,) = arena.call(Op.PUT_STAGED, request, pb.CommitResponse).results
        assert result.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert 1.5 < time.monotonic() - started < 10
        # Abandoned by its client: answered at once.
        struct.pack_into("<QQ", words, 0, 8, (1 << 64) - 1)
        started = time.monotonic()
        request = streamed_request(offset + 4096, 1 << 20, ticket=8)
        (result,) = arena.call(Op.PUT_STAGED, request, pb.CommitResponse).results
        assert result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert time.monotonic() - started < 1.0
        # Blocks over the progress words, or past the range: refused, nothing read.
        for bad in [streamed_request(offset + 8, 4096), streamed_request(offset + 4096, 4 << 20)]:
            (result,) = arena.call(Op.PUT_STAGED, bad, pb.CommitResponse).results
            assert result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        words.release()
        assert client.get(NS, "s0") is None
        assert other.get(NS, "other") == b"served meanwhile"
        assert client.stats()["tiers"]["dram"]["used_bytes"] == 4096  # "other" alone


def test_a_streamed_put_stores_what_the_daemon_hashed_and_checks_each_checksum(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon(dram="16MiB", nvme="64MiB")
    with daemon.client() as client:
        arena = attached(client)
        assert arena.write_area is not None
        offset, _ = stage(arena, 3 << 20)
        first, second = block_bytes(3, 1 << 20), block_bytes(4, 300_000)
        view = arena.write_area.slot(offset, 3 << 20)
        view[4096 : 4096 + len(first)] = first
        view[4096 + len(first) : 4096 + len(first) + len(second)] = second
        # Written before the request, as a client that lies about nothing: right checksum
        # for the first, a wrong one for the second.
        struct.pack_into(
            "<QQQQ", view, 0, 9, len(first) + len(second), xxhash.xxh3_64_intdigest(first), 1
        )
        request = streamed_request(offset + 4096, len(first), len(second), ticket=9)
        ok, bad = arena.call(Op.PUT_STAGED, request, pb.CommitResponse).results
        assert ok.code == 0 and ok.stored
        assert bad.code == grpc.StatusCode.DATA_LOSS.value[0]
        view.release()
        assert client.get(NS, "s0") == first and client.get(NS, "s1") is None
        assert client.stats()["leases"] == 0


def test_a_put_waits_for_the_staging_range_another_put_holds(start_daemon: StartDaemon) -> None:
    """A put of one client while another holds the staging range waits for it instead of
    reserving DRAM and committing in a second exchange (a reservation held between
    exchanges could be what another thread's request, ahead of that Commit, waited for);
    past the client's timeout it reserves and commits after all."""
    daemon = start_daemon(dram="64MiB", nvme="256MiB")
    data = block_bytes(1, 300_001)
    with daemon.client() as client:
        area = attached(client).write_area
        assert area is not None
        assert client.put_many(NS, [("first", data)]) == [True]
        assert area.hold_staging()  # as another thread's put in flight would
        done: list[list[bool]] = []
        waiter = threading.Thread(target=lambda: done.append(client.put_many(NS, [("w", data)])))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not done, "the put went on without the staging range"
        assert client.stats()["leases"] == 0  # it reserved nothing meanwhile
        area.drop_staging()
        waiter.join(30)
        assert done == [[True]]
        assert client.get(NS, "w") == data
    with daemon.client() as impatient:
        area = attached(impatient).write_area  # attached with time to spare
        impatient.timeout_s = 0.3
        assert area is not None and area.hold_staging()
        began = time.monotonic()
        assert impatient.put_many(NS, [("late", data)]) == [True]  # reserve + commit
        assert time.monotonic() - began >= 0.3
        area.drop_staging()
        assert impatient.get(NS, "late") == data


def test_an_async_put_waits_for_the_staging_range_without_blocking_the_loop(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon(dram="64MiB", nvme="256MiB")
    data = block_bytes(2, 300_001)

    async def scenario() -> None:
        async with kvtier.AsyncClient(daemon.target) as client:
            assert await client.put_many(NS, [("first", data)]) == [True]
            arena = await client._shared_arena()
            assert arena is not None
            area = arena._arena.write_area
            assert area is not None and area.hold_staging()
            put = asyncio.ensure_future(client.put_many(NS, [("w", data)]))
            ticks = 0
            for _ in range(50):  # the loop keeps turning while the put waits
                await asyncio.sleep(0.01)
                ticks += 1
            assert ticks == 50 and not put.done()
            assert (await client.stats())["leases"] == 0
            area.drop_staging()
            assert await asyncio.wait_for(put, 30) == [True]
            assert await client.get(NS, "w") == data

    asyncio.run(scenario())


@pytest.mark.parametrize("spin_s", [None, 0.0])
def test_a_clients_reply_poll_reaches_its_session(
    start_daemon: StartDaemon, spin_s: float | None
) -> None:
    """Puts and reads come back whole whether the client polls for replies or sleeps."""
    daemon = start_daemon(dram="64MiB", nvme="256MiB")
    with daemon.client(spin_s=spin_s, direct_reads=False) as client:
        data = block_bytes(3, 100_000)
        assert client.put_many(NS, [("p", data)]) == [True]
        sink = bytearray(len(data))
        assert client.get_into(NS, "p", sink) == len(data) and bytes(sink) == data
        arena = attached(client)
        assert arena.reply_wait.spin_s == (SPIN_S if spin_s is None else 0.0)
        # A put's wait is measured by the size of what it moves: one block and a batch
        # of 40 are measured apart.
        assert client.put_many(NS, [(f"b{i}", data) for i in range(40)]) == [True] * 40
        one, batch = stream_class(len(data)), stream_class(40 * len(data))
        for size_class in (one, batch):
            assert sum(arena.reply_wait.mean_s((Op.PUT_STAGED, size_class))) > 0


def test_large_puts_stream_or_not_by_what_each_way_took(
    start_daemon: StartDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the way left to measurement (`streams = None`, x86-64's default), a size class
    of large puts is put both ways first, then each put reports its way and time, and the
    way that took less is taken, the other one call in EXPLORE_EVERY (here the streamed
    way is made to look twice as fast); every put comes back bit-exact either way."""
    from kvtier.client import ways as ways_module
    from kvtier.client.ways import EXPLORE_EVERY

    monkeypatch.setattr(ways_module, "host_busy", lambda: False)  # as on an idle host

    daemon = start_daemon(dram="256MiB", nvme="512MiB")
    with daemon.client() as client:
        area = attached(client).write_area
        assert area is not None
        area.streams = None
        values = [block_bytes(i, (2 << 20) + 4096 * i) for i in range(4)]
        asked: list[bool] = []
        reported: list[tuple[object, bool]] = []
        ways = area.stream_ways
        dear, took = ways.dear, ways.took

        def ask(key: object) -> bool:
            asked.append(dear(key))
            return asked[-1]

        def report(key: object, streamed: bool, seconds: float) -> None:
            assert seconds > 0
            reported.append((key, streamed))
            took(key, streamed, 0.001 if streamed else 0.002)

        ways.dear, ways.took = ask, report  # type: ignore[method-assign]
        calls = 2 + 4 * EXPLORE_EVERY
        for i in range(calls):
            assert client.put_many(NS, [(f"s{i}", values[i % 4])], overwrite=True) == [True]
        assert asked[:2] == [True, False]  # each way once
        assert asked[2:].count(False) == 4  # then streamed, but one in EXPLORE_EVERY
        assert reported == [(stream_class(len(values[0])), way) for way in asked]
        for i in range(calls):
            assert client.get(NS, f"s{i}") == values[i % 4]
        area.streams = False  # never: no choice asked, nothing reported
        assert client.put_many(NS, [("never", values[0])]) == [True]
        assert len(asked) == len(reported) == calls
