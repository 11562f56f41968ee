"""A hostile tenant holding gRPC calls open (issue 28, item 2): hundreds of WatchEvents
streams it never reads, Put streams that send a header and stall, while a victim tenant's
gets are timed. The attacker must be refused past its own caps (limits.max_calls_per_tenant,
limits.max_watchers_per_tenant), its stalled puts ended after limits.stream_idle_s with the
DRAM they reserved freed, and everything it held given back once it goes away.

The attacker speaks raw gRPC (kvtier.Client would read its streams); each of its channels
gets its own connection, so the per-connection stream limit (128) does not cap it first."""

from __future__ import annotations

import collections
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.keys import hash_token
from tests.conftest import DaemonProcess, block_bytes
from tests.faults.harness import Report, Row, Shadow, check_all, still_serves, wait_for

StartDaemon = Callable[..., DaemonProcess]
NS = "faults/hostile-rpc"
TOKENS = {"victim": "victim-token-4711", "attacker": "attacker-token-0815"}
CALLS_PER_TENANT = 32
WATCHERS_PER_TENANT = 8


def start_pair(start_daemon: StartDaemon, workdir: Path, limits: str) -> DaemonProcess:
    """A daemon with two tenants, 8 MiB of DRAM each, and `limits` (TOML lines)."""
    config = workdir / "hostile.toml"
    config.write_text(
        "[auth.tokens]\n"
        + "".join(f'"{hash_token(t)}" = "{n}"\n' for n, t in TOKENS.items())
        + "[limits]\n"
        + f"max_calls_per_tenant = {CALLS_PER_TENANT}\n"
        + f"max_watchers_per_tenant = {WATCHERS_PER_TENANT}\n"
        + limits
        + '[tenants.victim]\ndram_capacity_bytes = "8MiB"\nnvme_capacity_bytes = "64MiB"\n'
        + '[tenants.attacker]\ndram_capacity_bytes = "8MiB"\nnvme_capacity_bytes = "64MiB"\n'
    )
    return start_daemon(dram="16MiB", nvme="128MiB", extra=["--config", str(config)])


class Attacker:
    """Raw stubs of the attacker tenant over `connections` separate connections."""

    def __init__(
        self, target: str, connections: int, options: tuple[tuple[str, int], ...] = ()
    ) -> None:
        # A local subchannel pool per channel: otherwise channels to one target share a
        # connection, and HTTP/2's stream limit would queue the attack in the client.
        own = (("grpc.use_local_subchannel_pool", 1), *options)
        self.channels = [grpc.insecure_channel(target, options=own) for _ in range(connections)]
        self.stubs = [pb_grpc.KVTierStub(c) for c in self.channels]
        self.metadata = [("authorization", f"Bearer {TOKENS['attacker']}")]
        self._opened = 0

    def stub(self) -> pb_grpc.KVTierStub:
        self._opened += 1
        return self.stubs[self._opened % len(self.stubs)]

    def watch(self, timeout_s: float | None = None) -> grpc.Call:
        """A WatchEvents stream that is never read."""
        return self.stub().WatchEvents(  # type: ignore[no-any-return]
            pb.WatchEventsRequest(), metadata=self.metadata, timeout=timeout_s
        )

    def stalled_put(self, key: str, size_bytes: int, release: threading.Event) -> grpc.Future:
        """A Put that sends its header, then nothing until `release` is set."""

        def messages() -> Iterator[pb.PutRequest]:
            yield pb.PutRequest(
                header=pb.PutHeader(namespace=NS, key=key.encode(), size_bytes=size_bytes)
            )
            release.wait()

        return self.stub().Put.future(messages(), metadata=self.metadata)  # type: ignore[no-any-return]

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def refused(calls: list[grpc.Call] | list[grpc.Future]) -> list[grpc.Call]:
    return [c for c in calls if c.done()]  # type: ignore[misc]


def latency_ms(
    victim: kvtier.Client, keys: list[str], shadow: Shadow, row: Row
) -> tuple[float, float, int]:
    """p50 and p99 (ms) of one get of each key, and how many failed."""
    times_s, failures = [], 0
    for key in keys:
        started_s = time.perf_counter()
        try:
            got = victim.get(NS, key)
        except kvtier.KVTierError:
            failures += 1
            got = None
        times_s.append(time.perf_counter() - started_s)
        shadow.check(row, NS, key, got)
    cuts = statistics.quantiles(times_s, n=100)
    return cuts[49] * 1e3, cuts[98] * 1e3, failures


def eventually(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Whether `predicate` came to hold within `timeout_s` (polled, as wait_for)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def dram_used_bytes(client: kvtier.Client) -> int:
    used: int = client.stats()["tiers"]["dram"]["used_bytes"]
    return used


def open_fds(daemon: DaemonProcess) -> int:
    assert daemon.proc is not None
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def victim_set(victim: kvtier.Client, shadow: Shadow) -> list[str]:
    keys = []
    for i in range(40):  # 2.5 MiB: well inside the victim's arena
        data = block_bytes(31_000 + i, 64 << 10)
        victim.put(NS, f"v{i}", data)
        shadow.put(NS, f"v{i}", data, acknowledged=True)
        keys.append(f"v{i}")
    return keys


def within_normal(during: tuple[float, float, int], alone: tuple[float, float, int]) -> bool:
    # Loose enough for a noisy 2-core box (p99 of 40 gets is about their slowest: one
    # scheduling hiccup of 200 ms was seen), far below what a starved victim sees: every
    # call refused, or queued until its 5 s deadline.
    return (
        during[2] == 0
        and during[0] < max(5 * alone[0], 50.0)
        and during[1] < max(5 * alone[1], 1000.0)
    )


def details(call: grpc.Call) -> str:
    return f"{call.code().name}: {call.details()}"


def test_idle_watchers_and_stalled_calls_do_not_starve_another_tenant(
    start_daemon: StartDaemon, workdir: Path, report: Report
) -> None:
    row = report.row(
        "tenant holding idle streams (watchers, stalled puts)",
        f"raw gRPC over 4 connections: 300 WatchEvents never read and 40 Put streams "
        f"stalled after the header, against max_calls_per_tenant={CALLS_PER_TENANT}, "
        f"max_watchers_per_tenant={WATCHERS_PER_TENANT}; victim gets timed during",
    )
    # Stalled puts must stay stalled while the victim is measured: a long idle limit here
    # (test_stalled_put_streams_are_ended_and_their_dram_freed covers it).
    daemon = start_pair(start_daemon, workdir, "stream_idle_s = 120\n")
    shadow = Shadow()
    put_bytes = 64 << 10
    with daemon.client(token=TOKENS["victim"], timeout_s=5) as victim:
        keys = victim_set(victim, shadow)
        alone = latency_ms(victim, keys, shadow, row)
        dram_before = dram_used_bytes(victim)
        fds_before = open_fds(daemon)
        attacker = Attacker(daemon.target, connections=4)
        release = threading.Event()
        try:
            watchers = [attacker.watch() for _ in range(300)]
            puts = [attacker.stalled_put(f"stall{i}", put_bytes, release) for i in range(40)]
            row.injected = len(watchers) + len(puts)
            admitted = CALLS_PER_TENANT - WATCHERS_PER_TENANT
            # In place once every call past the caps is refused and the admitted puts hold
            # their DRAM. Without the caps that never happens: the victim is timed anyway
            # (after a bounded wait), so that a failure shows what it suffered.
            in_place = eventually(
                lambda: (
                    len(refused(watchers)) == 300 - WATCHERS_PER_TENANT
                    and len(refused(puts)) == 40 - admitted
                    and dram_used_bytes(victim) == dram_before + admitted * put_bytes
                ),
                timeout_s=20,
            )
            during = latency_ms(victim, keys, shadow, row)
            fresh = block_bytes(32_000, 64 << 10)
            try:
                victim.put(NS, "during", fresh)
                shadow.put(NS, "during", fresh, acknowledged=True)
                victim_put = "ok"
            except kvtier.KVTierError as err:
                shadow.put(NS, "during", fresh, acknowledged=False)
                victim_put = f"failed: {err}"
            # Which calls ended while the attack stood (before its channels close).
            watchers_refused, puts_refused = refused(watchers), refused(puts)
            codes = collections.Counter(c.code().name for c in watchers_refused + puts_refused)
        finally:
            release.set()
            attacker.close()
        row.notes.append(
            f"victim get p50/p99 {alone[0]:.2f}/{alone[1]:.2f} ms alone, "
            f"{during[0]:.2f}/{during[1]:.2f} ms during the attack ({during[2]} of "
            f"{len(keys)} failed), victim put {victim_put}; attacker calls ended: "
            f"{dict(codes)} (expected {300 - WATCHERS_PER_TENANT} watchers and "
            f"{40 - admitted} puts refused RESOURCE_EXHAUSTED)"
        )
        assert within_normal(during, alone) and victim_put == "ok", row.notes[-1]
        assert in_place, row.notes[-1]
        for call in watchers_refused:
            assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, details(call)
            assert (
                f"limits.max_watchers_per_tenant ({WATCHERS_PER_TENANT}) WatchEvents "
                "streams open for tenant attacker" in call.details()
            ), details(call)
        for put in puts_refused:
            err = put.exception()
            assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert (
                f"limits.max_calls_per_tenant ({CALLS_PER_TENANT}) calls in flight for "
                "tenant attacker" in err.details()
            ), err.details()
        # The attacker gone: its reservations are freed and its slots are back, all of
        # them — it can open exactly its cap of watchers again, and not one more.
        wait_for(
            lambda: dram_used_bytes(victim) == dram_before + len(fresh),
            "the attacker's stalled puts kept their DRAM after it disconnected",
        )
        again = Attacker(daemon.target, connections=1)
        try:
            reopened = []
            for _ in range(WATCHERS_PER_TENANT):
                reopened.append(_admitted_watcher(again))
            extra = again.watch()
            with pytest.raises(grpc.RpcError) as caught:
                next(extra)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with kvtier.Client(daemon.target, token=TOKENS["attacker"]) as attacker_client:
                assert still_serves(attacker_client)
        finally:
            again.close()
        wait_for(
            lambda: open_fds(daemon) <= fds_before + 1,
            f"the daemon kept the attacker's connections ({open_fds(daemon)} fds, "
            f"{fds_before} before)",
        )
        check_all(row, victim, shadow, must_survive={*keys, "during"})
        row.serving = still_serves(victim)
    row.assert_ok()


def _admitted_watcher(attacker: Attacker) -> grpc.Call:
    """A watcher that got its first message; the attacker's old slots may take a moment
    to be given back (its connections' ends reach the daemon asynchronously)."""
    admitted: list[grpc.Call] = []

    def try_once() -> bool:
        call = attacker.watch()
        try:
            next(call)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            return False
        admitted.append(call)
        return True

    wait_for(try_once, "the attacker's watcher slots were not given back after it left")
    return admitted[0]


def test_stalled_put_streams_are_ended_and_their_dram_freed(
    start_daemon: StartDaemon, workdir: Path, report: Report
) -> None:
    row = report.row(
        "put streams stalled after the header",
        "raw gRPC: 20 Put streams of 256 KiB send a header and nothing more "
        "(limits.stream_idle_s=1); victim puts and gets timed meanwhile",
    )
    idle_s = 1.0
    daemon = start_pair(start_daemon, workdir, f"stream_idle_s = {idle_s}\n")
    shadow = Shadow()
    put_bytes = 256 << 10
    with daemon.client(token=TOKENS["victim"], timeout_s=5) as victim:
        keys = victim_set(victim, shadow)
        alone = latency_ms(victim, keys, shadow, row)
        dram_before = dram_used_bytes(victim)
        attacker = Attacker(daemon.target, connections=2)
        release = threading.Event()
        try:
            started_s = time.monotonic()
            puts = [attacker.stalled_put(f"stall{i}", put_bytes, release) for i in range(20)]
            row.injected = len(puts)
            wait_for(
                lambda: dram_used_bytes(victim) >= dram_before + len(puts) * put_bytes,
                "the stalled puts did not reserve their DRAM",
            )
            during = latency_ms(victim, keys, shadow, row)
            fresh = block_bytes(32_000, 64 << 10)
            victim.put(NS, "during", fresh)
            shadow.put(NS, "during", fresh, acknowledged=True)
            ended_s = []
            for put in puts:
                err = put.exception(timeout=30)
                ended_s.append(time.monotonic() - started_s)
                assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
                assert "limits.stream_idle_s" in err.details(), err.details()
        finally:
            release.set()
            attacker.close()
        row.notes.append(
            f"victim get p50/p99 {alone[0]:.2f}/{alone[1]:.2f} ms alone, "
            f"{during[0]:.2f}/{during[1]:.2f} ms while the puts stalled ({during[2]} failed); "
            f"stalled puts ended DEADLINE_EXCEEDED after {min(ended_s):.2f}-{max(ended_s):.2f} s"
        )
        assert within_normal(during, alone), row.notes[-1]
        assert min(ended_s) >= idle_s * 0.9, row.notes[-1]
        # What they reserved is freed: DRAM as before, plus the victim's one put.
        wait_for(
            lambda: dram_used_bytes(victim) == dram_before + len(fresh),
            f"the stalled puts' DRAM was not freed ({dram_used_bytes(victim)} bytes used, "
            f"{dram_before + len(fresh)} expected)",
        )
        # The limit is on silence, not on a stream's length: a put that keeps sending,
        # slower in total than stream_idle_s, is stored.
        slow = block_bytes(33_000, 4 * (64 << 10))

        def paced() -> Iterator[pb.PutRequest]:
            yield pb.PutRequest(
                header=pb.PutHeader(namespace=NS, key=b"paced", size_bytes=len(slow))
            )
            for start in range(0, len(slow), 64 << 10):
                time.sleep(idle_s / 2)
                yield pb.PutRequest(chunk=slow[start : start + (64 << 10)])

        with grpc.insecure_channel(daemon.target) as channel:
            stub = pb_grpc.KVTierStub(channel)
            stub.Put(paced(), metadata=[("authorization", f"Bearer {TOKENS['attacker']}")])
        with kvtier.Client(daemon.target, token=TOKENS["attacker"]) as attacker_client:
            assert attacker_client.get(NS, "paced") == slow
            assert still_serves(attacker_client)
        check_all(row, victim, shadow, must_survive={*keys, "during"})
        row.serving = still_serves(victim)
    row.assert_ok()


def test_a_watcher_that_never_reads_is_bounded(
    start_daemon: StartDaemon, workdir: Path, report: Report
) -> None:
    row = report.row(
        "WatchEvents stream never read while its tenant's blocks churn",
        "raw gRPC watcher not read while its tenant makes 3000 block changes with long "
        "keys (limits.event_backlog=64); then read",
    )
    daemon = start_pair(start_daemon, workdir, "event_backlog = 64\n")
    shadow = Shadow()
    with daemon.client(token=TOKENS["victim"], timeout_s=5) as victim:
        keys = victim_set(victim, shadow)
        # No window growth (BDP probing off): the client's 64 KiB stream window fills and
        # the daemon's writes to the watcher block, as they do for any client that stops
        # reading (one that grows its window without reading holds the events itself).
        attacker = Attacker(daemon.target, connections=1, options=(("grpc.http2.bdp_probe", 0),))
        try:
            watcher = attacker.watch(timeout_s=120)  # a bug makes it fail, not hang
            assert not next(watcher).resync  # registered
            long_ns = NS + "/" + "n" * 200
            with kvtier.Client(daemon.target, token=TOKENS["attacker"]) as churn:
                for i in range(3000):
                    churn.put(long_ns, f"{i:08d}" + "k" * 100, b"x")
                    row.injected += 1
            events, resync = 0, False
            for message in watcher:
                events += len(message.events)
                if message.resync:
                    resync = True
                    break
        finally:
            attacker.close()
        row.notes.append(f"the unread watcher got {events} of 3000 events, then resync={resync}")
        # What reached it is what the transport had buffered plus at most the backlog:
        # the rest was dropped for a resync, not queued in the daemon.
        assert resync and events < 3000, row.notes[-1]
        check_all(row, victim, shadow, must_survive=set(keys))
        row.serving = still_serves(victim)
    row.assert_ok()


def test_the_caps_follow_a_reload(start_daemon: StartDaemon, workdir: Path) -> None:
    """[limits] reloads on SIGHUP: the new caps and idle limit apply to the next calls."""
    daemon = start_pair(start_daemon, workdir, "")
    config = workdir / "hostile.toml"
    attacker = Attacker(daemon.target, connections=1)
    try:
        held = [attacker.watch() for _ in range(3)]
        for call in held:
            assert not next(call).resync  # admitted under max_watchers_per_tenant = 8
        config.write_text(
            config.read_text().replace(
                f"max_watchers_per_tenant = {WATCHERS_PER_TENANT}\n",
                "max_watchers_per_tenant = 3\nstream_idle_s = 0.5\n",
            )
        )
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded limits." in daemon.log(), "the daemon did not reload")
        with pytest.raises(grpc.RpcError) as caught:
            next(attacker.watch())
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limits.max_watchers_per_tenant (3)" in caught.value.details()
        put = attacker.stalled_put("idle", 4096, threading.Event())
        err = put.exception(timeout=30)
        assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
        assert "0.5 s (limits.stream_idle_s)" in err.details()
    finally:
        attacker.close()
