"""kvtier.server.rpc's `enter` hook over a real grpc.aio channel: a call past its cap is
refused at once with the cap's message and never reaches its handler, and an admitted
call's slot comes back however the call ends — returned, raised, cancelled while waiting,
or abandoned by a client that stopped reading a stream mid-response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import grpc
import pytest

from kvtier.engine.telemetry import Telemetry
from kvtier.errors import InvalidArgument
from kvtier.server import rpc
from kvtier.server.admission import CallCaps, CallSlots, Slot

SERVICE = "kvtier.test.Admitted"
TENANT = "bob"


class Handlers:
    def __init__(self) -> None:
        self.ran = 0
        self.entered = asyncio.Semaphore(0)  # one release per Hang call that started

    async def Echo(self, request: bytes, context: rpc.Ctx) -> bytes:
        self.ran += 1
        if request == b"fail":
            raise InvalidArgument("bad request")
        return request

    async def Hang(self, request: bytes, context: rpc.Ctx) -> bytes:
        self.entered.release()
        await asyncio.Event().wait()
        return b""

    async def Flood(self, request: bytes, context: rpc.Ctx) -> AsyncGenerator[bytes, None]:
        """1 MiB messages without end: a client that stops reading blocks it in a write."""
        while True:
            yield b"x" * (1 << 20)


@pytest.fixture
async def served(
    tmp_path: Path,
) -> AsyncIterator[tuple[grpc.aio.Channel, Handlers, CallSlots]]:
    handlers, telemetry = Handlers(), Telemetry()
    slots = CallSlots(CallCaps(calls_per_tenant=2, watchers_per_tenant=1, node_calls=10))

    def enter(context: rpc.Ctx) -> Slot:
        return slots.enter(TENANT)

    methods = {
        name: grpc.unary_unary_rpc_method_handler(
            rpc.unary(telemetry, name, getattr(handlers, name), enter)
        )
        for name in ("Echo", "Hang")
    }
    methods["Flood"] = grpc.unary_stream_rpc_method_handler(
        rpc.stream(telemetry, "Flood", handlers.Flood, enter)
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    target = f"unix:{tmp_path / 'rpc.sock'}"
    server.add_insecure_port(target)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            yield channel, handlers, slots
    finally:
        await server.stop(None)


async def all_given_back(slots: CallSlots) -> bool:
    """Whether the slots come back: the status reaches the client before the server's
    task has unwound, so give it a moment (polled, bounded)."""
    for _ in range(500):
        if slots.total == 0 and slots.calls(TENANT) == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_call_that_returns_or_raises_gives_its_slot_back(
    served: tuple[grpc.aio.Channel, Handlers, CallSlots],
) -> None:
    channel, _, slots = served
    echo = channel.unary_unary(f"/{SERVICE}/Echo")
    for _ in range(5):  # more than the cap of 2, one after another: each gave its slot back
        assert await echo(b"hi") == b"hi"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await echo(b"fail")
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await all_given_back(slots)


async def test_past_the_cap_a_call_is_refused_at_once_and_never_runs(
    served: tuple[grpc.aio.Channel, Handlers, CallSlots],
) -> None:
    channel, handlers, slots = served
    hanging = [channel.unary_unary(f"/{SERVICE}/Hang")(b"") for _ in range(2)]
    for _ in hanging:
        await asyncio.wait_for(handlers.entered.acquire(), 5)
    assert slots.calls(TENANT) == 2
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(channel.unary_unary(f"/{SERVICE}/Echo")(b"hi"), 5)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_calls_per_tenant (2) calls in flight for tenant bob" in (
        caught.value.details() or ""
    )
    assert handlers.ran == 0
    for call in hanging:  # the client gives up: its calls' slots come back
        call.cancel()
    assert await all_given_back(slots)
    assert await channel.unary_unary(f"/{SERVICE}/Echo")(b"hi") == b"hi"


async def test_a_stream_abandoned_mid_response_gives_its_slot_back(
    served: tuple[grpc.aio.Channel, Handlers, CallSlots],
) -> None:
    channel, _, slots = served
    for _ in range(4):  # twice the cap: a slot held by an abandoned stream would show
        flood = channel.unary_stream(f"/{SERVICE}/Flood")(b"")
        assert len(await flood.read()) == 1 << 20
        # The server is now blocked writing into a full flow-control window.
        await asyncio.sleep(0.05)
        flood.cancel()
        assert await all_given_back(slots)


async def test_a_stream_whose_client_disconnects_gives_its_slot_back(tmp_path: Path) -> None:
    handlers, slots = Handlers(), CallSlots(CallCaps(2, 1, 10))
    server = grpc.aio.server()
    method = rpc.stream(Telemetry(), "Flood", handlers.Flood, lambda ctx: slots.enter(TENANT))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE, {"Flood": grpc.unary_stream_rpc_method_handler(method)}
            ),
        )
    )
    target = f"unix:{tmp_path / 'rpc.sock'}"
    server.add_insecure_port(target)
    await server.start()
    try:
        for _ in range(3):
            channel = grpc.aio.insecure_channel(target)
            flood = channel.unary_stream(f"/{SERVICE}/Flood")(b"")
            assert len(await flood.read()) == 1 << 20
            await channel.close()  # the whole connection goes, no cancel first
            assert await all_given_back(slots)
    finally:
        await server.stop(None)
