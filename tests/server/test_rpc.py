"""Handlers run through kvtier.server.rpc, called over a real grpc.aio channel: each
exception ends the call with its documented status, unary or mid-stream; anything else is
INTERNAL without its text; a cancelled call is neither answered nor logged as an error."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvtier.engine.telemetry import Telemetry
from kvtier.errors import INTERNAL_MESSAGE, KVTierError, RateLimited
from kvtier.server import rpc
from tests.test_errors import DOCUMENTED, make

SERVICE = "kvtier.test.Raise"
ERRORS: dict[str, type[KVTierError]] = {cls.__name__: cls for cls, _ in DOCUMENTED}
MESSAGE = "fix the namespace"


class Handlers:
    """Raw-bytes handlers: the request names the exception class to raise."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.entered = asyncio.Event()

    async def Unary(self, request: bytes, context: rpc.Ctx) -> bytes:
        name = request.decode()
        if name == "RuntimeError":
            raise RuntimeError("tenant acme's key b'secret'")
        raise make(ERRORS[name], MESSAGE)

    async def Stream(self, request: bytes, context: rpc.Ctx) -> AsyncGenerator[bytes, None]:
        yield b"first"
        await self.Unary(request, context)

    async def Hang(self, request: bytes, context: rpc.Ctx) -> bytes:
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            if request == b"and-fail":  # a cleanup that fails while the call unwinds
                raise RuntimeError("cleanup failed") from None
            raise
        return b""


@pytest.fixture
async def call(tmp_path: Path) -> AsyncIterator[tuple[grpc.aio.Channel, Handlers, Telemetry]]:
    handlers, telemetry = Handlers(), Telemetry()
    server = grpc.aio.server()
    methods = {
        "Unary": grpc.unary_unary_rpc_method_handler(rpc.unary(telemetry, "Unary", handlers.Unary)),
        "Hang": grpc.unary_unary_rpc_method_handler(rpc.unary(telemetry, "Hang", handlers.Hang)),
        "Stream": grpc.unary_stream_rpc_method_handler(
            rpc.stream(telemetry, "Stream", handlers.Stream)
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    target = f"unix:{tmp_path / 'rpc.sock'}"
    server.add_insecure_port(target)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            yield channel, handlers, telemetry
    finally:
        await server.stop(None)


async def failure(pending: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await pending
    return caught.value


async def counted(telemetry: Telemetry) -> dict[tuple[str, str], int]:
    """The request counts once the call is counted: the status reaches the client before
    the server's handler has unwound to the counting."""
    for _ in range(100):
        if telemetry.requests:
            break
        await asyncio.sleep(0.01)
    return dict(telemetry.requests)


def retry_hint(err: grpc.aio.AioRpcError) -> list[tuple[str, str | bytes]]:
    return [(k, v) for k, v in (err.trailing_metadata() or ()) if k == "retry-after-ms"]


@pytest.mark.parametrize(("cls", "code"), DOCUMENTED, ids=[c.__name__ for c, _ in DOCUMENTED])
async def test_a_unary_call_ends_with_the_documented_status(
    call: tuple[grpc.aio.Channel, Handlers, Telemetry],
    cls: type[KVTierError],
    code: grpc.StatusCode,
) -> None:
    channel, _, telemetry = call
    err = await failure(channel.unary_unary(f"/{SERVICE}/Unary")(cls.__name__.encode()))
    assert (err.code(), err.details()) == (code, MESSAGE)
    assert retry_hint(err) == ([("retry-after-ms", "250")] if cls is RateLimited else [])
    assert await counted(telemetry) == {("Unary", code.name): 1}


@pytest.mark.parametrize(("cls", "code"), DOCUMENTED, ids=[c.__name__ for c, _ in DOCUMENTED])
async def test_a_stream_that_fails_midway_ends_with_the_documented_status(
    call: tuple[grpc.aio.Channel, Handlers, Telemetry],
    cls: type[KVTierError],
    code: grpc.StatusCode,
) -> None:
    channel, _, telemetry = call
    responses = channel.unary_stream(f"/{SERVICE}/Stream")(cls.__name__.encode())
    assert await responses.read() == b"first"
    err = await failure(responses.read())
    assert (err.code(), err.details()) == (code, MESSAGE)
    assert retry_hint(err) == ([("retry-after-ms", "250")] if cls is RateLimited else [])
    assert await counted(telemetry) == {("Stream", code.name): 1}


@pytest.mark.parametrize("method", ["Unary", "Stream"])
async def test_an_unexpected_exception_is_internal_logged_once_and_its_text_not_sent(
    call: tuple[grpc.aio.Channel, Handlers, Telemetry],
    method: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    channel, _, telemetry = call
    with caplog.at_level(logging.ERROR):
        if method == "Unary":
            err = await failure(channel.unary_unary(f"/{SERVICE}/Unary")(b"RuntimeError"))
        else:
            responses = channel.unary_stream(f"/{SERVICE}/Stream")(b"RuntimeError")
            assert await responses.read() == b"first"
            err = await failure(responses.read())
    assert (err.code(), err.details()) == (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
    assert "secret" not in (err.details() or "")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.name for r in errors] == ["kvtier.server.rpc"]
    assert errors[0].exc_info is not None and isinstance(errors[0].exc_info[1], RuntimeError)
    assert await counted(telemetry) == {(method, "INTERNAL"): 1}


@pytest.mark.parametrize("request_bytes", [b"plain", b"and-fail"])
async def test_a_cancelled_call_is_not_answered_or_logged_as_an_error(
    call: tuple[grpc.aio.Channel, Handlers, Telemetry],
    request_bytes: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    channel, handlers, telemetry = call
    with caplog.at_level(logging.DEBUG):
        pending = channel.unary_unary(f"/{SERVICE}/Hang")(request_bytes)
        await asyncio.wait_for(handlers.entered.wait(), 5)
        pending.cancel()
        await asyncio.wait_for(handlers.cancelled.wait(), 5)
        with pytest.raises(asyncio.CancelledError):
            await pending
        await asyncio.sleep(0.05)  # the server task finishes unwinding
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # Counted, but never as a status the handler chose.
    assert await counted(telemetry) == {("Hang", "UNKNOWN"): 1}
