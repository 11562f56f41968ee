"""Queue prefetch on a real daemon: announced NVMe blocks are promoted before any load asks
for them, kept in DRAM while puts push everything else out, released by a load or when
their hint expires; bad requests are INVALID_ARGUMENT."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from tests.conftest import DaemonProcess, block_bytes

NS = "llama3-8b/prefetch"
StartDaemon = Callable[..., DaemonProcess]
MIB = 1 << 20
HINTED = [f"h{i}".encode() for i in range(4)]


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not exported")


def _tiers(client: kvtier.Client, keys: list[bytes]) -> list[str | None]:
    return list(client.lookup(NS, keys).tiers)


def _fill(client: kvtier.Client, prefix: str, count: int) -> None:
    """Puts enough to push every unprotected block out of a 16 MiB arena."""
    for i in range(count):
        client.put(NS, f"{prefix}{i}", block_bytes(1000 + i, MIB))


def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_announced_blocks_are_promoted_protected_and_released(start_daemon: StartDaemon) -> None:
    port = _port()
    # LRU: without protection the fills below would certainly push the hinted blocks out.
    daemon = start_daemon(
        dram="16MiB",
        nvme="256MiB",
        extra=["--metrics-listen", f"127.0.0.1:{port}"],
        env={"KVTIER_POLICY__NAME": "lru"},
    )
    with daemon.client() as client:
        for i, key in enumerate(HINTED):
            client.put(NS, key, block_bytes(i, MIB))
        _fill(client, "a", 24)
        assert _tiers(client, HINTED) == ["nvme"] * 4, "the fill must demote them first"

        announced = client.prefetch(NS, [HINTED[:2], HINTED], ttl_s=10.0)
        assert announced.accepted_blocks == 6  # two chains: 2 + 4 keys
        assert announced.to_promote == 6 and announced.in_dram == 0
        assert announced.ttl_s == 10.0
        started_s = time.monotonic()
        # Promoted in the background, before any load: Lookup does not count as one.
        _wait_for(lambda: _tiers(client, HINTED) == ["dram"] * 4, "promoted into DRAM")
        assert _metric(port, "kvtier_prefetch_promoted_blocks_total") == 4

        _fill(client, "b", 24)  # 24 MiB more through a 16 MiB arena
        assert _tiers(client, HINTED) == ["dram"] * 4, "protected blocks were evicted"

        # h3 is loaded once: its one hint lets go of it, so the next fill may take it;
        # h0 and h1 are named by both chains, so one load of each does not release them.
        assert client.get(NS, HINTED[3]) == block_bytes(3, MIB)
        assert client.get(NS, HINTED[0]) == block_bytes(0, MIB)
        _fill(client, "c", 24)
        assert _tiers(client, HINTED) == ["dram", "dram", "dram", "nvme"]
        assert time.monotonic() - started_s < 10.0, "too slow to show protection before expiry"
        assert _metric(port, "kvtier_prefetch_used_blocks_total") == 2

        # Past the TTL nothing protects them: the same fill now demotes them all.
        _wait_for(lambda: time.monotonic() - started_s > 10.2, "the hint's TTL", 15.0)
        _fill(client, "d", 24)
        assert _tiers(client, HINTED) == ["nvme"] * 4
        _wait_for(
            lambda: _metric(port, "kvtier_prefetch_expired_blocks_total") == 2,
            "h1 and h2 expired unused",
        )
        # Their bytes came back intact through the promotions and demotions.
        for i, key in enumerate(HINTED):
            assert client.get(NS, key) == block_bytes(i, MIB)


def test_a_block_already_in_dram_is_counted_and_kept(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="16MiB", nvme="256MiB", env={"KVTIER_POLICY__NAME": "lru"})
    with daemon.client() as client:
        client.put(NS, "hot", block_bytes(7, MIB))
        got = client.prefetch(NS, [[b"hot", b"absent"]], ttl_s=30.0)
        assert (got.accepted_blocks, got.in_dram, got.to_promote, got.not_stored) == (2, 1, 0, 1)
        _fill(client, "x", 24)
        assert _tiers(client, [b"hot"]) == ["dram"]
        assert client.prefetch(NS, [[b"hot"]]).ttl_s == 30.0  # limits.prefetch_ttl_s


BAD = [
    ({"chains": [pb.PrefetchChain(keys=[b"k"])], "ttl_s": -1.0}, "ttl_s"),
    ({"chains": [pb.PrefetchChain(keys=[b"k"])], "ttl_s": float("nan")}, "ttl_s"),
    ({"chains": [pb.PrefetchChain(keys=[b"k"])], "ttl_s": 1e9}, "max_prefetch_ttl_s"),
    ({"chains": []}, "at least one chain"),
    ({"chains": [pb.PrefetchChain(keys=[b""])]}, "key"),
    ({"chains": [pb.PrefetchChain(keys=[b"x" * 4096])]}, "key"),
    ({"chains": [pb.PrefetchChain(keys=[b"k%d" % i for i in range(65537)])]}, "max_plan_blocks"),
    ({"namespace": "", "chains": [pb.PrefetchChain(keys=[b"k"])]}, "namespace"),
]


def test_bad_requests_are_invalid_argument_and_harmless(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(dram="16MiB", nvme="64MiB")
    with grpc.insecure_channel(daemon.target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        for fields, message in BAD:
            request = pb.PrefetchRequest(**{"namespace": NS, **fields})  # type: ignore[arg-type]
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefetch(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
            assert message in (err.value.details() or ""), (fields, err.value.details())
        # Nothing was announced by them, and the daemon still answers.
        ok = pb.PrefetchRequest(namespace=NS, chains=[pb.PrefetchChain(keys=[b"k", b"k"])])
        assert stub.Prefetch(ok, timeout=10).accepted_blocks == 1  # a repeated key once
    with daemon.client() as client, pytest.raises(kvtier.InvalidArgument):
        client.prefetch(NS, [[b"k"]], ttl_s=-5.0)


@pytest.mark.vllm
def test_vllm_announces_each_waiting_request_once(
    vllm_python: Path, tiny_model: Path, start_daemon: StartDaemon, workdir: Path
) -> None:
    """The connector announces a request's chain the first time vLLM asks about it
    (however often it asks again): after a restart has moved every block to NVMe, a fresh
    vLLM's requests announce exactly their loadable blocks, and its output is unchanged."""
    from tests.integration.test_vllm import (
        BLOCK_SIZE,
        cached_tokens,
        loadable_tokens,
        make_prompts,
        run_vllm,
    )

    port = _port()
    daemon = start_daemon(
        dram="256MiB", nvme="1GiB", extra=["--metrics-listen", f"127.0.0.1:{port}"]
    )
    prompts = make_prompts(tiny_model)
    stored = run_vllm(vllm_python, tiny_model, prompts, workdir, "store", daemon.target)
    assert _metric(port, "kvtier_prefetch_announced_blocks_total") == sum(
        loadable_tokens(p) // BLOCK_SIZE for p in prompts
    )
    daemon.restart()  # a clean stop writes DRAM out: every block is now on NVMe only
    warm = run_vllm(vllm_python, tiny_model, prompts, workdir, "warm", daemon.target)
    assert cached_tokens(warm) == [loadable_tokens(p) for p in prompts]
    assert _metric(port, "kvtier_prefetch_announced_blocks_total") == sum(
        loadable_tokens(p) // BLOCK_SIZE for p in prompts
    )
    assert [r["token_ids"] for r in warm["results"]] == [r["token_ids"] for r in stored["results"]]
