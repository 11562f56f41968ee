"""asyncio client: `kvtier.AsyncClient(target)`, the same calls as `Client`, awaited."""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
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
    AsyncSharedArena,
    M,
    block_parts,
    commit_results,
    copy_bytes,
    copy_out,
    fill_slots,
    joined,
    release_request,
    reserve_request,
)
from kvtier.errors import InvalidArgument, KVTierError, Unavailable, Unimplemented
from kvtier.index.catalog import LookupResult
from kvtier.index.planner import PrefillCost

logger = logging.getLogger(__name__)


class AsyncClient:
    """A connection to one kvtier daemon for asyncio code; use `async with` or `await close()`.

    Arguments as for `kvtier.Client` (target, timeout, token and the TLS options).
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
            self._channel = grpc.aio.insecure_channel(self.target, options=options)
        else:
            self._channel = grpc.aio.secure_channel(
                self.target, security.credentials, options=options
            )
        calls = make_calls(self._channel)
        self._stub, self._put, self._get = calls.stub, calls.put, calls.get
        self._arena: AsyncSharedArena | None = None
        self._zero_copy_possible = self.target.startswith("unix:")

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
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        await self._channel.close()

    async def put(
        self, namespace: str, key: bytes | str, data: Buffer, overwrite: bool = False
    ) -> bool:
        try:
            resp = await self._put(
                put_messages(namespace, as_key(key), data, overwrite),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return not resp.already_present

    async def get(self, namespace: str, key: bytes | str) -> bytes | None:
        out = GetAssembler()
        try:
            async for msg in self._get(
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

    async def lookup(self, namespace: str, keys: Sequence[bytes | str]) -> LookupResult:
        try:
            resp = await self._stub.Lookup(
                pb.LookupRequest(namespace=namespace, keys=[as_key(k) for k in keys]),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return LookupResult(resp.prefix_blocks, [PB_TO_TIER[t] for t in resp.tiers])

    async def stat(self, namespace: str, key: bytes | str) -> BlockStat | None:
        try:
            resp = await self._stub.Stat(
                pb.StatRequest(namespace=namespace, key=as_key(key)),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise translate(err) from None
        return block_stat(resp.info)

    async def list(self, namespace: str = "", limit: int = 0) -> AsyncIterator[BlockStat]:
        try:
            async for entry in self._stub.List(
                pb.ListRequest(namespace=namespace, limit=limit),
                timeout=self.timeout_s,
                metadata=self._metadata,
            ):
                yield block_stat(entry.info)
        except grpc.RpcError as err:
            raise translate(err) from None

    async def delete(self, namespace: str, key: bytes | str) -> bool:
        try:
            resp = await self._stub.Delete(
                pb.DeleteRequest(namespace=namespace, key=as_key(key)),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return bool(resp.deleted)

    async def snapshot(self, namespace: str = "") -> Snapshot:
        """As `Client.snapshot`: the blocks and their tiers as of event `seq`."""
        request = pb.SnapshotRequest(namespace=namespace)
        try:
            call = self._stub.Snapshot(request, timeout=self.timeout_s, metadata=self._metadata)
            return snapshot_of([resp async for resp in call])
        except grpc.RpcError as err:
            raise translate(err) from None

    async def watch_events(
        self,
        namespace: str = "",
        epoch: str = "",
        after_seq: int = 0,
        timeout_s: float | None = None,
    ) -> AsyncIterator[EventBatch]:
        """As `Client.watch_events`: residency events as they happen, resumable."""
        call = self._stub.WatchEvents(
            pb.WatchEventsRequest(namespace=namespace, epoch=epoch, after_seq=after_seq),
            timeout=timeout_s,
            metadata=self._metadata,
        )
        try:
            async for resp in call:
                yield event_batch(resp)
        except grpc.RpcError as err:
            raise translate(err) from None
        finally:
            call.cancel()

    async def stats(self) -> dict[str, Any]:
        try:
            resp = await self._stub.Stats(
                pb.StatsRequest(), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise translate(err) from None
        return stats_dict(resp)

    async def plan(
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
        arena = await self._shared_arena()
        try:
            if arena is not None:  # the session socket: a fraction of gRPC's round trip
                resp = await arena.call(Op.PLAN, request, pb.PlanResponse)
            else:
                resp = await self._stub.Plan(
                    request, timeout=self.timeout_s, metadata=self._metadata
                )
        except grpc.RpcError as err:
            raise translate(err) from None
        except OSError as err:
            raise self._lost_session(err) from None
        return plan_result(resp)

    async def report_prefill(
        self, namespace: str, start_token: int, end_token: int, seconds: float
    ) -> PrefillCost:
        """Tell the daemon how long prefilling tokens [start, end) took; returns its estimate."""
        request = pb.ReportPrefillRequest(
            namespace=namespace, start_token=start_token, end_token=end_token, seconds=seconds
        )
        arena = await self._shared_arena()
        try:
            if arena is not None:
                resp = await arena.call(Op.REPORT_PREFILL, request, pb.ReportPrefillResponse)
            else:
                resp = await self._stub.ReportPrefill(
                    request, timeout=self.timeout_s, metadata=self._metadata
                )
        except grpc.RpcError as err:
            raise translate(err) from None
        except OSError as err:
            raise self._lost_session(err) from None
        return PrefillCost(resp.a_s_per_token, resp.c_s_per_token2, resp.step_s)

    # ---- zero-copy path (same node, UNIX socket) --------------------------------------------
    async def put_from(
        self, namespace: str, key: bytes | str, buffer: Any, overwrite: bool = False
    ) -> bool:
        """Store a block straight from `buffer` through the shared arena."""
        return (await self.put_many(namespace, [(key, buffer)], overwrite))[0]

    async def get_into(
        self, namespace: str, key: bytes | str, buffer: Any, verify: bool = False
    ) -> int | None:
        """Copy a block into `buffer`; bytes written, or None on a miss."""
        return (await self.get_many(namespace, [key], [buffer], verify))[0]

    async def put_many(
        self, namespace: str, items: Sequence[tuple[bytes | str, Any]], overwrite: bool = False
    ) -> builtins.list[bool]:
        """Store many blocks with one reserve and one commit round trip. A block's buffer
        may be a list of buffers holding it back to back (one per layer, say): each is
        copied into place, never joined first."""
        blocks = [block_parts(buf, writable=False) for _, buf in items]
        arena = await self._shared_arena()
        if arena is None:
            return [
                await self.put(namespace, k, joined(b), overwrite)
                for (k, _), b in zip(items, blocks, strict=True)
            ]
        keys = [as_key(k) for k, _ in items]
        try:
            resp = await arena.call(
                Op.RESERVE, reserve_request(namespace, keys, blocks, overwrite), pb.ReserveResponse
            )
            try:
                checksums = fill_slots(arena, resp.slots, blocks)
            except BaseException:
                await arena.call(
                    Op.COMMIT,
                    pb.CommitRequest(lease_id=resp.lease_id, abort=True),
                    pb.CommitResponse,
                )
                raise
            done = await arena.call(
                Op.COMMIT,
                pb.CommitRequest(lease_id=resp.lease_id, xxh3_64=checksums),
                pb.CommitResponse,
            )
        except OSError as err:
            raise self._lost_session(err) from None
        return commit_results(done)

    async def get_many(
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
        arena = await self._shared_arena()
        if arena is None:
            return [
                copy_bytes(await self.get(namespace, k), v)
                for k, v in zip(keys, views, strict=True)
            ]
        request = pb.AcquireRequest(namespace=namespace, keys=[as_key(k) for k in keys])
        started_s = time.perf_counter()
        try:
            resp = await arena.call(Op.ACQUIRE, request, pb.AcquireResponse)
        except OSError as err:
            raise self._lost_session(err) from None
        copied: builtins.list[int | None] = []
        try:
            copied = copy_out(arena, resp.blocks, views, verify)
            return copied
        finally:
            if resp.lease_id:
                await arena.send(Op.RELEASE, release_request(resp.lease_id, started_s, copied))

    # ---- GPU engines: CUDA IPC (as Client's) -------------------------------------------------
    async def register_cuda(self, tensor: Any) -> int:
        return await self.register_cuda_handle(*cuda.cuda_ipc_handle(tensor))

    async def register_cuda_handle(
        self, device: int, ipc_handle: bytes, offset_bytes: int, size_bytes: int
    ) -> int:
        request = cuda.register_request(device, ipc_handle, offset_bytes, size_bytes)
        resp = await self._gpu_call(Op.REGISTER_CUDA, request, pb.RegisterCudaResponse)
        return resp.buffer_id

    async def put_from_cuda(
        self,
        namespace: str,
        keys: Sequence[bytes | str],
        buffer_id: int,
        block_slices: Sequence[tuple[int, int]],
        overwrite: bool = False,
    ) -> builtins.list[bool]:
        request = cuda.put_request(namespace, keys, buffer_id, block_slices, overwrite)
        return commit_results(await self._gpu_call(Op.CUDA_PUT, request, pb.CudaPutResponse))

    async def get_into_cuda(
        self,
        namespace: str,
        keys: Sequence[bytes | str],
        buffer_id: int,
        block_slices: Sequence[tuple[int, int]],
    ) -> builtins.list[bool]:
        request = cuda.get_request(namespace, keys, buffer_id, block_slices)
        return cuda.found(await self._gpu_call(Op.CUDA_GET, request, pb.CudaGetResponse))

    async def start_get_into_cuda(
        self,
        namespace: str,
        keys: Sequence[bytes | str],
        buffer_id: int,
        block_slices: Sequence[tuple[int, int]],
        group_sizes: Sequence[int],
    ) -> cuda.CudaGetGroups[Awaitable[builtins.list[bool]]]:
        request = cuda.get_request(namespace, keys, buffer_id, block_slices, group_sizes)
        resp = await self._gpu_call(Op.CUDA_GET, request, pb.CudaGetResponse)
        return cuda.CudaGetGroups(resp.request_id, tuple(group_sizes), self._cuda_wait)

    async def _cuda_wait(self, request_id: int, group: int) -> builtins.list[bool]:
        request = cuda.wait_request(request_id, group)
        return cuda.found(await self._gpu_call(Op.CUDA_WAIT, request, pb.CudaGetResponse))

    async def _gpu_call(self, op: Op, request: Any, response_type: type[M]) -> M:
        arena = await self._shared_arena()
        if arena is None:
            raise Unimplemented(cuda.NO_SESSION)
        try:
            return await arena.call(op, request, response_type)
        except OSError as err:
            raise self._lost_session(err) from None

    def _lost_session(self, err: OSError) -> KVTierError:
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        return Unavailable(f"lost the session with the daemon: {err}")

    async def _shared_arena(self) -> AsyncSharedArena | None:
        if self._arena is None and self._zero_copy_possible:
            try:
                resp = await self._stub.Attach(
                    pb.AttachRequest(), timeout=self.timeout_s, metadata=self._metadata
                )
                self._arena = await AsyncSharedArena.attach(resp)
            except (grpc.RpcError, OSError, KVTierError) as err:
                if isinstance(err, grpc.RpcError) and (
                    err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                ):
                    # Over a rate limit for now: not a reason to give up zero-copy.
                    raise translate(err) from None
                self._zero_copy_possible = False
                logger.info("zero-copy path unavailable (%s); using the gRPC byte path", err)
        return self._arena
