"""Runs gRPC handlers so that an exception they raise ends the call with its status.

Every method of the service is registered through `unary` or `stream`; the handlers
themselves just raise kvtier.errors exceptions and never call `context.abort`. The status
comes from `answer` (kvtier.errors.to_status), which the session socket uses too.

What is not turned into a status: cancellation (the client left or its deadline passed;
gRPC ends the call and there is nobody to tell) and grpc's own errors (an abort already
sent, a server that is stopping), which gRPC handles itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, NoReturn

import grpc

from kvtier._wire import Undecodable
from kvtier.engine.telemetry import Telemetry
from kvtier.errors import InvalidArgument, KVTierError, Status, to_status

Ctx = grpc.aio.ServicerContext[Any, Any]
UnaryHandler = Callable[[Any, Ctx], Awaitable[Any]]
StreamHandler = Callable[[Any, Ctx], AsyncGenerator[Any, None]]

logger = logging.getLogger(__name__)


def answer(where: str, err: Exception) -> Status:
    """`err`'s status; an exception that is not kvtier's is a bug, so its traceback is
    logged here, the one place that sees it (the caller only gets INTERNAL)."""
    if not isinstance(err, KVTierError):
        logger.error("%s raised %s; answered INTERNAL", where, type(err).__name__, exc_info=err)
    return to_status(err)


async def _end(name: str, context: Ctx, err: Exception) -> NoReturn:
    """End the call with `err`'s status; re-raise what is not the handler's to answer."""
    if isinstance(err, grpc.aio.BaseError):
        raise err
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        # The call is being cancelled and `err` came from unwinding it: the client is gone,
        # so nothing is answered or logged as a failure; the cancellation goes on.
        logger.debug("%s failed while cancelled", name, exc_info=err)
        raise asyncio.CancelledError from err
    status = answer(name, err)
    await context.abort(status.code, status.message, trailing_metadata=status.trailing_metadata)


def _check_decoded(name: str, request: Any) -> None:
    # The tolerant deserializer marks bad bytes instead of raising: a raising one would
    # make gRPC answer UNKNOWN and log a traceback per request.
    if isinstance(request, Undecodable):
        raise InvalidArgument(
            f"the {name} request is not a valid protobuf message ({request.error}): "
            "send bytes serialized from kvtier.v1 messages (strings must be UTF-8)"
        )


def _code_name(context: Ctx, default: grpc.StatusCode) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), default.name)
    return default.name


def unary(telemetry: Telemetry, name: str, handler: UnaryHandler) -> UnaryHandler:
    """`handler` (one response) answering exceptions with their status, each call counted
    by the code it ended with."""

    async def call(request: Any, context: Ctx) -> Any:
        try:
            try:
                _check_decoded(name, request)
                response = await handler(request, context)
            except Exception as err:
                await _end(name, context, err)
        except BaseException:
            telemetry.request(name, _code_name(context, grpc.StatusCode.UNKNOWN))
            raise
        telemetry.request(name, _code_name(context, grpc.StatusCode.OK))
        return response

    return call


def stream(telemetry: Telemetry, name: str, handler: StreamHandler) -> StreamHandler:
    """`handler` (a response stream), as `unary`. A failure after some responses were sent
    still ends the stream with its status."""

    async def call(request: Any, context: Ctx) -> AsyncGenerator[Any, None]:
        try:
            try:
                _check_decoded(name, request)
                # aclosing: a stream the client abandons runs the handler's `finally` (a
                # watcher unregistered, a reader closed) now, not when it is collected.
                async with aclosing(handler(request, context)) as responses:
                    async for response in responses:
                        yield response
            except Exception as err:
                await _end(name, context, err)
        except BaseException:
            telemetry.request(name, _code_name(context, grpc.StatusCode.UNKNOWN))
            raise
        telemetry.request(name, _code_name(context, grpc.StatusCode.OK))

    return call
