"""Direct reads (docs/design.md): gets copied through the tenant's directory without a
round trip, against a real daemon whose blocks other processes overwrite, delete and
evict meanwhile: never wrong bytes, and nothing of another tenant's."""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import kvtier
from kvtier._directory import key_digest
from kvtier.client.zerocopy import DIRECT_READS, HITS_BATCH, DirectoryReader
from tests.conftest import DaemonProcess
from tests.integration.test_tenants import TOKENS, start_two_tenants

StartDaemon = Callable[..., DaemonProcess]
NS = "llama3-8b/bf16-b16"
BLOCK_BYTES = 1 << 20
KEYS = 16  # 16 MiB of blocks through a 12 MiB arena: puts evict all the time
WRITE_S = 6.0  # how long the writers overwrite, delete and evict
STAMP = struct.Struct("<IIQ")  # key, writer, generation: repeated over the whole block

pytestmark = pytest.mark.skipif(not DIRECT_READS, reason="direct reads need x86-64 (TSO)")

WRITER = textwrap.dedent(
    """
    import struct, sys, time, kvtier
    target, ns, writer, keys, size = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    stamp, end_s = struct.Struct("<IIQ"), time.monotonic() + float(sys.argv[6])
    with kvtier.Client(target) as c:
        gen = 0
        while time.monotonic() < end_s:
            for k in range(writer, keys, 2):
                gen += 1
                if gen % 7 == 0:
                    c.delete(ns, f"key{k}")
                    continue
                block = stamp.pack(k, writer, gen) * (size // 16)
                c.put_from(ns, f"key{k}", block, overwrite=True)
    """
)


def check_block(key_index: int, data: memoryview) -> None:
    """A block is one stamp repeated, naming its own key: a torn or misplaced copy is not."""
    stamp = bytes(data[: STAMP.size])
    k, _, _ = STAMP.unpack(stamp)
    assert k == key_index, f"key{key_index} returned key{k}'s block"
    assert data == stamp * (data.nbytes // STAMP.size), f"key{key_index}: a torn block"


def counting(reader: DirectoryReader) -> dict[str, int]:
    counts = {"direct": 0, "fallback": 0}
    read_into = reader.read_into

    def wrapped(*args: object, **kwargs: object) -> int | None:
        got = read_into(*args, **kwargs)  # type: ignore[arg-type]
        counts["direct" if got is not None else "fallback"] += 1
        return got

    reader.read_into = wrapped  # type: ignore[method-assign]
    return counts


def test_reads_never_return_wrong_bytes_while_blocks_change(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="12MiB", nvme="256MiB")
    writers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER,
                daemon.target,
                NS,
                str(w),
                str(KEYS),
                str(BLOCK_BYTES),
                "6",
            ],
            env=dict(os.environ),
        )
        for w in range(2)
    ]
    buf = bytearray(BLOCK_BYTES)
    view = memoryview(buf)
    checked = 0
    with kvtier.Client(daemon.target) as client:
        client.put_from(NS, "warm", b"x")  # attach the session
        arena = client._shared_arena()
        assert arena is not None and arena.directory is not None
        counts = counting(arena.directory)
        deadline_s = time.monotonic() + WRITE_S + 60
        i = 0
        while any(w.poll() is None for w in writers) and time.monotonic() < deadline_s:
            k = i % KEYS
            i += 1
            got = client.get_into(NS, f"key{k}", buf)
            if got is not None:
                assert got == BLOCK_BYTES
                check_block(k, view)
                checked += 1
        for w in writers:
            assert w.wait(60) == 0
        # Still right once the writers stopped, read by a fresh session too.
        for k in range(KEYS):
            if client.get_into(NS, f"key{k}", buf) is not None:
                check_block(k, view)
    assert checked > 500, (checked, counts)
    # The directory served many reads, and some fell back (changed or gone).
    assert counts["direct"] > 200, counts
    assert counts["fallback"] > 0, counts


def test_hits_reach_the_daemon_and_off_switches_work(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="32MiB")
    data = os.urandom(256 << 10)
    buf = bytearray(len(data))
    with kvtier.Client(daemon.target) as client:
        client.put_from(NS, "k", data)
        arena = client._shared_arena()
        assert arena is not None and arena.directory is not None
        counts = counting(arena.directory)
        before = client.stats().hits
        for _ in range(HITS_BATCH):
            assert client.get_into(NS, "k", buf) == len(data) and buf == data
        assert counts == {"direct": HITS_BATCH, "fallback": 0}
        # Sent with the last of them (no reply awaited): the daemon counts them as hits.
        deadline_s = time.monotonic() + 10
        while client.stats().hits < before + HITS_BATCH and time.monotonic() < deadline_s:
            time.sleep(0.01)
        assert client.stats().hits == before + HITS_BATCH
    # The client's switch: every get acquires.
    with kvtier.Client(daemon.target, direct_reads=False) as client:
        before = client.stats().hits
        assert client.get_into(NS, "k", buf) == len(data) and buf == data
        arena = client._shared_arena()
        assert arena is not None and arena.directory is not None
        assert not arena.directory.enabled
        assert client.stats().hits == before + 1  # counted at once: it was an Acquire


def test_the_daemon_switch_sends_no_directory(start_daemon: StartDaemon, workdir: Path) -> None:
    config = workdir / "kvtier.toml"
    config.write_text("[dram]\ndirect_reads = false\n")
    daemon = start_daemon(dram="32MiB", extra=["--config", str(config)])
    with kvtier.Client(daemon.target) as client:
        client.put_from(NS, "k", b"v" * 5000)
        arena = client._shared_arena()
        assert arena is not None and arena.directory is None
        buf = bytearray(5000)
        assert client.get_into(NS, "k", buf) == 5000 and buf == b"v" * 5000


def test_a_tenant_gets_only_its_own_directory(start_daemon: StartDaemon, workdir: Path) -> None:
    daemon = start_two_tenants(start_daemon, workdir)
    secret = b"SECRET-OF-A" * 1000
    with (
        kvtier.Client(daemon.target, token=TOKENS["a"]) as a,
        kvtier.Client(daemon.target, token=TOKENS["b"]) as b,
    ):
        a.put_from(NS, "k", secret)
        b.put_from(NS, "own", b"b's bytes")
        arena_a, arena_b = a._shared_arena(), b._shared_arena()
        assert arena_a is not None and arena_b is not None
        dir_a, dir_b = arena_a.directory, arena_b.directory
        assert dir_a is not None and dir_b is not None
        # b's mapping is b's directory: a's block is not in it, b's own is.
        words_a, words_b = bytes(dir_a._map), bytes(dir_b._map)
        low, high = key_digest(NS.encode(), b"k")
        digest = struct.pack("<QQ", low, high)
        assert digest in words_a and digest not in words_b
        assert struct.pack("<QQ", *key_digest(NS.encode(), b"own")) in words_b
        # b's get of the same name misses (directory and Acquire both), a's hits directly.
        counts_b = counting(dir_b)
        assert b.get_into(NS, "k", bytearray(len(secret))) is None
        assert counts_b == {"direct": 0, "fallback": 1}
        counts_a = counting(dir_a)
        out = bytearray(len(secret))
        assert a.get_into(NS, "k", out) == len(secret) and out == secret
        assert counts_a == {"direct": 1, "fallback": 0}


async def test_the_async_client_reads_directly_and_reports(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="32MiB")
    blocks = {f"b{i}": os.urandom(100_000 + i) for i in range(HITS_BATCH)}
    async with kvtier.AsyncClient(daemon.target) as client:
        assert await client.put_many(NS, list(blocks.items())) == [True] * len(blocks)
        arena = await client._shared_arena()
        assert arena is not None and arena.directory is not None
        counts = counting(arena.directory)
        before = (await client.stats()).hits
        sinks = [bytearray(200_000) for _ in blocks]
        # One get_many: every block read directly, the last key a miss (acquired).
        sizes = await client.get_many(NS, [*blocks, "missing"], [*sinks, bytearray(1)])
        assert sizes == [len(v) for v in blocks.values()] + [None]
        assert all(s[: len(v)] == v for s, v in zip(sinks, blocks.values(), strict=True))
        assert counts == {"direct": len(blocks), "fallback": 1}
        # The miss's Acquire went after the report, on the same socket.
        deadline_s = time.monotonic() + 10
        while (await client.stats()).hits < before + len(blocks):
            assert time.monotonic() < deadline_s, "the direct hits were not reported"
            await asyncio.sleep(0.01)
        assert (await client.stats()).hits == before + len(blocks)


def test_a_get_many_reports_its_call_and_the_daemon_prices_dram_runs_by_calls(
    start_daemon: StartDaemon,
) -> None:
    """The client reports each get_many's direct reads as one call timed as its caller
    waited (more than its copies: the per-call and per-block work around them), and the
    daemon's plans for DRAM runs price from those calls: after reports of calls that took
    50 ms + 1 ms a block, a 4-block DRAM run is planned at ~54 ms, whatever its copies took."""
    from kvtier._proto import kvtier_pb2 as pb
    from kvtier._session import Op

    daemon = start_daemon(dram="32MiB")
    data = os.urandom(256 << 10)
    keys = [f"call{i}".encode() for i in range(4)]
    with kvtier.Client(daemon.target) as client:
        for key in keys:
            client.put_from(NS, key, data)
        arena = client._shared_arena()
        assert arena is not None and arena.directory is not None
        buffers = [bytearray(len(data)) for _ in keys]
        assert client.get_many(NS, keys, buffers) == [len(data)] * 4
        (report,) = arena.directory.take_hits()
        (call,) = report.calls
        assert (call.blocks, call.bytes) == (4, 4 * len(data))
        assert call.seconds > sum(hit.fetch_seconds for hit in report.hits) > 0
        hits = [pb.DirectHit(key=k, size_bytes=len(data), fetch_seconds=1e-6) for k in keys]
        for blocks in (1, 2, 4, 3) * 2:
            seconds = 0.05 + blocks * 1e-3
            slow = pb.DirectCall(blocks=blocks, bytes=blocks * len(data), seconds=seconds)
            arena.send(Op.HITS, pb.HitsRequest(namespace=NS, hits=hits, calls=[slow]))
        # A call naming more blocks than its report's hits is not those hits': ignored.
        bogus = pb.DirectCall(blocks=5, bytes=5 * len(data), seconds=100.0)
        arena.send(Op.HITS, pb.HitsRequest(namespace=NS, hits=hits, calls=[bogus]))
        plan = client.plan(NS, keys, 16)  # same socket: after the reports
        assert plan.tiers == ["dram"] * 4
        assert plan.run_latency_s + sum(plan.fetch_s) == pytest.approx(0.054, rel=0.05)
