"""Both clients, pointed where no daemon listens: one Unavailable that says what to do."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

import kvtier
from kvtier.client._common import translate


def _says_what_to_do(err: kvtier.Unavailable, target: str) -> None:
    message = str(err)
    assert f"no kvtier daemon at {target}" in message
    assert "kvtier serve" in message and "--target" in message
    assert "failed to connect to all addresses" not in message


def test_blocking_client(tmp_path: Path) -> None:
    target = f"unix://{tmp_path}/none.sock"
    with kvtier.Client(target) as client, pytest.raises(kvtier.Unavailable) as err:
        client.get("m/l", b"k")
    _says_what_to_do(err.value, target)


async def test_async_client(tmp_path: Path) -> None:
    target = f"unix://{tmp_path}/none.sock"
    async with kvtier.AsyncClient(target) as client:
        with pytest.raises(kvtier.Unavailable) as err:
            await client.stats()
    _says_what_to_do(err.value, target)


def test_a_draining_daemon_keeps_its_own_message() -> None:
    class Draining(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "the daemon is shutting down; retry on another node"

    err = translate(Draining())
    assert isinstance(err, kvtier.Unavailable) and "shutting down" in str(err)
