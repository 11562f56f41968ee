"""The zero-copy path: shared arena, two-phase put, leased get, batches, dead clients."""

from __future__ import annotations

import array
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier._session import Op
from tests.conftest import DaemonProcess, block_bytes

NS = "llama3-8b/bf16-b16"
StartDaemon = Callable[..., DaemonProcess]


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_put_from_and_get_into_are_bit_exact_for_any_buffer(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="64MiB", nvme="256MiB")
    with daemon.client() as client:
        sources: list[object] = [
            block_bytes(1, 4 << 20),  # read-only bytes are fine for a put
            bytearray(block_bytes(2, 1_000_001)),
            memoryview(block_bytes(3, 70_000))[5:60_005],
            array.array("d", range(10_000)),
            b"",
        ]
        for i, src in enumerate(sources):
            assert client.put_from(NS, f"z{i}", src) is True
            expected = bytes(memoryview(src).cast("B"))  # type: ignore[arg-type]
            sink = bytearray(len(expected) + 17)
            assert client.get_into(NS, f"z{i}", sink, verify=True) == len(expected)
            assert bytes(sink[: len(expected)]) == expected
            assert client.get(NS, f"z{i}") == expected  # the gRPC path sees the same block
        assert client.put_from(NS, "z0", block_bytes(1, 4 << 20)) is False  # already there
        with pytest.raises(kvtier.AlreadyExists):
            client.put_from(NS, "z0", b"different")
        client.put(NS, "via-grpc", b"streamed bytes")
        out = array.array("b", bytes(32))
        assert client.get_into(NS, "via-grpc", out) == 14
        assert out.tobytes()[:14] == b"streamed bytes"
        assert client.get_into(NS, "missing", bytearray(8)) is None
        with pytest.raises(kvtier.InvalidArgument, match="too small"):
            client.get_into(NS, "z0", bytearray(100))
        with pytest.raises(kvtier.InvalidArgument, match="writable"):
            client.get_into(NS, "z0", bytes(4 << 20))
        assert client._arena is not None, "a UNIX-socket client must use the shared arena"
        wait_for(lambda: client.stats()["leases"] == 0, "leases must all be released")


def test_numpy_and_torch_buffers(start_daemon: StartDaemon) -> None:
    np = pytest.importorskip("numpy")
    daemon = start_daemon(dram="32MiB", nvme="64MiB")
    with daemon.client() as client:
        src = np.arange(300_000, dtype=np.float32)
        client.put_from(NS, "np", src)
        dst = np.zeros_like(src)
        assert client.get_into(NS, "np", dst) == src.nbytes
        assert (dst == src).all()
        torch = pytest.importorskip("torch")
        t = torch.arange(100_000, dtype=torch.bfloat16)
        client.put_from(NS, "torch", t)
        out = torch.zeros_like(t)
        assert client.get_into(NS, "torch", out) == t.numel() * 2
        assert torch.equal(out, t)


def test_batches_move_a_chain_in_one_round_trip(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="64MiB", nvme="256MiB")
    chain = kvtier.chain_keys(NS, [[i] * 16 for i in range(64)])
    blocks = [block_bytes(i, 256 << 10) for i in range(64)]
    with daemon.client() as client:
        assert client.put_many(NS, list(zip(chain, blocks, strict=True))) == [True] * 64
        assert client.lookup(NS, chain).prefix_blocks == 64
        sinks = [bytearray(256 << 10) for _ in range(65)]
        got = client.get_many(NS, [*chain[:32], b"absent", *chain[32:]], sinks)
        assert got[32] is None and got.count(256 << 10) == 64
        for i, sink in enumerate(sinks[:32] + sinks[33:]):
            assert sink == blocks[i]


def check_parts_roundtrip(client: kvtier.Client) -> None:
    """A block given as several buffers (one per layer) is stored as their concatenation
    and read back into several buffers, split wherever those buffers end."""
    layers = [block_bytes(10 + i, 64 << 10) for i in range(4)]
    whole = b"".join(layers)
    assert client.put_many(NS, [("layered", layers)]) == [True]
    assert client.get(NS, "layered") == whole
    # The same bytes as one buffer: already there (the parts' checksum is the whole's).
    assert client.put_many(NS, [("layered", whole)]) == [False]
    sinks = [bytearray(100_000), bytearray(100_000), bytearray(70_000)]
    assert client.get_many(NS, ["layered"], [sinks])[0] == len(whole)
    assert b"".join(sinks)[: len(whole)] == whole
    with pytest.raises(kvtier.InvalidArgument, match="too small"):
        client.get_many(NS, ["layered"], [[bytearray(64 << 10), bytearray(64 << 10)]])


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_block_in_parts_round_trips(start_daemon: StartDaemon, transport: str) -> None:
    tcp = transport == "tcp"
    daemon = start_daemon(
        dram="16MiB",
        nvme="64MiB",
        listen="127.0.0.1:0" if tcp else None,
        env={"KVTIER_SERVER__TLS_INSECURE": "true"} if tcp else {},
    )
    with daemon.client() as client:
        check_parts_roundtrip(client)
        assert (client._arena is None) == tcp


def test_leased_get_promotes_nvme_blocks_and_corrupt_records_miss(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon(dram="8MiB", nvme="128MiB")
    with daemon.client() as client:
        for i in range(12):
            client.put_from(NS, f"p{i}", block_bytes(i, 1 << 20))
        assert client.lookup(NS, ["p0", "p1"]).tiers == ["nvme", "nvme"]
        sink = bytearray(1 << 20)
        assert client.get_into(NS, "p0", sink) == 1 << 20 and sink == block_bytes(0, 1 << 20)
        assert client.stat(NS, "p0").tiers == ["dram", "nvme"]  # promoted, still on disk
        assert client.stats()["promotions"] == 1
        record = next(
            p for p in daemon.nvme_path.glob("v1/*/*.kvr") if b"p1" in p.read_bytes()[:4096]
        )
        with record.open("r+b") as fh:
            fh.seek(4096 + 777)
            fh.write(b"\xff")
        assert client.get_into(NS, "p1", sink) is None
        assert client.stats()["checksum_failures"] == 1
        assert client.get_into(NS, "p2", sink) == 1 << 20 and sink == block_bytes(2, 1 << 20)


def test_a_leased_block_is_never_evicted_or_moved(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="8MiB", nvme="256MiB")
    with daemon.client() as client:
        client.put_from(NS, "held", block_bytes(7, 1 << 20))
        arena = client._shared_arena()
        assert arena is not None
        lease = arena.call(
            Op.ACQUIRE, pb.AcquireRequest(namespace=NS, keys=[b"held"]), pb.AcquireResponse
        )
        slot = lease.blocks[0]
        for i in range(40):  # 40 MiB through an 8 MiB arena while the lease is held
            client.put_from(NS, f"f{i}", block_bytes(100 + i, 1 << 20))
        assert client.lookup(NS, ["held", "f0"]).tiers == ["dram", "nvme"]
        in_place = bytes(arena.view[slot.offset : slot.offset + slot.size_bytes])
        assert in_place == block_bytes(7, 1 << 20)
        arena.send(Op.RELEASE, pb.ReleaseRequest(lease_ids=[lease.lease_id]))
        wait_for(lambda: client.stats()["leases"] == 0, "release must end the lease")


def test_half_written_reservation_is_never_visible_and_bad_commit_stores_nothing(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon(dram="16MiB", nvme="64MiB")
    with daemon.client() as client:
        arena = client._shared_arena()
        assert arena is not None
        res = arena.call(
            Op.RESERVE,
            pb.ReserveRequest(
                namespace=NS, items=[pb.ReserveItem(key=b"half", size_bytes=1 << 20)]
            ),
            pb.ReserveResponse,
        )
        arena.slot(res.slots[0])[:1000] = b"x" * 1000
        assert client.get(NS, "half") is None
        assert client.lookup(NS, ["half"]).tiers == [None]
        done = arena.call(
            Op.COMMIT, pb.CommitRequest(lease_id=res.lease_id, xxh3_64=[12345]), pb.CommitResponse
        )
        assert done.results[0].code == grpc.StatusCode.DATA_LOSS.value[0]
        assert client.get(NS, "half") is None
        with pytest.raises(kvtier.NotFound, match="expired or was committed"):
            arena.call(Op.COMMIT, pb.CommitRequest(lease_id=res.lease_id), pb.CommitResponse)
        with pytest.raises(kvtier.InvalidArgument):
            arena.call(
                Op.RESERVE,
                pb.ReserveRequest(
                    namespace="bad ns", items=[pb.ReserveItem(key=b"k", size_bytes=1)]
                ),
                pb.ReserveResponse,
            )
        with pytest.raises(kvtier.ResourceExhausted):
            client.put_from(NS, "huge", bytearray(32 << 20))
        assert client.stats()["leases"] == 0
        assert client.stats()["tiers"]["dram"]["used_bytes"] == 0


CHILD = textwrap.dedent("""
    import os, sys, kvtier
    from kvtier._proto import kvtier_pb2 as pb
    from kvtier._session import Op
    client = kvtier.Client(sys.argv[1])
    client.put_from("{ns}", "mine", os.urandom(1 << 20))
    arena = client._shared_arena()
    if sys.argv[2] == "put":
        res = arena.call(Op.RESERVE, pb.ReserveRequest(namespace="{ns}",
                         items=[pb.ReserveItem(key=b"dying", size_bytes=8 << 20)]),
                         pb.ReserveResponse)
        arena.slot(res.slots[0])[: 4 << 20] = b"\\1" * (4 << 20)
    else:
        arena.call(Op.ACQUIRE, pb.AcquireRequest(namespace="{ns}", keys=[b"mine"]),
                   pb.AcquireResponse)
    print("holding", flush=True)
    os._exit(1)  # dies mid-put / mid-get: no commit, no release, no close
""").format(ns=NS)


@pytest.mark.parametrize("phase", ["put", "get"])
def test_a_client_killed_midway_leaks_nothing(
    start_daemon: StartDaemon, tmp_path: Path, phase: str
) -> None:
    daemon = start_daemon(dram="16MiB", nvme="64MiB")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = subprocess.run(
        [sys.executable, str(script), daemon.target, phase],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert "holding" in out.stdout, out.stderr
    with daemon.client() as client:
        # Well before the 30 s lease TTL: the dead client's session socket closed.
        wait_for(lambda: client.stats()["leases"] == 0, "a dead client's lease leaked", 5)
        used = client.stats()["tiers"]["dram"]["used_bytes"]
        assert used == 1 << 20, "only the committed block may hold DRAM"
        assert client.get(NS, "dying") is None
        client.put_from(NS, "fills", bytearray(15 << 20))  # all the rest is usable again


def test_leases_expire_when_a_live_client_forgets_them(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="16MiB", nvme="64MiB", env={"KVTIER_LIMITS__LEASE_TTL_S": "0.5"})
    with daemon.client() as client:
        client.put_from(NS, "k", b"v" * 5000)
        arena = client._shared_arena()
        assert arena is not None
        arena.call(Op.ACQUIRE, pb.AcquireRequest(namespace=NS, keys=[b"k"]), pb.AcquireResponse)
        arena.call(
            Op.RESERVE,
            pb.ReserveRequest(namespace=NS, items=[pb.ReserveItem(key=b"r", size_bytes=4 << 20)]),
            pb.ReserveResponse,
        )
        assert client.stats()["leases"] == 2
        wait_for(lambda: client.stats()["leases"] == 0, "leases must expire", 5)
        assert client.stats()["tiers"]["dram"]["used_bytes"] == 8192
        assert "reclaimed" in daemon.log()


def test_over_tcp_the_same_calls_use_the_grpc_byte_path(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(
        dram="16MiB",
        nvme="64MiB",
        listen="127.0.0.1:0",
        env={"KVTIER_SERVER__TLS_INSECURE": "true"},
    )
    with daemon.client() as client:
        assert client.put_from(NS, "t", block_bytes(5, 300_000)) is True
        sink = bytearray(300_000)
        assert client.get_into(NS, "t", sink) == 300_000 and sink == block_bytes(5, 300_000)
        assert client.put_many(NS, [("a", b"1"), ("b", b"22")]) == [True, True]
        assert client.get_many(NS, ["a", "b", "c"], [bytearray(4)] * 3) == [1, 2, None]
        assert client._arena is None
    with grpc.insecure_channel(daemon.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.KVTierStub(channel).Attach(pb.AttachRequest())
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_wrong_nonce_gets_no_arena(start_daemon: StartDaemon) -> None:
    import socket

    daemon = start_daemon(dram="8MiB", nvme="16MiB")
    with grpc.insecure_channel(daemon.target) as channel:
        resp = pb_grpc.KVTierStub(channel).Attach(pb.AttachRequest())
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(resp.arena_socket)
        conn.sendall(bytes(16))
        msg, fds, _, _ = socket.recv_fds(conn, 16, 1)
        assert msg == b"" and fds == []
    assert oct(os.stat(resp.arena_socket).st_mode & 0o777) == oct(0o770)


async def test_async_client_zero_copy(start_daemon: StartDaemon) -> None:
    import asyncio

    daemon = start_daemon(dram="32MiB", nvme="128MiB")
    async with kvtier.AsyncClient(daemon.target) as client:
        blocks = {f"a{i}": block_bytes(i, 300_000 + i) for i in range(16)}
        assert await client.put_many(NS, list(blocks.items())) == [True] * 16
        assert await client.put_from(NS, "one", bytearray(b"x" * 5000)) is True
        sinks = [bytearray(400_000) for _ in blocks]
        sizes = await client.get_many(NS, [*blocks], sinks, verify=True)
        assert sizes == [len(v) for v in blocks.values()]
        assert all(s[:n] == v for s, n, v in zip(sinks, sizes, blocks.values(), strict=True))
        # Concurrent calls share the session socket safely.
        outs = [bytearray(400_000) for _ in range(8)]
        got = await asyncio.gather(*(client.get_into(NS, f"a{i}", outs[i]) for i in range(8)))
        assert got == [300_000 + i for i in range(8)]
        assert await client.get_into(NS, "missing", bytearray(1)) is None
        assert client._arena is not None
        stats = await client.stats()
    assert stats["promotions"] == 0
    with daemon.client() as sync_client:
        wait_for(lambda: sync_client.stats()["leases"] == 0, "async leases must be released")


class _FlakyAttach:
    """SharedArena.attach failing as a shed handshake does (the daemon closes the side
    socket before its reply) `failures` times, then attaching for real."""

    def __init__(self, real: Callable[..., object], failures: int, error: Exception) -> None:
        self.real, self.failures, self.error, self.calls = real, failures, error, 0

    def __call__(self, resp: pb.AttachResponse) -> object:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.real(resp)


def test_a_shed_attach_is_tried_again(
    start_daemon: StartDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A side-socket handshake the daemon shed (a flood of connections that never send
    their nonce) costs that client an attach, not the zero-copy path: it is tried again at
    once, and after a pause if it keeps failing; a daemon without the path (Unimplemented)
    is not asked again."""
    from kvtier.client import _core
    from kvtier.client import sync as client_sync
    from kvtier.client.zerocopy import SharedArena
    from kvtier.errors import Unavailable, Unimplemented

    daemon = start_daemon(dram="64MiB", nvme="256MiB")
    data = block_bytes(7, 65536)
    with daemon.client() as writer:
        writer.put(NS, b"k", data)
    out = bytearray(len(data))

    # Shed twice, then through: attached within the one call.
    flaky = _FlakyAttach(SharedArena.attach, 2, Unavailable("the daemon refused to share"))
    monkeypatch.setattr(client_sync.SharedArena, "attach", flaky)
    with daemon.client() as client:
        assert client.get_into(NS, b"k", out) == len(data) and bytes(out) == data
        assert client._arena is not None and flaky.calls == 3

    # Shed every time: gRPC meanwhile, no attach until the pause is over, then attached.
    monkeypatch.setattr(_core, "ATTACH_RETRY_S", 0.5)
    flaky = _FlakyAttach(SharedArena.attach, _core.ATTACH_TRIES, ConnectionResetError())
    monkeypatch.setattr(client_sync.SharedArena, "attach", flaky)
    with daemon.client() as client:
        assert client.get_into(NS, b"k", out) == len(data) and bytes(out) == data
        assert client._arena is None and flaky.calls == _core.ATTACH_TRIES
        assert client.get_into(NS, b"k", out) == len(data)
        assert flaky.calls == _core.ATTACH_TRIES  # within the pause: not asked again
        time.sleep(0.6)
        assert client.get_into(NS, b"k", out) == len(data) and bytes(out) == data
        assert client._arena is not None and flaky.calls == _core.ATTACH_TRIES + 1

    # Not a transient failure: gRPC for good, and a single attach.
    flaky = _FlakyAttach(SharedArena.attach, 99, Unimplemented("no side socket"))
    monkeypatch.setattr(client_sync.SharedArena, "attach", flaky)
    monkeypatch.setattr(_core, "ATTACH_RETRY_S", 0.0)
    with daemon.client() as client:
        for _ in range(3):
            assert client.get_into(NS, b"k", out) == len(data) and bytes(out) == data
        assert client._arena is None and flaky.calls == 1


@pytest.mark.parametrize("asynchronous", [True, False])
def test_concurrent_first_calls_share_one_session(
    start_daemon: StartDaemon, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    """Calls that begin together before a client has a session (coroutines of one
    AsyncClient, threads of one Client) attach once and all use that session. Each used
    to attach its own; the last became the client's, and a put that had opened the first
    wrote its blocks into that session's write area while its requests went to the other:
    DataLoss (the daemon hashed bytes the client never wrote), never wrong bytes stored. A
    small arena makes the puts wait for room, so their exchanges interleave."""
    import asyncio
    import threading

    from kvtier.client import zerocopy

    attaches = []
    real = zerocopy.SharedArena.attach

    def counted(resp: pb.AttachResponse) -> object:
        attaches.append(resp.session_id)
        time.sleep(0.05)  # every caller gets here before the first attach ends
        return real(resp)

    monkeypatch.setattr(zerocopy.SharedArena, "attach", staticmethod(counted))
    daemon = start_daemon(dram="4MiB", nvme="256MiB")
    callers, rounds = 4, 6

    def items(caller: int, r: int) -> list[tuple[str, bytes]]:
        return [
            (f"c{caller}-{r}-{i}", block_bytes(caller * 1000 + r * 16 + i, 65536))
            for i in range(16)
        ]

    if asynchronous:

        async def main() -> list[list[bool]]:
            async with kvtier.AsyncClient(daemon.target) as client:

                async def caller(c: int) -> list[bool]:
                    stored: list[bool] = []
                    for r in range(rounds):
                        stored += await client.put_many(NS, items(c, r))
                    return stored

                return await asyncio.gather(*(caller(c) for c in range(callers)))

        results = asyncio.run(main())
    else:
        results = [[] for _ in range(callers)]
        failures: list[BaseException] = []
        with kvtier.Client(daemon.target) as client:
            barrier = threading.Barrier(callers)

            def caller(c: int) -> None:
                try:
                    barrier.wait()
                    for r in range(rounds):
                        results[c] += client.put_many(NS, items(c, r))
                except BaseException as err:
                    failures.append(err)

            threads = [threading.Thread(target=caller, args=(c,)) for c in range(callers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert failures == []
    assert results == [[True] * (16 * rounds)] * callers
    assert len(attaches) == 1
    with daemon.client() as client:
        for c in range(callers):
            for r in (0, rounds - 1):
                for key, value in items(c, r)[:2]:
                    assert client.get(NS, key) == value


def test_threads_of_one_client_putting_and_reading_under_leases_do_not_stall(
    start_daemon: StartDaemon,
) -> None:
    """Threads of one Client put 1 MiB blocks and read runs of three under leases (no
    direct reads) on a 6 MiB arena. A Release used to wait for the session's lock while
    another thread's put, holding it, waited for the DRAM that lease pinned: each such
    put waited `limits.reserve_wait_s` and failed (the run took minutes). A reply-less
    request waits for no exchange now, and the daemon runs it beside one that waits.
    And a put waits for another's staging range rather than hold reserved DRAM between
    two exchanges: a read promoting blocks, sent between that put's Reserve and Commit,
    waited its 5 s for that very DRAM and was refused (1 run in 3)."""
    import threading

    daemon = start_daemon(dram="6MiB", nvme="512MiB")
    failures: list[BaseException] = []
    wrong: list[str] = []

    def value(key: str) -> bytes:
        return block_bytes(sum(key.encode()), 1 << 20)

    with kvtier.Client(daemon.target, direct_reads=False) as client:

        def work(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(40):
                    if rng.random() < 0.5:
                        key = f"k{rng.randrange(24)}"
                        client.put_many(NS, [(key, value(key))])
                    else:
                        keys = [f"k{rng.randrange(24)}" for _ in range(3)]
                        buffers = [bytearray(1 << 20) for _ in keys]
                        got = client.get_many(NS, keys, buffers)
                        wrong.extend(
                            k
                            for k, b, n in zip(keys, buffers, got, strict=True)
                            if n is not None and bytes(b) != value(k)
                        )
            except BaseException as err:
                failures.append(err)

        threads = [threading.Thread(target=work, args=(seed,), daemon=True) for seed in range(6)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, 60 - (time.monotonic() - started)))
        assert not any(t.is_alive() for t in threads), "stalled: puts waiting on their own leases"
    assert wrong == []
    assert failures == []
