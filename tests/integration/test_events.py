"""Residency events of a real daemon, as a router follows them (kvtier.client.events)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import kvtier
from kvtier.client.events import BlockIndex
from tests.conftest import DaemonProcess, block_bytes

StartDaemon = Callable[..., DaemonProcess]
NS = "llama3-8b/bf16-b16"
BLOCK = 1 << 20


def held(client: kvtier.Client) -> dict[tuple[str, bytes], list[str]]:
    """What the node holds, by the List RPC: the truth an index must match."""
    return {(b.namespace, b.key): b.tiers for b in client.list()}


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the index did not catch up"
        time.sleep(0.02)


class Follower:
    """BlockIndex.follow on a thread, for as long as a `with` block lasts."""

    def __init__(self, index: BlockIndex, target: str) -> None:
        self.index, self.client = index, kvtier.Client(target)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=index.follow, args=(self.client, self.stop, 0.2))

    def __enter__(self) -> BlockIndex:
        self.thread.start()
        return self.index

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        self.client.close()
        assert not self.thread.is_alive()


def test_an_index_follows_puts_demotions_deletes_resumes_and_restarts(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon(dram="8MiB", nvme="256MiB")  # 8 blocks of DRAM: the rest demote
    keys = [f"b{i}".encode() for i in range(20)]
    index = BlockIndex(NS)
    with daemon.client() as client:
        client.put(NS, b"before", block_bytes(0, BLOCK))
        with Follower(index, daemon.target):
            wait_until(lambda: index.epoch != "")
            assert index.blocks == {(NS, b"before"): ["dram"]}  # from the snapshot
            for i, key in enumerate(keys):
                client.put(NS, key, block_bytes(i, BLOCK))
            client.delete(NS, keys[3])
            # Compared again on each try: a demotion may land after the put is answered.
            wait_until(lambda: index.blocks == held(client))
            assert {"dram", "nvme"} <= {t for tiers in index.blocks.values() for t in tiers}
        # Disconnected: changes made meanwhile reach it when it resumes, without a resync.
        seq_before = index.seq
        for key in keys[:5]:
            client.delete(NS, key)
        client.put(NS, b"after", block_bytes(99, BLOCK))
        assert client.get(NS, keys[10]) is not None  # a read that promotes nothing (gRPC)
        with Follower(index, daemon.target):
            wait_until(lambda: index.blocks == held(client))
        assert index.resyncs == 0 and index.seq > seq_before
        assert index.prefix_blocks(NS, [b"before", b"after", keys[0]]) == 2
        assert index.chain_tiers(NS, [b"after", keys[0], keys[19]]) == [
            client.lookup(NS, [k]).tiers[0] for k in (b"after", keys[0], keys[19])
        ]
    # A restart (DRAM written out, served from NVMe): the old epoch cannot resume; the
    # index resyncs from a snapshot and matches the node again.
    daemon.restart()
    with daemon.client() as client, Follower(index, daemon.target):
        wait_until(lambda: index.blocks == held(client) and index.resyncs == 1)
        assert index.blocks and all(tiers == ["nvme"] for tiers in index.blocks.values())


def test_a_watch_sees_only_its_namespace_and_ends_when_the_daemon_stops(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon()
    with daemon.client() as client:
        stream = client.watch_events("mine/ns")
        first = next(stream)
        assert first.events == [] and first.epoch and not first.resync
        client.put("other/ns", b"k", b"x")
        client.put("mine/ns", b"k", b"y")
        batch = next(stream)
        assert [(e.namespace, e.key, e.tiers) for e in batch.events] == [
            ("mine/ns", b"k", ["dram"])
        ]
        started = time.monotonic()
        daemon.terminate()
        assert list(stream) == []  # the stream ends, it does not hang the stop
        assert time.monotonic() - started < 10


async def test_the_async_client_snapshots_and_resumes(start_daemon: StartDaemon) -> None:
    daemon = start_daemon()
    async with kvtier.AsyncClient(daemon.target) as client:
        await client.put(NS, b"a", b"1")
        snap = await client.snapshot(NS)
        assert [(b.key, b.tiers) for b in snap.blocks] == [(b"a", ["dram"])]
        await client.put(NS, b"b", b"2")
        await client.delete(NS, b"a")
        stream = client.watch_events(NS, snap.epoch, snap.seq)
        batch = await stream.__anext__()
        assert [(e.key, e.tiers) for e in batch.events] == [(b"b", ["dram"]), (b"a", [])]
        await stream.aclose()
