"""Blocking client: `kvtier.Client(target)`. Its calls are kvtier/client/_core.py's
operations; this module only carries out their steps on a blocking gRPC channel and the
session socket."""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc

import kvtier.client._core as _core
from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from kvtier.client._common import translate
from kvtier.client._core import ClientBase, Operation, Run, Step, as_method
from kvtier.client.cuda import CudaGetGroups
from kvtier.client.zerocopy import SharedArena
from kvtier.errors import KVTierError, Unavailable

P = ParamSpec("P")
T = TypeVar("T")


def blocking(operation: Callable[P, Operation[T]]) -> Callable[Concatenate[Client, P], T]:
    """A Client method that runs `operation` to its result."""

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(operation(*args, **kwargs))

    return as_method(method, operation)


def iterating(
    stream: Callable[P, _core.Stream[T]],
) -> Callable[Concatenate[Client, P], Iterator[T]]:
    """A Client method that returns an iterator over the `stream`."""

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        return self._iterate(stream(*args, **kwargs))

    return as_method(method, stream)


class Client(ClientBase[SharedArena, grpc.Channel]):
    """A connection to one kvtier daemon. Missing blocks are None, errors are KVTierError.

    `target`: unix:///path/to.sock, host:port, or None for the default socket.
    `timeout_s`: each call's deadline (None: none). `token`: bearer token (default
    $KVTIER_TOKEN). TLS, for host:port targets only: `tls_ca` the CA that signed the
    daemon's certificate (PEM bytes or a file path; default $KVTIER_TLS_CA, else the
    system's roots), `tls_cert` and `tls_key` the client certificate for mTLS (default
    $KVTIER_TLS_CERT, $KVTIER_TLS_KEY), `tls_server_name` the name to check the daemon's
    certificate against when it is not the target's host. Any of them turns TLS on;
    `tls=True` turns it on with none of them, `tls=False` off. `tune_malloc=False`
    leaves this process's malloc thresholds alone (by default the first put or get raises
    them, kvtier/_malloc.py: multi-MiB blocks otherwise page-fault in every copy).
    `direct_reads=False` makes every zero-copy get acquire a lease (by default it reads
    the tenant's directory first, docs/design.md "Direct reads"). `spin_s`: how long a
    call may poll the session socket for its reply before it sleeps (default 300 µs; 0
    never polls); whether it polls is chosen per kind of call by which way measured
    faster (kvtier/client/ways.py). All but `target` are keyword-only.
    """

    put = blocking(_core.put)
    get = blocking(_core.get)
    lookup = blocking(_core.lookup)
    stat = blocking(_core.stat)
    list = iterating(_core.list_)
    snapshot = blocking(_core.snapshot)
    watch_events = iterating(_core.watch_events)
    delete = blocking(_core.delete)
    stats = blocking(_core.stats)
    plan = blocking(_core.plan)
    report_prefill = blocking(_core.report_prefill)
    prefetch = blocking(_core.prefetch)
    # The zero-copy path (same node, UNIX socket)
    put_from = blocking(_core.put_from)
    get_into = blocking(_core.get_into)
    put_many = blocking(_core.put_many)
    get_many = blocking(_core.get_many)
    # GPU engines: CUDA IPC (same node; the daemon serves the GPU)
    register_cuda = blocking(_core.register_cuda)
    register_cuda_handle = blocking(_core.register_cuda_handle)
    put_from_cuda = blocking(_core.put_from_cuda)
    get_into_cuda = blocking(_core.get_into_cuda)
    _cuda_wait = blocking(_core.cuda_wait)

    def start_get_into_cuda(
        self,
        namespace: str,
        keys: Sequence[bytes | str],
        buffer_id: int,
        block_slices: Sequence[tuple[int, int]],
        group_sizes: Sequence[int],
    ) -> CudaGetGroups[builtins.list[bool]]:
        """`get_into_cuda` in groups (the blocks in order, `group_sizes` of them each: an
        engine's layers): returns at once with every group's copies started; wait for
        each group with `.wait(g)` (per block found) before using its memory."""
        operation = _core.start_get_into_cuda(namespace, keys, buffer_id, block_slices, group_sizes)
        return CudaGetGroups(self._run(operation), tuple(group_sizes), self._cuda_wait)

    def wait_ready(self, *, timeout_s: float = 10.0) -> None:
        """Block until the daemon accepts calls (or raise Unavailable after `timeout_s`)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"no kvtier daemon answered on {self.target}") from None

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._close_session()
        self._channel.close()

    # ---- carrying out the operations' steps --------------------------------------------------
    def _open_channel(
        self, credentials: grpc.ChannelCredentials | None, options: builtins.list[tuple[str, Any]]
    ) -> grpc.Channel:
        if credentials is None:
            return grpc.insecure_channel(self.target, options=options)
        return grpc.secure_channel(self.target, credentials, options=options)

    def _run(self, operation: Operation[T]) -> T:
        run = Run(operation)
        while (step := run.next_step()) is not None:
            # Any failure goes to the operation, which may clean up (abort a reservation).
            try:
                run.reply = self._perform(run, step)
            except BaseException as err:
                run.failure = self._failure(err)
        return run.result

    def _perform(self, run: Run[Any], step: Step) -> Any:
        if isinstance(step, _core.REPORTS_HITS_FIRST) and self._arena is not None:
            try:
                for hits in self._pending_hits():  # the direct reads' report goes ahead
                    self._arena.send(Op.HITS, hits)
            except OSError:
                self._close_session()  # lost: a call that needs it attaches again
        if isinstance(step, _core.SessionCall):
            return self._attached(run).call(
                step.op, step.request, step.response_type, step.while_waiting, step.size_class
            )
        if isinstance(step, _core.Rpc):
            return self._grpc(step.method, step.request)
        if isinstance(step, _core.Stream):
            return list(self._iterate(step))
        if isinstance(step, _core.OpenSession):
            run.session = arena = self._shared_arena()
            return None if arena is None else arena.view
        if isinstance(step, _core.HoldStaging):
            return step.area.hold_staging(self.timeout_s, holder=step)
        return self._attached(run).send(step.op, step.request)

    def _iterate(self, stream: _core.Stream[T]) -> Iterator[T]:
        call = self._grpc(stream.method, stream.request, stream.timeout_s)
        try:
            for message in call:
                yield stream.on_message(message)
        except grpc.RpcError as err:
            raise translate(err) from None
        finally:
            call.cancel()

    def _shared_arena(self) -> SharedArena | None:
        if not self._may_attach():
            return self._arena
        # One attach at a time: threads that call together share the session it makes.
        with self._attach_lock:
            if not self._may_attach():
                return self._arena
            return self._attach()

    def _attach(self) -> SharedArena | None:
        for tries_left in reversed(range(_core.ATTACH_TRIES)):
            try:
                arena = SharedArena.attach(self._grpc("Attach", pb.AttachRequest()))
                arena.reply_wait.spin_s = self.spin_s
                self._arena = self._attached_now(arena)
                break
            except (grpc.RpcError, OSError, KVTierError) as err:
                if not self._attach_failed(err, tries_left):
                    break
            time.sleep(_core.ATTACH_PAUSE_S)
        return self._arena
