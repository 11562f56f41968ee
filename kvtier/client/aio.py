"""asyncio client: `kvtier.AsyncClient(target)`, the same calls as `Client`, awaited. Its
calls are kvtier/client/_core.py's operations; this module only carries out their steps on
a grpc.aio channel and the session socket, through the event loop."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc

import kvtier.client._core as _core
from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from kvtier.client._common import translate
from kvtier.client._core import ClientBase, Operation, Run, Step, as_method
from kvtier.client.cuda import CudaGetGroups
from kvtier.client.zerocopy import AsyncSharedArena
from kvtier.errors import KVTierError

P = ParamSpec("P")
T = TypeVar("T")


def awaiting(
    operation: Callable[P, Operation[T]],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """An AsyncClient method: a coroutine that runs `operation` to its result."""

    async def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(operation(*args, **kwargs))

    return as_method(method, operation)


def async_iterating(
    stream: Callable[P, _core.Stream[T]],
) -> Callable[Concatenate[AsyncClient, P], AsyncIterator[T]]:
    """An AsyncClient method that returns an async iterator over the `stream`."""

    def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
        return self._aiterate(stream(*args, **kwargs))

    return as_method(method, stream)


class AsyncClient(ClientBase[AsyncSharedArena, grpc.aio.Channel]):
    """A connection to one kvtier daemon for asyncio code; use `async with` or `await close()`.

    Arguments as for `kvtier.Client` (target, then keyword-only timeout_s, token and the
    TLS options; `spin_s` is not used: the loop waits for a reply's readiness); each
    method is `Client`'s, awaited (`list` and `watch_events` return async iterators).
    """

    _attaching: asyncio.Lock | None = None  # coroutines of one client attach one session

    put = awaiting(_core.put)
    get = awaiting(_core.get)
    lookup = awaiting(_core.lookup)
    stat = awaiting(_core.stat)
    list = async_iterating(_core.list_)
    snapshot = awaiting(_core.snapshot)
    watch_events = async_iterating(_core.watch_events)
    delete = awaiting(_core.delete)
    stats = awaiting(_core.stats)
    plan = awaiting(_core.plan)
    report_prefill = awaiting(_core.report_prefill)
    prefetch = awaiting(_core.prefetch)
    # The zero-copy path (same node, UNIX socket)
    put_from = awaiting(_core.put_from)
    get_into = awaiting(_core.get_into)
    put_many = awaiting(_core.put_many)
    get_many = awaiting(_core.get_many)
    # GPU engines: CUDA IPC (same node; the daemon serves the GPU)
    register_cuda = awaiting(_core.register_cuda)
    register_cuda_handle = awaiting(_core.register_cuda_handle)
    put_from_cuda = awaiting(_core.put_from_cuda)
    get_into_cuda = awaiting(_core.get_into_cuda)
    _cuda_wait = awaiting(_core.cuda_wait)

    async def start_get_into_cuda(
        self,
        namespace: str,
        keys: Sequence[bytes | str],
        buffer_id: int,
        block_slices: Sequence[tuple[int, int]],
        group_sizes: Sequence[int],
    ) -> CudaGetGroups[Awaitable[builtins.list[bool]]]:
        """As `Client.start_get_into_cuda`; `.wait(g)` is awaited."""
        request_id = await self._run(
            _core.start_get_into_cuda(namespace, keys, buffer_id, block_slices, group_sizes)
        )
        return CudaGetGroups(request_id, tuple(group_sizes), self._cuda_wait)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        self._close_session()
        await self._channel.close()

    # ---- carrying out the operations' steps, through the event loop -------------------------
    def _open_channel(
        self, credentials: grpc.ChannelCredentials | None, options: builtins.list[tuple[str, Any]]
    ) -> grpc.aio.Channel:
        if credentials is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        return grpc.aio.secure_channel(self.target, credentials, options=options)

    async def _run(self, operation: Operation[T]) -> T:
        run = Run(operation)
        while (step := run.next_step()) is not None:
            # Failures, a cancellation too, go to the operation: its cleanup steps still run.
            try:
                run.reply = await self._perform(run, step)
            except BaseException as err:
                run.failure = self._failure(err)
        return run.result

    async def _perform(self, run: Run[Any], step: Step) -> Any:
        if isinstance(step, _core.REPORTS_HITS_FIRST) and self._arena is not None:
            try:
                for hits in self._pending_hits():  # the direct reads' report goes ahead
                    await self._arena.send(Op.HITS, hits)
            except OSError:
                self._close_session()  # lost: a call that needs it attaches again
        if isinstance(step, _core.SessionCall):
            return await self._attached(run).call(
                step.op, step.request, step.response_type, step.while_waiting
            )
        if isinstance(step, _core.Rpc):
            return await self._grpc(step.method, step.request)
        if isinstance(step, _core.Stream):
            return [item async for item in self._aiterate(step)]
        if isinstance(step, _core.OpenSession):
            run.session = arena = await self._shared_arena()
            return None if arena is None else arena.view
        if isinstance(step, _core.HoldStaging):
            return await _hold_staging(step, self.timeout_s)
        return await self._attached(run).send(step.op, step.request)

    async def _aiterate(self, stream: _core.Stream[T]) -> AsyncIterator[T]:
        call = self._grpc(stream.method, stream.request, stream.timeout_s)
        try:
            async for message in call:
                yield stream.on_message(message)
        except grpc.RpcError as err:
            raise translate(err) from None
        finally:
            call.cancel()

    async def _shared_arena(self) -> AsyncSharedArena | None:
        if not self._may_attach():
            return self._arena
        # One attach at a time: coroutines that call together share the session it makes.
        if self._attaching is None:
            self._attaching = asyncio.Lock()
        async with self._attaching:
            if not self._may_attach():
                return self._arena
            return await self._attach()

    async def _attach(self) -> AsyncSharedArena | None:
        for tries_left in reversed(range(_core.ATTACH_TRIES)):
            try:
                resp = await self._grpc("Attach", pb.AttachRequest())
                self._arena = self._attached_now(await AsyncSharedArena.attach(resp))
                break
            except (grpc.RpcError, OSError, KVTierError) as err:
                if not self._attach_failed(err, tries_left):
                    break
            await asyncio.sleep(_core.ATTACH_PAUSE_S)
        return self._arena


async def _hold_staging(step: _core.HoldStaging, timeout_s: float | None) -> bool:
    """`WriteArea.hold_staging` without blocking the loop: tried again after each loop
    pause of a millisecond (the loop's timer resolution; the holder is another task's
    put, one exchange long)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while not step.area.hold_staging(holder=step):
        if deadline is not None and loop.time() >= deadline:
            return False
        await asyncio.sleep(1e-3)
    return True
