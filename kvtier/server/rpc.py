"""Runs gRPC handlers so that an exception they raise ends the call with its status.

Every method of the service is registered through `unary` or `stream`; the handlers
themselves just raise kvtier.errors exceptions and never call `context.abort`. The status
comes from `answer` (kvtier.errors.to_status), which the session socket uses too.

What is not turned into a status: cancellation (the client left or its deadline passed;
gRPC ends the call and there is nobody to tell) and grpc's own errors (an abort already
sent, a server that is stopping), which gRPC handles itself.

Admission: `enter`, when given, is asked before the handler runs (the per-tenant call caps,
kvtier.server.admission); what it raises ends the call like a handler's exception, and
what it returns is released when the call ends, however it ends. A stream the client
abandons mid-response is not always unwound at once (its generator may be finalised
later), so the release is also tied to gRPC's own end of the call (`add_done_callback`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, NoReturn, Protocol

import grpc

from kvtier._wire import Undecodable
from kvtier.engine.telemetry import Telemetry
from kvtier.errors import InvalidArgument, KVTierError, Status, to_status

Ctx = grpc.aio.ServicerContext[Any, Any]
UnaryHandler = Callable[[Any, Ctx], Awaitable[Any]]
StreamHandler = Callable[[Any, Ctx], AsyncGenerator[Any, None]]


class Admitted(Protocol):
    """A call's place (kvtier.server.admission.Slot); `release` may be called twice."""

    def release(self) -> None: ...


Enter = Callable[[Ctx], Admitted]

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


def _admit(enter: Enter | None, context: Ctx) -> Admitted | None:
    if enter is None:
        return None
    admitted = enter(context)
    release = admitted.release
    # The stub types the callback as a nominal class; any callable of the context will do.
    context.add_done_callback(lambda _context: release())  # type: ignore[arg-type]
    return admitted


def unary(
    telemetry: Telemetry, name: str, handler: UnaryHandler, enter: Enter | None = None
) -> UnaryHandler:
    """`handler` (one response) answering exceptions with their status, each call counted
    by the code it ended with; admitted by `enter` first, if given."""

    async def call(request: Any, context: Ctx) -> Any:
        admitted = None
        try:
            try:
                admitted = _admit(enter, context)
                _check_decoded(name, request)
                response = await handler(request, context)
            except Exception as err:
                await _end(name, context, err)
        except BaseException:
            telemetry.request(name, _code_name(context, grpc.StatusCode.UNKNOWN))
            raise
        finally:
            if admitted is not None:
                admitted.release()
        telemetry.request(name, _code_name(context, grpc.StatusCode.OK))
        return response

    return call


def stream(
    telemetry: Telemetry, name: str, handler: StreamHandler, enter: Enter | None = None
) -> StreamHandler:
    """`handler` (a response stream), as `unary`. A failure after some responses were sent
    still ends the stream with its status."""

    async def call(request: Any, context: Ctx) -> AsyncGenerator[Any, None]:
        admitted = None
        try:
            try:
                admitted = _admit(enter, context)
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
        finally:
            if admitted is not None:
                admitted.release()
        telemetry.request(name, _code_name(context, grpc.StatusCode.OK))

    return call
