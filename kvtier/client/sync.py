"""Blocking client: `kvtier.Client(target)`."""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import grpc

from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from kvtier.client import cuda
from kvtier.client._common import (
    CHANNEL_OPTIONS,
    PB_TO_TIER,
    BlockStat,
    Buffer,
    EventBatch,
    GetAssembler,
    PemSource,
    PlanResult,
    Snapshot,
    as_key,
    auth_metadata,
    block_stat,
    channel_security,
    event_batch,
    make_calls,
    normalize_target,
    plan_request,
    plan_result,
    put_messages,
    snapshot_of,
    stats_dict,
    translate,
)
from kvtier.client.zerocopy import (
    M,
    SharedArena,
    block_parts,
    commit_results,
    copy_bytes,
    copy_out,
    fill_slots,
    joined,
    release_request,
    reserve_request,
)
from kvtier.errors import (
    InvalidArgument,
    KVTierError,
    Unavailable,
    Unimplemented,
)
from kvtier.index.catalog import LookupResult
from kvtier.index.planner import PrefillCost

logger = logging.getLogger(__name__)


class Client:
    """A connection to one kvtier daemon. Missing blocks are None, errors are KVTierError.

    `target`: unix:///path/to.sock, host:port, or None for the default socket.
    `token`: bearer token (default $KVTIER_TOKEN). TLS, for host:port targets only:
    `tls_ca` the CA that signed the daemon's certificate (PEM bytes or a file path; default
    $KVTIER_TLS_CA, else the system's roots), `tls_cert` and `tls_key` the client
    certificate for mTLS (default $KVTIER_TLS_CERT, $KVTIER_TLS_KEY), `tls_server_name`
    the name to check the daemon's certificate against when it is not the target's host.
    Any of them turns TLS on; `tls=True` turns it on with none of them, `tls=False` off.
    """

    def __init__(
        self,
        target: str | None = None,
        timeout_s: float | None = 60.0,
        token: str | None = None,
        *,
        tls: bool | None = None,
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        self.target = normalize_target(target)
        self.timeout_s = timeout_s
        self._metadata = auth_metadata(token)
        security = channel_security(self.target, tls, tls_ca, tls_cert, tls_key, tls_server_name)
        options = [*CHANNEL_OPTIONS, *security.options]
        if security.credentials is None:
            self._channel = grpc.insecure_channel(self.target, options=options)
        else:
            self._channel = grpc.secure_channel(self.target, security.credentials, options=options)
        calls = make_calls(self._channel)
        self._stub, self._put, self._get = calls.stub, calls.put, calls.get
        self._arena: SharedArena | None = None
        self._zero_copy_possible = self.target.startswith("unix:")

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
        if self._arena is not None:
            self._arena.close()  # the daemon ends the session and any lease left
            self._arena = None
        self._channel.close()

    def put(self, namespace: str, key: bytes | str, data: Buffer, overwrite: bool = False) -> bool:
        """Store `data`; True if stored now, False if these exact bytes were already there."""
        try:
            resp = self._put(
                put_messages(namespace, as_key(key), data, overwrite),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return not resp.already_present

    def get(self, namespace: str, key: bytes | str) -> bytes | None:
        """The block's bytes, exactly as put, or None when it is not cached."""
        out = GetAssembler()
        try:
            for msg in self._get(
                pb.GetRequest(namespace=namespace, key=as_key(key)),
                timeout=self.timeout_s,
                metadata=self._metadata,
            ):
                out.feed(msg)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise translate(err) from None
        return out.result()

    def lookup(self, namespace: str, keys: Sequence[bytes | str]) -> LookupResult:
        """How many leading keys of the chain are cached, and the tier of each key."""
        try:
            resp = self._stub.Lookup(
                pb.LookupRequest(namespace=namespace, keys=[as_key(k) for k in keys]),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return LookupResult(resp.prefix_blocks, [PB_TO_TIER[t] for t in resp.tiers])

    def stat(self, namespace: str, key: bytes | str) -> BlockStat | None:
        try:
            resp = self._stub.Stat(
                pb.StatRequest(namespace=namespace, key=as_key(key)),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise translate(err) from None
        return block_stat(resp.info)

    def list(self, namespace: str = "", limit: int = 0) -> Iterator[BlockStat]:
        try:
            for entry in self._stub.List(
                pb.ListRequest(namespace=namespace, limit=limit),
                timeout=self.timeout_s,
                metadata=self._metadata,
            ):
                yield block_stat(entry.info)
        except grpc.RpcError as err:
            raise translate(err) from None

    def snapshot(self, namespace: str = "") -> Snapshot:
        """Every block of `namespace` (empty: of every namespace of this tenant) and its
        tiers, as of event `seq`: watch_events(epoch, seq) continues from it."""
        request = pb.SnapshotRequest(namespace=namespace)
        try:
            call = self._stub.Snapshot(request, timeout=self.timeout_s, metadata=self._metadata)
            return snapshot_of(list(call))
        except grpc.RpcError as err:
            raise translate(err) from None

    def watch_events(
        self,
        namespace: str = "",
        epoch: str = "",
        after_seq: int = 0,
        timeout_s: float | None = None,
    ) -> Iterator[EventBatch]:
        """Residency events as they happen (the first batch may be empty: it says the
        epoch). With `epoch` and `after_seq` (from a snapshot or the last event seen) it
        resumes exactly there, or yields one batch with `resync` and ends. Runs until the
        daemon stops, `timeout_s` passes (then DEADLINE_EXCEEDED), or the caller stops
        iterating."""
        call = self._stub.WatchEvents(
            pb.WatchEventsRequest(namespace=namespace, epoch=epoch, after_seq=after_seq),
            timeout=timeout_s,
            metadata=self._metadata,
        )
        try:
            for resp in call:
                yield event_batch(resp)
        except grpc.RpcError as err:
            raise translate(err) from None
        finally:
            call.cancel()

    def delete(self, namespace: str, key: bytes | str) -> bool:
        """True if a block was removed, False if there was none."""
        try:
            resp = self._stub.Delete(
                pb.DeleteRequest(namespace=namespace, key=as_key(key)),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return bool(resp.deleted)

    def stats(self) -> dict[str, Any]:
        """Counters and, under "tiers", each tier's used_bytes and capacity_bytes."""
        try:
            resp = self._stub.Stats(
                pb.StatsRequest(), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return stats_dict(resp)

    def plan(
        self,
        namespace: str,
        keys: Sequence[bytes | str],
        tokens_per_block: int,
        engine_cached_blocks: int = 0,
        overlap: str = "none",
        prompt_tokens: int | None = None,
        kv_bytes_per_token: int | None = None,
    ) -> PlanResult:
        """Per block of the chain: fetch (from which tier) or recompute, and the estimates."""
        request = plan_request(
            namespace,
            [as_key(k) for k in keys],
            tokens_per_block,
            engine_cached_blocks,
            overlap,
            prompt_tokens,
            kv_bytes_per_token,
        )
        arena = self._shared_arena()
        try:
            if arena is not None:  # the session socket: a fraction of gRPC's round trip
                resp = arena.call(Op.PLAN, request, pb.PlanResponse)
            else:
                resp = self._stub.Plan(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise translate(err) from None
        except OSError as err:
            raise self._lost_session(err) from None
        return plan_result(resp)

    def report_prefill(
        self, namespace: str, start_token: int, end_token: int, seconds: float
    ) -> PrefillCost:
        """Tell the daemon how long prefilling tokens [start, end) took; returns its estimate."""
        request = pb.ReportPrefillRequest(
            namespace=namespace, start_token=start_token, end_token=end_token, seconds=seconds
        )
        arena = self._shared_arena()
        try:
            if arena is not None:
                resp = arena.call(Op.REPORT_PREFILL, request, pb.ReportPrefillResponse)
            else:
                resp = self._stub.ReportPrefill(
                    request, timeout=self.timeout_s, metadata=self._metadata
                )
        except grpc.RpcError as err:
            raise translate(err) from None
        except OSError as err:
            raise self._lost_session(err) from None
        return PrefillCost(resp.a_s_per_token, resp.c_s_per_token2, resp.step_s)

    # ---- zero-copy path (same node, UNIX socket) --------------------------------------------
    def put_from(
        self, namespace: str, key: bytes | str, buffer: Any, overwrite: bool = False
    ) -> bool:
        """Store a block straight from `buffer` through the shared arena (one copy, no gRPC
        payload). True if stored now, False if the same bytes were already there."""
        return self.put_many(namespace, [(key, buffer)], overwrite)[0]

    def get_into(
        self, namespace: str, key: bytes | str, buffer: Any, verify: bool = False
    ) -> int | None:
        """Copy a block into `buffer` (any writable buffer); bytes written, or None on a miss."""
        return self.get_many(namespace, [key], [buffer], verify)[0]

    def put_many(
        self, namespace: str, items: Sequence[tuple[bytes | str, Any]], overwrite: bool = False
    ) -> builtins.list[bool]:
        """Store many blocks with one reserve and one commit round trip. A block's buffer
        may be a list of buffers holding it back to back (one per layer, say): each is
        copied into place, never joined first."""
        blocks = [block_parts(buf, writable=False) for _, buf in items]
        arena = self._shared_arena()
        if arena is None:
            return [
                self.put(namespace, k, joined(b), overwrite)
                for (k, _), b in zip(items, blocks, strict=True)
            ]
        keys = [as_key(k) for k, _ in items]
        try:
            resp = arena.call(
                Op.RESERVE,
                reserve_request(namespace, keys, blocks, overwrite),
                pb.ReserveResponse,
            )
            try:
                checksums = fill_slots(arena, resp.slots, blocks)
            except BaseException:
                arena.call(
                    Op.COMMIT,
                    pb.CommitRequest(lease_id=resp.lease_id, abort=True),
                    pb.CommitResponse,
                )
                raise
            done = arena.call(
                Op.COMMIT,
                pb.CommitRequest(lease_id=resp.lease_id, xxh3_64=checksums),
                pb.CommitResponse,
            )
        except OSError as err:
            raise self._lost_session(err) from None
        return commit_results(done)

    def get_many(
        self,
        namespace: str,
        keys: Sequence[bytes | str],
        buffers: Sequence[Any],
        verify: bool = False,
    ) -> builtins.list[int | None]:
        """Copy many blocks into their buffers with one round trip; None for each miss. A
        block's buffer may be a list of buffers, filled in order (as put_many takes them)."""
        if len(keys) != len(buffers):
            raise InvalidArgument("get_many needs one buffer per key")
        views = [block_parts(buf, writable=True) for buf in buffers]
        arena = self._shared_arena()
        if arena is None:
            return [copy_bytes(self.get(namespace, k), v) for k, v in zip(keys, views, strict=True)]
        request = pb.AcquireRequest(namespace=namespace, keys=[as_key(k) for k in keys])
        started_s = time.perf_counter()
        try:
            resp = arena.call(Op.ACQUIRE, request, pb.AcquireResponse)
        except OSError as err:
            raise self._lost_session(err) from None
        copied: builtins.list[int | None] = []
        try:
            copied = copy_out(arena, resp.blocks, views, verify)
            return copied
        finally:
            if resp.lease_id:
                # No reply awaited: the caller has its bytes; the pin goes a moment later.
                arena.send(Op.RELEASE, release_request(resp.lease_id, started_s, copied))

    # ---- GPU engines: CUDA IPC (same node; the daemon serves the GPU) ----------------------
    def register_cuda(self, tensor: Any) -> int:
        """Register a contiguous CUDA tensor (the engine's KV cache) once; blocks are then
        named by (offset, size) in bytes. It must stay allocated while registered (until
        this client closes). Returns the buffer id."""
        return self.register_cuda_handle(*cuda.cuda_ipc_handle(tensor))

    def register_cuda_handle(
        self, device: int, ipc_handle: bytes, offset_bytes: int, size_bytes: int
    ) -> int:
        """`register_cuda` from a raw cudaIpcMemHandle (and the tensor's offset in its
        allocation), for engines that are not torch."""
        request = cuda.register_request(device, ipc_handle, offset_bytes, size_bytes)
        return self._gpu_call(Op.REGISTER_CUDA, request, pb.RegisterCudaResponse).buffer_id

    def put_from_cuda(
        self,
        namespace: str,
        keys: Sequence[bytes | str],
        buffer_id: int,
        block_slices: Sequence[tuple[int, int]],
        overwrite: bool = False,
    ) -> builtins.list[bool]:
        """Store blocks straight from GPU memory, each a (offset, size) in bytes of the
        registered buffer (the daemon copies them on its streams); per block: stored now,
        or already there. Returns once the copies are done."""
        request = cuda.put_request(namespace, keys, buffer_id, block_slices, overwrite)
        return commit_results(self._gpu_call(Op.CUDA_PUT, request, pb.CudaPutResponse))

    def get_into_cuda(
        self,
        namespace: str,
        keys: Sequence[bytes | str],
        buffer_id: int,
        block_slices: Sequence[tuple[int, int]],
    ) -> builtins.list[bool]:
        """Copy cached blocks into GPU memory; per block found (False: a miss, its range
        untouched). Returns once the copies are done."""
        request = cuda.get_request(namespace, keys, buffer_id, block_slices)
        return cuda.found(self._gpu_call(Op.CUDA_GET, request, pb.CudaGetResponse))

    def start_get_into_cuda(
        self,
        namespace: str,
        keys: Sequence[bytes | str],
        buffer_id: int,
        block_slices: Sequence[tuple[int, int]],
        group_sizes: Sequence[int],
    ) -> cuda.CudaGetGroups[builtins.list[bool]]:
        """`get_into_cuda` in groups (the blocks in order, `group_sizes` of them each: an
        engine's layers): returns at once with every group's copies started; wait for
        each group with `.wait(g)` (per block found) before using its memory."""
        request = cuda.get_request(namespace, keys, buffer_id, block_slices, group_sizes)
        resp = self._gpu_call(Op.CUDA_GET, request, pb.CudaGetResponse)
        return cuda.CudaGetGroups(resp.request_id, tuple(group_sizes), self._cuda_wait)

    def _cuda_wait(self, request_id: int, group: int) -> builtins.list[bool]:
        request = cuda.wait_request(request_id, group)
        return cuda.found(self._gpu_call(Op.CUDA_WAIT, request, pb.CudaGetResponse))

    def _gpu_call(self, op: Op, request: Any, response_type: type[M]) -> M:
        arena = self._shared_arena()
        if arena is None:
            raise Unimplemented(cuda.NO_SESSION)
        try:
            return arena.call(op, request, response_type)
        except OSError as err:
            raise self._lost_session(err) from None

    def _lost_session(self, err: OSError) -> KVTierError:
        if self._arena is not None:
            self._arena.close()
            self._arena = None  # the next call attaches again
        return Unavailable(f"lost the session with the daemon: {err}")

    def _shared_arena(self) -> SharedArena | None:
        """The mapped arena, attaching on first use; None where zero-copy is unavailable."""
        if self._arena is None and self._zero_copy_possible:
            try:
                self._arena = SharedArena.attach(
                    self._stub.Attach(
                        pb.AttachRequest(), timeout=self.timeout_s, metadata=self._metadata
                    )
                )
            except (grpc.RpcError, OSError, KVTierError) as err:
                if isinstance(err, grpc.RpcError) and (
                    err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                ):
                    # Over a rate limit for now: not a reason to give up zero-copy.
                    raise translate(err) from None
                self._zero_copy_possible = False
                logger.info("zero-copy path unavailable (%s); using the gRPC byte path", err)
        return self._arena

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the daemon accepts calls (or raise Unavailable after `timeout_s`)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            from kvtier.errors import Unavailable

            raise Unavailable(f"no kvtier daemon answered on {self.target}") from None
