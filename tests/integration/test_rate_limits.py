"""Per-tenant rate limits on a real daemon: one tenant over its rate, the others unaffected."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.errors import RateLimited, ResourceExhausted
from kvtier.keys import hash_token
from tests.conftest import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]
NS = "llama3-8b/bf16-b16"
TOKENS = {"slow": "token-slow", "free": "token-free", "bytes": "token-bytes"}
# 1 request every 5 s after a burst of 3: a test's few calls never earn a second one.
RATE_PER_S, BURST = 0.2, 3


def _config(workdir: Path, slow_rate_per_s: float) -> Path:
    path = workdir / "kvtier.toml"
    path.write_text(
        "[limits]\n"
        'max_block_bytes = "1MiB"\n'
        "[auth.tokens]\n"
        + "".join(f'"{hash_token(tok)}" = "{tenant}"\n' for tenant, tok in TOKENS.items())
        + "[tenants.slow]\n"
        + 'dram_capacity_bytes = "8MiB"\n'
        + f"requests_per_s = {slow_rate_per_s}\n"
        + f"request_burst = {BURST}\n"
        + '[tenants.free]\ndram_capacity_bytes = "8MiB"\n'
        + '[tenants.bytes]\ndram_capacity_bytes = "8MiB"\n'
        + 'payload_bytes_per_s = "64KiB"\npayload_burst_bytes = "1MiB"\n'
    )
    return path


@pytest.fixture
def daemon(start_daemon: StartDaemon, workdir: Path) -> DaemonProcess:
    config = _config(workdir, RATE_PER_S)
    return start_daemon(dram="8MiB", nvme="64MiB", extra=["--config", str(config)])


def _calls_until_refused(call: Callable[[], object], limit: int = 12) -> tuple[int, Exception]:
    started_s = time.monotonic()
    for done in range(limit):
        try:
            call()
        except ResourceExhausted as err:
            # Never more than the burst and what the rate earned meanwhile.
            assert done <= BURST + RATE_PER_S * (time.monotonic() - started_s)
            return done, err
    raise AssertionError(f"{limit} calls in a row were all admitted")


def test_a_tenant_over_its_rate_is_refused_and_another_is_not(daemon: DaemonProcess) -> None:
    with (
        kvtier.Client(daemon.target, token=TOKENS["slow"]) as slow,
        kvtier.Client(daemon.target, token=TOKENS["free"]) as free,
    ):
        done, err = _calls_until_refused(lambda: slow.lookup(NS, ["k"]))
        assert done >= BURST
        assert isinstance(err, RateLimited)
        assert 0 < err.retry_after_s <= 1 / RATE_PER_S + 0.01
        message = str(err)
        assert "tenant 'slow'" in message and "0.2 requests/s, burst 3" in message
        assert "tenants.slow.requests_per_s" in message and "retry in" in message
        # Every kind of call is counted, and refused alike.
        for call in (lambda: slow.get(NS, "k"), lambda: slow.put(NS, "k", b"v")):
            with pytest.raises(RateLimited):
                call()
        # The other tenant is not slowed down by it.
        for i in range(30):
            assert free.put(NS, f"k{i}", b"v") is True
            assert free.get(NS, f"k{i}") == b"v"


def test_the_refusal_carries_a_retry_hint_in_trailing_metadata(daemon: DaemonProcess) -> None:
    md = (("authorization", f"Bearer {TOKENS['slow']}"),)
    with grpc.insecure_channel(daemon.target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        for _ in range(BURST):
            stub.Lookup(pb.LookupRequest(namespace=NS, keys=[b"k"]), metadata=md)
        with pytest.raises(grpc.RpcError) as info:
            stub.Lookup(pb.LookupRequest(namespace=NS, keys=[b"k"]), metadata=md)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(info.value.trailing_metadata() or ())
    assert 0 < int(trailing["retry-after-ms"]) <= 5000


def test_zero_copy_session_ops_count_against_the_same_rate(daemon: DaemonProcess) -> None:
    # Acquires, not direct reads (a get served from the tenant's directory asks the daemon
    # nothing: docs/design.md, "Direct reads").
    with kvtier.Client(daemon.target, token=TOKENS["slow"], direct_reads=False) as slow:
        # Attach and Reserve are charged; Commit, finishing the put, is not.
        assert slow.put_from(NS, "zc", b"zero-copy bytes") is True
        assert slow._arena is not None  # the session socket, not the gRPC fallback
        sink = bytearray(64)
        done, err = _calls_until_refused(lambda: slow.get_into(NS, "zc", sink))
        assert done == BURST - 2 or done == BURST - 1  # +1 if 5 s passed meanwhile
        assert "tenant 'slow'" in str(err) and "tenants.slow.requests_per_s" in str(err)
        assert slow._arena is not None  # a refusal does not end the session


def test_payload_bytes_per_second(daemon: DaemonProcess) -> None:
    block = bytes(1 << 20)
    with (
        kvtier.Client(daemon.target, token=TOKENS["bytes"]) as heavy,
        kvtier.Client(daemon.target, token=TOKENS["free"]) as free,
    ):
        assert heavy.put(NS, "big", block) is True  # the 1 MiB burst
        with pytest.raises(RateLimited) as info:
            heavy.get(NS, "big")  # another 1 MiB at once: over 64 KiB/s
        assert "block payload rate" in str(info.value)
        assert "tenants.bytes.payload_bytes_per_s" in str(info.value)
        assert info.value.retry_after_s > 10  # ~16 s to earn 1 MiB back
        assert heavy.lookup(NS, ["big"]).prefix_blocks == 1  # moving no bytes: admitted
        assert heavy.get(NS, "absent") is None  # a miss moves no bytes either
        assert free.put(NS, "big", block) is True and free.get(NS, "big") == block


def test_a_reload_lifts_the_limit_without_a_restart(daemon: DaemonProcess, workdir: Path) -> None:
    with kvtier.Client(daemon.target, token=TOKENS["slow"]) as slow:
        _calls_until_refused(lambda: slow.lookup(NS, ["k"]))
        _config(workdir, 0)  # 0: unlimited
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "reloaded" not in daemon.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "tenants.slow.requests_per_s" in daemon.log()
        for _ in range(20):
            slow.lookup(NS, ["k"])


async def test_the_asyncio_client_raises_rate_limited_with_the_hint(
    daemon: DaemonProcess,
) -> None:
    async with kvtier.AsyncClient(daemon.target, token=TOKENS["slow"]) as slow:
        for _ in range(BURST):
            await slow.lookup(NS, ["k"])
        with pytest.raises(RateLimited) as info:
            await slow.lookup(NS, ["k"])
    assert 0 < info.value.retry_after_s <= 1 / RATE_PER_S + 0.01
