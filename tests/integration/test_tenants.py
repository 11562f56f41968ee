"""Tenants: bearer tokens map to tenants, each with its own arena; nothing crosses over."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._proto import kvtier_pb2_grpc as pb_grpc
from kvtier.keys import hash_token
from tests.conftest import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]
NS = "llama3-8b/bf16-b16"
TOKENS = {"a": "token-of-tenant-a", "b": "token-of-tenant-b"}


def start_two_tenants(start_daemon: StartDaemon, workdir: Path) -> DaemonProcess:
    """A daemon with tenants a (16 MiB arena) and b (8 MiB), each with its TOKENS token."""
    config = workdir / "kvtier.toml"
    config.write_text(
        "[auth.tokens]\n"
        + "".join(f'"{hash_token(tok)}" = "{tenant}"\n' for tenant, tok in TOKENS.items())
        + '[tenants.a]\ndram_capacity_bytes = "16MiB"\n'
        + '[tenants.b]\ndram_capacity_bytes = "8MiB"\n'
    )
    return start_daemon(dram="32MiB", nvme="256MiB", extra=["--config", str(config)])


@pytest.fixture
def daemon(start_daemon: StartDaemon, workdir: Path) -> DaemonProcess:
    return start_two_tenants(start_daemon, workdir)


def test_a_client_of_tenant_b_cannot_read_tenant_a_blocks(daemon: DaemonProcess) -> None:
    secret = b"SECRET-PROMPT-OF-A" + os.urandom(1 << 20)
    with (
        kvtier.Client(daemon.target, token=TOKENS["a"]) as a,
        kvtier.Client(daemon.target, token=TOKENS["b"]) as b,
    ):
        assert a.put_from(NS, "k", secret) is True
        for i in range(3):
            a.put(NS, f"more{i}", secret + bytes([i]))  # also through the gRPC path
        # b names the same namespace and key: a miss, on every path.
        assert b.get(NS, "k") is None
        assert b.get_into(NS, "k", bytearray(2 << 20)) is None
        assert b.lookup(NS, ["k", "more0"]).tiers == [None, None]
        assert b.stat(NS, "k") is None
        assert list(b.list()) == []
        assert b.snapshot().blocks == [] and b.snapshot(NS).blocks == []
        assert b.delete(NS, "k") is False
        # b's mapping is b's own arena: a different size, and none of a's bytes in it.
        b.put_from(NS, "own", b"b's bytes")
        arena_b, arena_a = b._shared_arena(), a._shared_arena()
        assert arena_b is not None and arena_a is not None
        assert len(arena_b.view) == 8 << 20 and len(arena_a.view) == 16 << 20
        assert bytes(arena_b.view).find(b"SECRET-PROMPT-OF-A") == -1
        assert bytes(arena_a.view).find(b"SECRET-PROMPT-OF-A") != -1
        # a still has its block, and b's same-named put did not touch it.
        b.put(NS, "k", b"b wrote k")
        assert a.get(NS, "k") == secret and b.get(NS, "k") == b"b wrote k"
        assert sorted(s.key for s in a.list(NS)) == [b"k", b"more0", b"more1", b"more2"]


def test_a_session_cannot_be_used_by_another_tenant(daemon: DaemonProcess) -> None:
    def md(tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {TOKENS[tenant]}"),)

    with grpc.insecure_channel(daemon.target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        session = stub.Attach(pb.AttachRequest(), metadata=md("a"))
        with pytest.raises(grpc.RpcError) as info:
            stub.Acquire(
                pb.AcquireRequest(session_id=session.session_id, namespace=NS, keys=[b"k"]),
                metadata=md("b"),
            )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        ok = stub.Acquire(
            pb.AcquireRequest(session_id=session.session_id, namespace=NS, keys=[b"k"]),
            metadata=md("a"),
        )
        assert ok.blocks[0].found is False


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_wrong_token_is_unauthenticated(
    daemon: DaemonProcess, token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVTIER_TOKEN", raising=False)
    with kvtier.Client(daemon.target, token=token) as client:
        for call in (
            lambda: client.get(NS, "k"),
            lambda: client.put(NS, "k", b"v"),
            lambda: client.lookup(NS, ["k"]),
            lambda: list(client.list()),
        ):
            with pytest.raises(kvtier.KVTierError) as info:
                call()
            assert type(info.value).__name__ == "Unauthenticated"
            assert "token" in str(info.value)
        # Zero-copy falls back to the byte path, which is refused the same way.
        with pytest.raises(kvtier.KVTierError, match="token"):
            client.get_into(NS, "k", bytearray(8))
    # The health service stays open for probes.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(daemon.target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_token_from_the_environment_and_the_cli(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys

    monkeypatch.setenv("KVTIER_TOKEN", TOKENS["a"])
    with kvtier.Client(daemon.target) as a:
        a.put(NS, "env", b"from env")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "get",
            "--target",
            daemon.target,
            "--token",
            TOKENS["a"],
            NS,
            "env",
        ],
        capture_output=True,
        timeout=60,
    )
    assert out.stdout == b"from env"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "get",
            "--target",
            daemon.target,
            "--token",
            TOKENS["b"],
            NS,
            "env",
        ],
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 1  # a miss for tenant b


def test_config_refuses_tokens_for_tenants_without_an_arena(tmp_path: Path) -> None:
    from kvtier.config import load_config
    from kvtier.errors import ConfigError

    path = tmp_path / "kvtier.toml"
    path.write_text(f'[auth.tokens]\n"{hash_token("t")}" = "ghost"\n')
    with pytest.raises(ConfigError, match=r"\[tenants.ghost\]"):
        load_config(path, environ={})
    path.write_text('[auth.tokens]\n"plain-token-not-a-hash" = "a"\n')
    with pytest.raises(ConfigError, match="sha256"):
        load_config(path, environ={})
