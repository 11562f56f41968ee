"""The kvtier.v1.KVTier gRPC servicer: validates requests, calls the store.

Handlers raise kvtier.errors exceptions and never abort: `add_to_server` registers each
through kvtier.server.rpc, which ends the call with the exception's status (the mapping
itself is kvtier.errors.to_status). Responses are built in kvtier.server.messages.

Identity and rate limits: every tenant-scoped RPC (all but Stats) learns its tenant from
`_tenant` (client certificate and/or bearer token) and is charged one request by `_admit`
before it does any work; zero-copy session ops are charged by `session_call` (a
kvtier.server.session_dispatch.SessionDispatch) or `_session` for their gRPC twins.
Commit and Release are not charged: they finish work already admitted, and refusing them
would only keep DRAM pinned until the lease expires.

What a tenant holds open: every RPC of the service takes one of its tenant's call slots
for as long as it runs (`enter_call`, limits.max_calls_per_tenant; WatchEvents also one of
limits.max_watchers_per_tenant; server.max_concurrent_rpcs over all tenants), refused at
once past a cap (kvtier.server.admission). A Put stream that sends nothing for
limits.stream_idle_s is ended DEADLINE_EXCEEDED and its reserved DRAM freed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from kvtier._wire import (
    DEFAULT_INLINE_BYTES,
    INLINE_MAX_BYTES,
    InlinePut,
    RawChunk,
    Undecodable,
    get_block_message,
    get_block_response_serializer,
    get_response_serializer,
    put_block_request_deserializer,
    put_request_deserializer,
    tolerant,
)
from kvtier.config import Config
from kvtier.engine.cuda_path import CudaPath
from kvtier.engine.events import Resync
from kvtier.engine.store import Store
from kvtier.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RateLimited,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from kvtier.index.catalog import BlockId
from kvtier.index.planner import FAMILIES, OVERLAPS
from kvtier.keys import (
    DEFAULT_TENANT,
    check_key,
    check_keys,
    check_namespace,
    hash_token,
    namespace_id,
)
from kvtier.server import looplag, rpc
from kvtier.server.admission import CallCaps, CallSlots, Slot, node_cap_warning
from kvtier.server.arena_socket import ArenaSocket
from kvtier.server.cuda_ops import CudaOps
from kvtier.server.messages import (
    TIER_NAME_TO_PB,
    TIER_TO_PB,
    PlanResponses,
    block_event,
    block_info,
    commit_results,
    leased,
    prefill_response,
    put_response,
    stats_response,
)
from kvtier.server.ratelimit import RateLimiter
from kvtier.server.session_dispatch import FINISHING_OPS, SessionDispatch

Ctx = rpc.Ctx
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVTier"].full_name

logger = logging.getLogger(__name__)
EVENT_BATCH = 1024  # blocks or events per streamed message (well under 4 MiB)


class KVTierService:
    def __init__(
        self,
        store: Store,
        config: Config,
        draining: Callable[[], bool],
        arena: ArenaSocket | None = None,
        mtls: bool = False,
        cuda: CudaPath | None = None,
    ) -> None:
        """`mtls`: the listener verifies client certificates (server.tls_client_ca_file), so
        the certificate names in a call's auth context can identify its tenant."""
        self._store = store
        self.telemetry = store.telemetry
        self._limits = config.limits
        self._chunk_bytes = config.server.chunk_bytes
        self._draining = draining
        self._arena = arena
        if arena is not None:
            arena.set_write_areas(lambda session_id: store.zero_copy.write_area(session_id).fd)
            arena.set_directories(store.directories.fd)
        # The GPU path (gpu.device); without one, CUDA calls are UNIMPLEMENTED.
        self._cuda = CudaOps(
            cuda, lambda: self._limits, self._ns_id, self._admit_bytes, self._drop_if_session_ended
        )
        self._mtls = mtls
        self._tokens = dict(config.auth.tokens)
        self._certificates = dict(config.auth.certificates)
        self._limiter = RateLimiter(config)
        self._calls = CallSlots(CallCaps.of(config))
        self._plan_responses = PlanResponses()
        _warn_node_cap(config)
        self.session_call = SessionDispatch(
            {
                Op.RESERVE: self._reserve,
                Op.COMMIT: self._commit,
                Op.ACQUIRE: self._acquire,
                Op.RELEASE: self._release,
                Op.PLAN: self._plan,
                Op.REPORT_PREFILL: self._report_prefill,
                Op.REGISTER_CUDA: self._cuda.register,
                Op.CUDA_PUT: self._cuda.put,
                Op.CUDA_GET: self._cuda.get,
                Op.CUDA_WAIT: self._cuda.wait,
                Op.STAGE: self._stage,
                Op.PUT_STAGED: self._put_staged,
                Op.HITS: self._hits,
            },
            self._session_tenant,
            self._admit,
            self.telemetry,
        )

    def reconfigure(self, config: Config) -> None:
        """Apply settings a reload may change while calls are in flight (each call reads
        them once, so it sees either the old or the new ones, never a mix)."""
        self._limits = config.limits
        self._tokens = dict(config.auth.tokens)
        self._certificates = dict(config.auth.certificates)
        self._limiter.reconfigure(config)
        self._calls.reconfigure(CallCaps.of(config))
        _warn_node_cap(config)

    def enter_call(self, method: str, context: Ctx) -> Slot:
        """A slot for one call of `method` from the caller's tenant (ResourceExhausted past
        its caps; Unauthenticated without a valid identity). Charges no request rate."""
        return self._calls.enter(self._tenant(context), watcher=method == "WatchEvents")

    # ---- helpers ------------------------------------------------------------------------
    def _tenant(self, context: Ctx) -> str:
        """The caller's tenant, from its verified client certificate and/or its bearer
        token (never from a request field). Charges nothing: see `_caller`.

        A certificate that auth.certificates maps to a tenant is an identity; a bearer
        token sent with it must map to the same tenant, else PERMISSION_DENIED. A token
        alone identifies its tenant. A certificate that maps to no tenant identifies no
        one: without a valid token the call is UNAUTHENTICATED. With neither tokens nor
        certificate mappings configured, every caller is tenant 'default'.
        """
        if not self._tokens and not self._certificates:
            return DEFAULT_TENANT
        cert_tenant = self._certificate_tenant(context)
        auth = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not isinstance(auth, str) or not auth.startswith("Bearer "):
            if cert_tenant is not None:
                return cert_tenant
            if self._mtls and self._certificates:
                raise Unauthenticated(
                    "this client certificate maps to no tenant (auth.certificates) and no "
                    "bearer token was sent: ask the operator to map the certificate, or "
                    "pass Client(target, token=...)"
                )
            raise Unauthenticated(
                "this daemon requires a bearer token: pass Client(target, token=...) "
                "or set KVTIER_TOKEN"
            )
        tenant = self._tokens.get(hash_token(auth[len("Bearer ") :]))
        if tenant is None:
            raise Unauthenticated("unknown bearer token")
        if cert_tenant is not None and cert_tenant != tenant:
            raise PermissionDenied(
                "the client certificate and the bearer token belong to different tenants: "
                "send one identity, or one token of the certificate's tenant"
            )
        return tenant

    def _certificate_tenant(self, context: Ctx) -> str | None:
        """The tenant auth.certificates gives the caller's verified certificate, if any."""
        if not self._mtls or not self._certificates:
            return None
        props = context.auth_context()
        names = [f"cn:{v.decode(errors='replace')}" for v in props.get("x509_common_name", ())]
        names += [f"dns:{v.decode(errors='replace').lower()}" for v in props.get("peer_dns", ())]
        names += [f"uri:{v.decode(errors='replace')}" for v in props.get("peer_uri", ())]
        tenants = {self._certificates[n] for n in names if n in self._certificates}
        if len(tenants) > 1:
            raise PermissionDenied(
                "this client certificate's names map to different tenants in "
                "auth.certificates: the operator must map it to one tenant"
            )
        return tenants.pop() if tenants else None

    def _admit(self, tenant: str) -> None:
        """Charge one request to `tenant`'s rate (limits.requests_per_s)."""
        refusal = self._limiter.admit_request(tenant)
        if refusal is not None:
            raise RateLimited(refusal.message, refusal.retry_after_s)

    def _admit_bytes(self, tenant: str, size_bytes: int) -> None:
        """Charge block payload bytes to `tenant`'s rate (limits.payload_bytes_per_s)."""
        refusal = self._limiter.admit_bytes(tenant, size_bytes)
        if refusal is not None:
            raise RateLimited(refusal.message, refusal.retry_after_s)

    def _caller(self, context: Ctx) -> str:
        """The tenant of an RPC that starts work, charged one request."""
        tenant = self._tenant(context)
        self._admit(tenant)
        return tenant

    def _ns_id(self, tenant: str, namespace: str) -> str:
        if self._draining():
            raise Unavailable("kvtier is shutting down; retry against the restarted daemon")
        check_namespace(namespace, self._limits.max_namespace_chars)
        return namespace_id(tenant, namespace)

    def _block_id(self, context: Ctx, namespace: str, key: bytes) -> BlockId:
        return self._tenant_block(context, namespace, key)[1]

    def _tenant_block(self, context: Ctx, namespace: str, key: bytes) -> tuple[str, BlockId]:
        tenant = self._caller(context)
        ns_id = self._ns_id(tenant, namespace)
        return tenant, (ns_id, check_key(key, self._limits.max_key_bytes))

    # ---- RPCs ---------------------------------------------------------------------------
    async def Put(
        self,
        request_iterator: AsyncIterator[pb.PutRequest | RawChunk],
        context: Ctx,
    ) -> pb.PutResponse:
        messages = aiter(request_iterator)
        idle_s = self._limits.stream_idle_s
        first = await _next_within(messages, idle_s)
        if not isinstance(first, pb.PutRequest) or first.WhichOneof("msg") != "header":
            raise InvalidArgument("a put stream must start with a header message")
        header = first.header
        tenant, block_id = self._tenant_block(context, header.namespace, header.key)
        self._admit_bytes(tenant, header.size_bytes)
        writer = await self._store.put_begin(block_id, header.size_bytes, header.overwrite)
        try:
            while (msg := await _next_within(messages, idle_s)) is not None:
                if isinstance(msg, RawChunk):
                    writer.write(msg.data)
                elif isinstance(msg, pb.PutRequest) and msg.WhichOneof("msg") == "chunk":
                    writer.write(msg.chunk)
                elif isinstance(msg, Undecodable):
                    raise InvalidArgument(
                        f"a put stream message is not valid protobuf ({msg.error}); "
                        "nothing was stored"
                    )
                else:
                    raise InvalidArgument("only data chunks may follow the put header")
            result = await self._store.put_commit(writer, header.xxh3_64)
        finally:
            self._store.put_abort(writer)
        return put_response(result)

    async def PutBlock(self, request: InlinePut, context: Ctx) -> pb.PutResponse:
        """Put in one message: the same checks, the block written and hashed in one pass."""
        header = request.header
        tenant, block_id = self._tenant_block(context, header.namespace, header.key)
        size_bytes = memoryview(request.data).nbytes
        if size_bytes != header.size_bytes:
            raise InvalidArgument(
                f"the PutBlock request carries {size_bytes} bytes but its header declares "
                f"{header.size_bytes}; nothing was stored"
            )
        self._admit_bytes(tenant, size_bytes)
        writer = await self._store.put_begin(block_id, size_bytes, header.overwrite)
        try:
            writer.write(request.data)
            result = await self._store.put_commit(writer, header.xxh3_64)
        finally:
            self._store.put_abort(writer)
        return put_response(result)

    async def Get(
        self,
        request: pb.GetRequest,
        context: Ctx,
    ) -> AsyncIterator[pb.GetResponse | RawChunk]:
        tenant, block_id = self._tenant_block(context, request.namespace, request.key)
        entry = self._store.stat(block_id)
        if entry is not None:  # charged before the bytes move (a read may hit NVMe)
            self._admit_bytes(tenant, entry.size_bytes)
        reader = await self._store.open_block(block_id)
        if reader is None:
            raise NotFound("block not found in this namespace")
        try:
            yield pb.GetResponse(
                header=pb.GetHeader(
                    size_bytes=reader.size_bytes,
                    xxh3_64=reader.xxh3_64,
                    tier=TIER_TO_PB[reader.tier],
                )
            )
            for chunk in reader.chunks(self._chunk_bytes):
                yield RawChunk(chunk)
        finally:
            reader.close()

    async def GetBlock(self, request: pb.GetBlockRequest, context: Ctx) -> bytes:
        """Get in one message, already serialized (a GetBlockResponse): built while the
        block is pinned, since gRPC serializes a unary answer only after the handler has
        returned, when the extent may already hold another block."""
        tenant, block_id = self._tenant_block(context, request.namespace, request.key)
        inline_bytes = min(request.max_inline_bytes or DEFAULT_INLINE_BYTES, INLINE_MAX_BYTES)
        entry = self._store.stat(block_id)
        if entry is not None:
            if entry.size_bytes > inline_bytes:  # nothing opened or charged: Get will be
                header = pb.GetHeader(
                    size_bytes=entry.size_bytes,
                    xxh3_64=entry.xxh3_64,
                    tier=TIER_TO_PB[entry.fastest_tier],
                )
                return get_block_message(header, (), True)
            self._admit_bytes(tenant, entry.size_bytes)  # before the bytes move, as Get
        reader = await self._store.open_block(block_id)
        if reader is None:
            raise NotFound("block not found in this namespace")
        try:
            header = pb.GetHeader(
                size_bytes=reader.size_bytes, xxh3_64=reader.xxh3_64, tier=TIER_TO_PB[reader.tier]
            )
            if reader.size_bytes > inline_bytes:  # replaced meanwhile, or a remote fetch
                return get_block_message(header, (), True)
            return get_block_message(header, list(reader.chunks(INLINE_MAX_BYTES)), False)
        finally:
            reader.close()

    async def Lookup(
        self,
        request: pb.LookupRequest,
        context: Ctx,
    ) -> pb.LookupResponse:
        ns_id = self._ns_id(self._caller(context), request.namespace)
        keys = check_keys(request.keys, self._limits.max_key_bytes)
        result = await self._store.lookup(ns_id, keys)
        return pb.LookupResponse(
            prefix_blocks=result.prefix_blocks,
            tiers=[TIER_NAME_TO_PB[t] for t in result.tiers],
        )

    async def Stat(
        self,
        request: pb.StatRequest,
        context: Ctx,
    ) -> pb.StatResponse:
        entry = self._store.stat(self._block_id(context, request.namespace, request.key))
        if entry is None:
            raise NotFound("block not found in this namespace")
        return pb.StatResponse(info=block_info(entry))

    async def List(
        self,
        request: pb.ListRequest,
        context: Ctx,
    ) -> AsyncIterator[pb.ListEntry]:
        accepts = self._namespace_filter(self._caller(context), request.namespace)
        entries = (e for e in self._store.blocks() if accepts(e.block_id[0]))
        for count, entry in enumerate(entries, start=1):
            yield pb.ListEntry(info=block_info(entry))
            if request.limit and count >= request.limit:
                break

    def _namespace_filter(self, tenant: str, namespace: str) -> Callable[[str], bool]:
        """Which namespace ids a List, Snapshot or WatchEvents of `namespace` (empty: all
        of the tenant's) covers: never another tenant's."""
        if namespace:
            ns_id = self._ns_id(tenant, namespace)
            return lambda candidate: candidate == ns_id
        if self._draining():
            raise Unavailable("kvtier is shutting down")
        prefix = namespace_id(tenant, "")
        return lambda candidate: candidate.startswith(prefix)

    async def Snapshot(
        self,
        request: pb.SnapshotRequest,
        context: Ctx,
    ) -> AsyncIterator[pb.SnapshotResponse]:
        accepts = self._namespace_filter(self._caller(context), request.namespace)
        events = self._store.events
        # Built before the first yield (no await between): exactly the state at `seq`.
        epoch, seq = events.epoch, events.seq
        blocks = [block_info(e) for e in self._store.blocks() if accepts(e.block_id[0])]
        for start in range(0, max(len(blocks), 1), EVENT_BATCH):
            yield pb.SnapshotResponse(
                epoch=epoch, seq=seq, blocks=blocks[start : start + EVENT_BATCH]
            )

    async def WatchEvents(
        self,
        request: pb.WatchEventsRequest,
        context: Ctx,
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        accepts = self._namespace_filter(self._caller(context), request.namespace)
        events = self._store.events
        watcher = None
        try:
            watcher = events.watch(accepts, request.epoch, request.after_seq)
            # The first message, even with nothing to say: the watcher learns the epoch
            # and that it is registered (a change made after it will reach it).
            batch = watcher.queued(EVENT_BATCH)
            while True:
                yield pb.WatchEventsResponse(
                    epoch=events.epoch, events=[block_event(e) for e in batch]
                )
                batch = await watcher.next_batch(EVENT_BATCH)  # []: the daemon is stopping
                if not batch:
                    return
        except Resync as why:  # resuming was not possible, or the watcher fell behind
            logger.info("a watcher must resync: %s", why)
            yield pb.WatchEventsResponse(epoch=events.epoch, resync=True)
        finally:
            if watcher is not None:
                events.unwatch(watcher)

    async def Delete(
        self,
        request: pb.DeleteRequest,
        context: Ctx,
    ) -> pb.DeleteResponse:
        deleted = await self._store.delete(self._block_id(context, request.namespace, request.key))
        return pb.DeleteResponse(deleted=deleted)

    async def Stats(
        self,
        request: pb.StatsRequest,
        context: Ctx,
    ) -> pb.StatsResponse:
        # Counters are node-wide: only callers who can authenticate may read them.
        self._caller(context)
        lag = looplag.running()
        reading = lag.read(reset_recent=True) if lag is not None else None
        return stats_response(self._store.stats(), self._store.policies.name, reading)

    # ---- deciding ---------------------------------------------------------------------------
    async def Plan(self, request: pb.PlanRequest, context: Ctx) -> pb.PlanResponse:
        return await self._plan(0, self._caller(context), request)

    async def ReportPrefill(
        self, request: pb.ReportPrefillRequest, context: Ctx
    ) -> pb.ReportPrefillResponse:
        return await self._report_prefill(0, self._caller(context), request)

    async def _plan(self, session_id: int, tenant: str, request: pb.PlanRequest) -> pb.PlanResponse:
        ns_id = self._ns_id(tenant, request.namespace)
        keys = check_keys(request.keys, self._limits.max_key_bytes)
        overlap = request.overlap or "none"
        if overlap not in OVERLAPS:
            raise InvalidArgument(f"overlap must be one of {', '.join(OVERLAPS)}")
        family = request.family or "any"
        if family not in FAMILIES:
            raise InvalidArgument(f"family must be one of {', '.join(FAMILIES)}")
        tpb = request.tokens_per_block
        if tpb <= 0:
            raise InvalidArgument("tokens_per_block must be > 0")
        prompt = request.prompt_tokens or len(keys) * tpb
        if prompt <= 0 or -(-prompt // tpb) < len(keys):
            raise InvalidArgument(
                f"prompt_tokens={prompt} cannot hold {len(keys)} blocks of {tpb} tokens"
            )
        if -(-prompt // tpb) > self._limits.max_plan_blocks:
            raise InvalidArgument(
                f"prompt_tokens={prompt} in blocks of {tpb} tokens is {-(-prompt // tpb)} "
                f"blocks, more than limits.max_plan_blocks={self._limits.max_plan_blocks}: "
                "plan the prompt in parts or raise the limit"
            )
        plan, costs = await self._store.plan(
            ns_id,
            keys,
            tpb,
            prompt,
            request.engine_cached_blocks,
            overlap,
            request.kv_bytes_per_token,
            family,
        )
        logger.debug("plan %s, %d blocks: %s", request.namespace, len(keys), plan.reason)
        return self._plan_responses(plan, costs)

    async def Prefetch(self, request: pb.PrefetchRequest, context: Ctx) -> pb.PrefetchResponse:
        ns_id = self._ns_id(self._caller(context), request.namespace)
        limits = self._limits
        ttl_s = request.ttl_s or limits.prefetch_ttl_s
        if not math.isfinite(ttl_s) or ttl_s <= 0 or ttl_s > limits.max_prefetch_ttl_s:
            raise InvalidArgument(
                f"ttl_s must be > 0 and at most limits.max_prefetch_ttl_s="
                f"{limits.max_prefetch_ttl_s:g} (0: limits.prefetch_ttl_s)"
            )
        if not request.chains:
            raise InvalidArgument("send at least one chain of keys to prefetch")
        blocks = sum(len(chain.keys) for chain in request.chains)
        if blocks > limits.max_plan_blocks:
            raise InvalidArgument(
                f"{blocks} keys in one Prefetch, more than limits.max_plan_blocks="
                f"{limits.max_plan_blocks}: announce fewer waiting requests per call"
            )
        chains = [check_keys(chain.keys, limits.max_key_bytes) for chain in request.chains]
        done = self._store.prefetch.announce(ns_id, chains, ttl_s)
        return pb.PrefetchResponse(
            accepted_blocks=done.accepted_blocks,
            in_dram=done.in_dram,
            to_promote=done.to_promote,
            not_stored=done.not_stored,
            ttl_s=ttl_s,
        )

    async def _report_prefill(
        self, session_id: int, tenant: str, request: pb.ReportPrefillRequest
    ) -> pb.ReportPrefillResponse:
        ns_id = self._ns_id(tenant, request.namespace)
        if request.end_token <= request.start_token:
            raise InvalidArgument("end_token must be greater than start_token")
        if not math.isfinite(request.seconds) or request.seconds <= 0:
            raise InvalidArgument("seconds must be a positive number")
        estimator = self._store.prefill_estimator(ns_id)
        estimator.observe(request.start_token, request.end_token, request.seconds)
        fit = estimator.estimate()
        logger.debug(
            "prefill %s tokens [%d, %d) took %.4f s; fit a=%.3g s/token c=%.3g s/token^2 "
            "step=%.3g s",
            request.namespace,
            request.start_token,
            request.end_token,
            request.seconds,
            fit.a_s_per_token,
            fit.c_s_per_token2,
            fit.step_s,
        )
        return prefill_response(fit)

    # ---- zero-copy path -------------------------------------------------------------------
    def _session_tenant(self, session_id: int) -> str:
        """The tenant of a live zero-copy session."""
        if self._arena is None:
            raise Unimplemented(
                "the zero-copy path needs the daemon to listen on a UNIX socket; "
                "use put/get (the gRPC byte path) over TCP"
            )
        tenant = self._arena.tenant_of(session_id)
        if tenant is None:
            raise InvalidArgument(f"unknown or ended session {session_id}: call Attach again")
        return tenant

    def _drop_if_session_ended(self, session_id: int) -> None:
        """A lease made after its client left (it waited for DRAM or NVMe meanwhile) has
        nobody to release it: end it now rather than pin its blocks until it expires."""
        assert self._arena is not None
        if self._arena.tenant_of(session_id) is None:
            self._store.release_session(session_id)

    def _session(self, session_id: int, context: Ctx, op: Op) -> tuple[int, str]:
        tenant = self._session_tenant(session_id)
        if tenant != self._tenant(context):
            raise PermissionDenied("this session belongs to another tenant")
        if op not in FINISHING_OPS:
            self._admit(tenant)
        return session_id, tenant

    async def Attach(self, request: pb.AttachRequest, context: Ctx) -> pb.AttachResponse:
        if self._draining():
            raise Unavailable("kvtier is shutting down")
        tenant = self._caller(context)
        if self._arena is None:
            self._session_tenant(0)  # raises Unimplemented
        assert self._arena is not None
        arena_bytes = self._store.arena(tenant).capacity_bytes
        session = self._arena.new_session(tenant, self._limits)
        return pb.AttachResponse(
            session_id=session.session_id,
            nonce=session.nonce,
            arena_socket=str(self._arena.path),
            arena_bytes=arena_bytes,
            lease_ttl_s=self._limits.lease_ttl_s,
        )

    async def _reserve(
        self, session_id: int, tenant: str, request: pb.ReserveRequest
    ) -> pb.ReserveResponse:
        ns_id = self._ns_id(tenant, request.namespace)
        items = [
            ((ns_id, check_key(item.key, self._limits.max_key_bytes)), item.size_bytes)
            for item in request.items
        ]
        self._admit_bytes(tenant, sum(size for _, size in items))
        # Slots in the session's write area: clients never write the arena itself.
        lease_id, slots = await self._store.reserve(
            session_id, items, request.overwrite, staged=True
        )
        self._drop_if_session_ended(session_id)
        return pb.ReserveResponse(
            lease_id=lease_id,
            slots=[pb.Slot(offset=s.offset, size_bytes=s.size_bytes) for s in slots],
        )

    async def _commit(
        self, session_id: int, tenant: str, request: pb.CommitRequest
    ) -> pb.CommitResponse:
        outcomes = await self._store.commit(
            session_id, request.lease_id, list(request.xxh3_64), request.abort
        )
        return pb.CommitResponse(results=commit_results(outcomes))

    async def _stage(
        self, session_id: int, tenant: str, request: pb.StageRequest
    ) -> pb.StageResponse:
        arena_bytes = self._store.arena(tenant).capacity_bytes
        offset, size_bytes = self._store.zero_copy.stage(
            session_id, request.size_bytes, arena_bytes
        )
        return pb.StageResponse(offset=offset, size_bytes=size_bytes)

    async def _put_staged(
        self, session_id: int, tenant: str, request: pb.StagedPutRequest
    ) -> pb.CommitResponse:
        ns_id = self._ns_id(tenant, request.namespace)
        items = [
            (
                (ns_id, check_key(item.key, self._limits.max_key_bytes)),
                item.size_bytes,
                item.offset,
                item.xxh3_64,
            )
            for item in request.items
        ]
        self._admit_bytes(tenant, sum(item[1] for item in items))
        outcomes = await self._store.zero_copy.put_staged(
            session_id, items, request.overwrite, request.ticket
        )
        return pb.CommitResponse(results=commit_results(outcomes))

    async def _acquire(
        self, session_id: int, tenant: str, request: pb.AcquireRequest
    ) -> pb.AcquireResponse:
        ns_id = self._ns_id(tenant, request.namespace)
        keys = [(ns_id, check_key(k, self._limits.max_key_bytes)) for k in request.keys]
        # Charged before the bytes are pinned (an acquire may read them from NVMe).
        entries = [self._store.stat(k) for k in keys]
        self._admit_bytes(tenant, sum(e.size_bytes for e in entries if e is not None))
        lease_id, slots = await self._store.acquire(session_id, keys)
        self._drop_if_session_ended(session_id)
        return pb.AcquireResponse(lease_id=lease_id, blocks=[leased(s) for s in slots])

    async def _hits(self, session_id: int, tenant: str, request: pb.HitsRequest) -> pb.HitsResponse:
        """Direct reads the session's client made (docs/design.md, "Direct reads"): the
        keys are checked as an Acquire's are, in the session's tenant only."""
        ns_id = self._ns_id(tenant, request.namespace)
        max_key_bytes = self._limits.max_key_bytes
        hits = [
            ((ns_id, check_key(hit.key, max_key_bytes)), hit.size_bytes, hit.fetch_seconds)
            for hit in request.hits
        ]
        calls = [(call.blocks, call.bytes, call.seconds) for call in request.calls]
        return pb.HitsResponse(applied=self._store.zero_copy.direct_hits(hits, calls))

    async def _release(
        self, session_id: int, tenant: str, request: pb.ReleaseRequest
    ) -> pb.ReleaseResponse:
        released = self._store.release(
            session_id, list(request.lease_ids), request.fetch_seconds, request.fetch_bytes
        )
        return pb.ReleaseResponse(released=released)

    async def RegisterCuda(
        self, request: pb.RegisterCudaRequest, context: Ctx
    ) -> pb.RegisterCudaResponse:
        session = self._session(request.session_id, context, Op.REGISTER_CUDA)
        return await self._cuda.register(*session, request)

    async def CudaPut(self, request: pb.CudaPutRequest, context: Ctx) -> pb.CudaPutResponse:
        session = self._session(request.session_id, context, Op.CUDA_PUT)
        return await self._cuda.put(*session, request)

    async def CudaGet(self, request: pb.CudaGetRequest, context: Ctx) -> pb.CudaGetResponse:
        session = self._session(request.session_id, context, Op.CUDA_GET)
        return await self._cuda.get(*session, request)

    async def CudaWait(self, request: pb.CudaWaitRequest, context: Ctx) -> pb.CudaGetResponse:
        session = self._session(request.session_id, context, Op.CUDA_WAIT)
        return await self._cuda.wait(*session, request)

    async def Reserve(self, request: pb.ReserveRequest, context: Ctx) -> pb.ReserveResponse:
        session = self._session(request.session_id, context, Op.RESERVE)
        return await self._reserve(*session, request)

    async def Commit(self, request: pb.CommitRequest, context: Ctx) -> pb.CommitResponse:
        session = self._session(request.session_id, context, Op.COMMIT)
        return await self._commit(*session, request)

    async def Acquire(self, request: pb.AcquireRequest, context: Ctx) -> pb.AcquireResponse:
        session = self._session(request.session_id, context, Op.ACQUIRE)
        return await self._acquire(*session, request)

    async def Release(self, request: pb.ReleaseRequest, context: Ctx) -> pb.ReleaseResponse:
        session = self._session(request.session_id, context, Op.RELEASE)
        return await self._release(*session, request)


async def _next_within(messages: AsyncIterator[Any], idle_s: float) -> Any:
    """The stream's next message, None at its end; DeadlineExceeded if none comes within
    `idle_s` (a stalled client would otherwise hold its call slot and the DRAM its put
    reserved for as long as its connection lives)."""
    try:
        async with asyncio.timeout(idle_s):
            return await anext(messages, None)
    except TimeoutError:
        raise DeadlineExceeded(
            f"the put stream sent nothing for {idle_s:g} s (limits.stream_idle_s): it was "
            "ended and nothing was stored; send the chunks without pausing, or ask the "
            "operator to raise limits.stream_idle_s"
        ) from None


def _warn_node_cap(config: Config) -> None:
    warning = node_cap_warning(config)
    if warning is not None:
        logger.warning("%s", warning)


def add_to_server(service: KVTierService, server: grpc.aio.Server) -> None:
    """Register every RPC of the proto's service, with the copy-saving chunk codecs on Put/Get.

    Handlers are built from the service descriptor, so a method added to the proto needs
    only its handler method here.
    """
    custom_deserializers: dict[str, Any] = {
        "Put": put_request_deserializer,
        "PutBlock": put_block_request_deserializer,
    }
    custom_serializers: dict[str, Any] = {
        "Get": get_response_serializer,
        "GetBlock": get_block_response_serializer,
    }
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in pb.DESCRIPTOR.services_by_name["KVTier"].methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        wrap = rpc.stream if method.server_streaming else rpc.unary
        handler = getattr(service, method.name)
        enter = functools.partial(service.enter_call, method.name)
        handlers[method.name] = make(
            wrap(service.telemetry, method.name, handler, enter),
            request_deserializer=tolerant(
                custom_deserializers.get(method.name, request_cls.FromString)
            ),
            response_serializer=custom_serializers.get(method.name, response_cls.SerializeToString),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
