"""The client, written once: each call as an operation that yields the I/O it needs.

An operation (`put`, `plan`, `get_many`, ...) is a generator. It builds its request
messages, yields one step at a time (`Rpc`, `Stream`, `OpenSession`, `SessionCall`,
`SessionSend`), is sent each step's reply, or has the step's failure thrown in (already a
KVTierError), and returns the typed result. It never touches a channel or a socket: the
same "sans-IO" shape as h11's or httpcore's protocol code. `Client` (kvtier/client/sync.py)
carries out the steps blocking, `AsyncClient` (kvtier/client/aio.py) awaiting (`Run`
steps either), and both make their public methods from these functions, so each
method's arguments, docstring and logic exist here only. Calls that return an iterator
(`list_`, `watch_events`) return the `Stream` itself: the caller pulls it item by item.

    op = put("ns", b"k", data)        # nothing has happened yet
    step = op.send(None)              # Rpc("Put", <messages>): the client performs it...
    op.send(reply)                    # ...and sends the reply: StopIteration(value=True)

A step's failure reaches the operation as the exception it is thrown (`get` turns a
NotFound into None; `put_many` aborts its reservation), so cleanup reads as plain
try/except/finally whichever client runs it.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from kvtier._wire import InlineBlock
from kvtier.client._common import (
    CHANNEL_OPTIONS,
    Buffer,
    GetAssembler,
    PemSource,
    as_key,
    as_keys,
    auth_metadata,
    channel_security,
    get_block_request,
    inline_bytes,
    make_calls,
    normalize_target,
    plan_request,
    put_block,
    put_messages,
    translate,
    tune_malloc_once,
)
from kvtier.client._results import (
    BlockStat,
    EventBatch,
    PlanResult,
    PrefetchResult,
    Snapshot,
    Stats,
    block_stat,
    event_batch,
    lookup_result,
    plan_result,
    prefetch_result,
    prefill_cost,
    snapshot_of,
    stats_of,
)
from kvtier.client.cuda import (
    NO_SESSION,
    cuda_ipc_handle,
    found,
    get_request,
    put_request,
    register_request,
    wait_request,
)
from kvtier.client.ways import SPIN_S
from kvtier.client.write_area import WriteArea, stream_class
from kvtier.client.zerocopy import (
    DirectoryReader,
    Parts,
    StreamedPut,
    block_parts,
    commit_results,
    copy_bytes,
    copy_out,
    directory_of,
    fill_slots,
    joined,
    parts_bytes,
    release_request,
    reserve_request,
    staged_put_request,
    staging_bytes,
    write_area_of,
)
from kvtier.errors import InvalidArgument, KVTierError, NotFound, Unavailable, Unimplemented
from kvtier.types import LookupResult, PrefillCost

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
T = TypeVar("T")


class _Timeout(Enum):
    CLIENT = "the client's timeout_s"


CLIENT_TIMEOUT = _Timeout.CLIENT
BYTE_PATH = frozenset({"Put", "Get", "PutBlock", "GetBlock"})
# Attaching the side socket: a daemon flooded with connections that never present their
# nonce closes the oldest waiting ones, a real client's among them if it was descheduled
# between connecting and sending (kvtier/server/arena_socket.py). Such a failure is tried
# again at once a few times, then again after ATTACH_RETRY_S, never given up for good.
ATTACH_TRIES = 3
ATTACH_PAUSE_S = 0.02
ATTACH_RETRY_S = 30.0


# ---- the steps an operation yields ---------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Rpc:
    """A gRPC call with one response (the reply): the KVTier service's `method` with
    `request` (for Put, a client stream: an iterator of messages)."""

    method: str
    request: Any


@dataclass(frozen=True, slots=True)
class Stream(Generic[T]):
    """A server-streaming gRPC call: each message of `method`, as `on_message` makes it.

    Yielded as a step, it is read to its end and the reply is the list of what
    `on_message` returned (an exception from it ends the call). Returned by `list_` and
    `watch_events`, it is what the caller iterates; the call is cancelled when the caller
    stops."""

    method: str
    request: Message
    on_message: Callable[[Any], T]
    timeout_s: float | _Timeout | None = CLIENT_TIMEOUT


@dataclass(frozen=True, slots=True)
class OpenSession:
    """The same-node session (`zerocopy.SharedArena`), attached on first use. The reply is
    the mapped arena, or None where there is none (a TCP target, or the daemon refused)."""


@dataclass(frozen=True, slots=True)
class SessionCall:
    """A request on the session socket (the reply: its `response_type` response); only
    after OpenSession answered with an arena."""

    op: Op
    request: Message
    response_type: type[Message]
    while_waiting: Callable[[], object] | None = None  # run once sent (a streamed put)
    # What the reply's wait is measured under (ways.py): the op, and for a put the size
    # class of its bytes (a put of 64 blocks takes 30x one's: one average would mix them).
    size_class: int = 0


@dataclass(frozen=True, slots=True)
class SessionSend:
    """A request on the session socket that gets no response (Release). The reply is None."""

    op: Op
    request: Message


@dataclass(frozen=True, slots=True)
class HoldStaging:
    """Wait for the session's staging range (`WriteArea.hold_staging`) while another
    put of this client holds it. The reply: True once held, False if the client's
    timeout passed first (the put then reserves and commits instead)."""

    area: WriteArea


Step = Rpc | Stream[Any] | OpenSession | SessionCall | SessionSend | HoldStaging
# Steps that carry a request the daemon answers: the direct reads' pending hits are sent
# on the session socket first, so a Plan (same socket, in order) already counts them, and
# a gRPC call (Stats) almost always does.
REPORTS_HITS_FIRST = (Rpc, Stream, SessionCall)
Operation = Generator[Step, Any, T]


class Run(Generic[T]):
    """One operation being carried out. While `next_step()` gives a step, perform it and
    set `reply` to its reply, or `failure` to the exception the operation is to be thrown;
    after it gives None, `result` is the operation's value. An exception the operation
    raises propagates from `next_step()`."""

    def __init__(self, operation: Operation[T]) -> None:
        self._operation = operation
        self.reply: Any = None
        self.failure: BaseException | None = None
        self.result: T
        # The session its OpenSession gave it: its requests go there and nowhere else (its
        # write area and arena views are that session's).
        self.session: object | None = None

    def next_step(self) -> Step | None:
        reply, failure = self.reply, self.failure
        self.reply = self.failure = None
        try:
            if failure is not None:
                return self._operation.throw(failure)
            return self._operation.send(reply)
        except StopIteration as done:
            self.result = done.value
            return None


def _snapshot_response(message: Any) -> pb.SnapshotResponse:
    return _expect(message, pb.SnapshotResponse)


def _expect(reply: Any, response_type: type[M]) -> M:
    if not isinstance(reply, response_type):
        raise KVTierError(
            f"protocol error: expected {response_type.__name__}, got {type(reply).__name__}"
        )
    return reply


def rpc(method: str, request: Any, response_type: type[M]) -> Operation[M]:
    return _expect((yield Rpc(method, request)), response_type)


def session() -> Operation[memoryview | None]:
    arena = yield OpenSession()
    return arena if isinstance(arena, memoryview) else None


def session_call(
    op: Op,
    request: Message,
    response_type: type[M],
    while_waiting: Callable[[], object] | None = None,
    size_class: int = 0,
) -> Operation[M]:
    call = SessionCall(op, request, response_type, while_waiting, size_class)
    return _expect((yield call), response_type)


def planner_call(op: Op, method: str, request: Message, response_type: type[M]) -> Operation[M]:
    """A planner call on the session socket when there is one: a fraction of gRPC's round
    trip, which the engine pays on its scheduling path. Else over gRPC."""
    if (yield from session()) is not None:
        return (yield from session_call(op, request, response_type))
    return (yield from rpc(method, request, response_type))


def gpu_call(op: Op, request: Message, response_type: type[M]) -> Operation[M]:
    """A CUDA IPC call: handles only mean something to a daemon on the same node."""
    if (yield from session()) is None:
        raise Unimplemented(NO_SESSION)
    return (yield from session_call(op, request, response_type))


# ---- the operations: one per public method of Client and AsyncClient -----------------------
def put(namespace: str, key: bytes | str, data: Buffer, overwrite: bool = False) -> Operation[bool]:
    """Store `data`; True if stored now, False if these exact bytes were already there."""
    # Up to INLINE_MAX_BYTES in one message (PutBlock): a client stream costs about twice
    # a unary call's fixed overhead. Larger blocks, and daemons older than PutBlock, stream.
    request = put_block(namespace, as_key(key), data, overwrite)
    if request is not None:
        try:
            return not (yield from rpc("PutBlock", request, pb.PutResponse)).already_present
        except Unimplemented:
            pass
    messages = put_messages(namespace, as_key(key), data, overwrite)
    return not (yield from rpc("Put", messages, pb.PutResponse)).already_present


def get(namespace: str, key: bytes | str) -> Operation[bytes | None]:
    """The block's bytes, exactly as put, or None when it is not cached."""
    # One message (GetBlock) when the block fits in one; else, or from a daemon older than
    # GetBlock, the Get stream.
    try:
        reply = yield Rpc("GetBlock", get_block_request(namespace, as_key(key)))
    except NotFound:
        return None
    except Unimplemented:
        reply = None
    if isinstance(reply, InlineBlock) and not reply.use_stream:
        return inline_bytes(reply)
    out = GetAssembler()
    try:
        yield Stream("Get", pb.GetRequest(namespace=namespace, key=as_key(key)), out.feed)
    except NotFound:
        return None
    return out.result()


def lookup(namespace: str, keys: Sequence[bytes | str]) -> Operation[LookupResult]:
    """How many leading keys of the chain are cached, and the tier of each key."""
    request = pb.LookupRequest(namespace=namespace, keys=as_keys(keys))
    return lookup_result((yield from rpc("Lookup", request, pb.LookupResponse)))


def stat(namespace: str, key: bytes | str) -> Operation[BlockStat | None]:
    """The block's metadata (size, checksum, tiers), or None when it is not cached."""
    request = pb.StatRequest(namespace=namespace, key=as_key(key))
    try:
        resp = yield from rpc("Stat", request, pb.StatResponse)
    except NotFound:
        return None
    return block_stat(resp.info)


def list_(namespace: str = "", limit: int = 0) -> Stream[BlockStat]:
    """The metadata of each block of `namespace` (empty: of every namespace of this
    tenant), at most `limit` of them (0: all)."""
    request = pb.ListRequest(namespace=namespace, limit=limit)
    return Stream("List", request, lambda entry: block_stat(entry.info))


def snapshot(namespace: str = "") -> Operation[Snapshot]:
    """Every block of `namespace` (empty: of every namespace of this tenant) and its
    tiers, as of event `seq`: watch_events(epoch, seq) continues from it."""
    request = pb.SnapshotRequest(namespace=namespace)
    return snapshot_of((yield Stream("Snapshot", request, _snapshot_response)))


def watch_events(
    namespace: str = "", epoch: str = "", after_seq: int = 0, *, timeout_s: float | None = None
) -> Stream[EventBatch]:
    """Residency events as they happen (the first batch may be empty: it says the
    epoch). With `epoch` and `after_seq` (from a snapshot or the last event seen) it
    resumes exactly there, or yields one batch with `resync` and ends. Runs until the
    daemon stops, `timeout_s` passes (then Unavailable, "deadline exceeded"), or the caller
    stops iterating."""
    request = pb.WatchEventsRequest(namespace=namespace, epoch=epoch, after_seq=after_seq)
    return Stream("WatchEvents", request, event_batch, timeout_s)


def delete(namespace: str, key: bytes | str) -> Operation[bool]:
    """True if a block was removed, False if there was none."""
    request = pb.DeleteRequest(namespace=namespace, key=as_key(key))
    return bool((yield from rpc("Delete", request, pb.DeleteResponse)).deleted)


def stats() -> Operation[Stats]:
    """The daemon's counters, and under `tiers` each tier's (used_bytes, capacity_bytes,
    ...)."""
    return stats_of((yield from rpc("Stats", pb.StatsRequest(), pb.StatsResponse)))


def plan(
    namespace: str,
    keys: Sequence[bytes | str],
    tokens_per_block: int,
    engine_cached_blocks: int = 0,
    overlap: str = "none",
    prompt_tokens: int | None = None,
    kv_bytes_per_token: int | None = None,
    family: str = "any",
) -> Operation[PlanResult]:
    """Per block of the chain: fetch (from which tier) or recompute, and the estimates.
    `family="prefix"`: the engine can only load right after its own blocks (vLLM), so the
    plan fetches [engine_cached_blocks, fetch_end) or nothing, and recomputes the rest."""
    request = plan_request(
        namespace,
        as_keys(keys),
        tokens_per_block,
        engine_cached_blocks,
        overlap,
        prompt_tokens,
        kv_bytes_per_token,
        family,
    )
    return plan_result((yield from planner_call(Op.PLAN, "Plan", request, pb.PlanResponse)))


def report_prefill(
    namespace: str, start_token: int, end_token: int, seconds: float
) -> Operation[PrefillCost]:
    """Tell the daemon how long prefilling tokens [start, end) took; returns its estimate."""
    request = pb.ReportPrefillRequest(
        namespace=namespace, start_token=start_token, end_token=end_token, seconds=seconds
    )
    resp = yield from planner_call(
        Op.REPORT_PREFILL, "ReportPrefill", request, pb.ReportPrefillResponse
    )
    return prefill_cost(resp)


def prefetch(
    namespace: str, chains: Sequence[Sequence[bytes | str]], ttl_s: float = 0.0
) -> Operation[PrefetchResult]:
    """Announce the chains of requests waiting in the engine's queue (nearest deadline
    first): the daemon promotes their NVMe blocks into DRAM in the background and keeps
    them there until loaded or `ttl_s` (0: the daemon's limits.prefetch_ttl_s) passes."""
    request = pb.PrefetchRequest(
        namespace=namespace,
        chains=[pb.PrefetchChain(keys=as_keys(chain)) for chain in chains],
        ttl_s=ttl_s,
    )
    return prefetch_result((yield from rpc("Prefetch", request, pb.PrefetchResponse)))


# The zero-copy path (same node, UNIX socket); elsewhere the same calls go over gRPC.
def put_from(
    namespace: str, key: bytes | str, buffer: Any, overwrite: bool = False
) -> Operation[bool]:
    """Store a block straight from `buffer` through the shared arena (one copy, no gRPC
    payload). True if stored now, False if the same bytes were already there."""
    return (yield from put_many(namespace, [(key, buffer)], overwrite))[0]


def get_into(
    namespace: str, key: bytes | str, buffer: Any, verify: bool = False
) -> Operation[int | None]:
    """Copy a block into `buffer` (any writable buffer); bytes written, or None on a miss."""
    return (yield from get_many(namespace, [key], [buffer], verify))[0]


def put_many(
    namespace: str, items: Sequence[tuple[bytes | str, Any]], overwrite: bool = False
) -> Operation[list[bool]]:
    """Store many blocks in one exchange with the daemon (two with an older one). A block's buffer
    may be a list of buffers holding it back to back (one per layer, say): each is
    copied into place, never joined first."""
    blocks = [block_parts(buf, writable=False) for _, buf in items]
    arena = yield from session()
    area = write_area_of(arena) if arena is not None else None
    if area is None:
        stored = []
        for (key, _), parts in zip(items, blocks, strict=True):
            stored.append((yield from put(namespace, key, joined(parts), overwrite)))
        return stored
    keys = [as_key(k) for k, _ in items]
    # A put waits for another's staging range rather than reserve and commit in two
    # exchanges: a request of another thread between them could wait for that DRAM, which
    # only the Commit sent after its reply frees (it failed after reserve_wait_s).
    if isinstance(area, WriteArea) and area.one_exchange and (yield from _hold(area)):
        try:
            # One exchange: the blocks go to the session's staging range (Stage grows it).
            total = sum(parts_bytes(p) for p in blocks)
            size = stream_class(total)
            streamed = area.streams_put(total)
            need = staging_bytes(blocks, streamed)
            if area.staging is None or area.staging[1] < need:
                try:
                    staged = yield from session_call(
                        Op.STAGE, pb.StageRequest(size_bytes=need), pb.StageResponse
                    )
                    area.staging = (staged.offset, staged.size_bytes)
                except (InvalidArgument, Unimplemented):
                    area.staging = None  # too large, or an older daemon: two exchanges
            began_s = time.perf_counter()
            if area.staging is not None and area.staging[1] >= need and streamed:
                # The daemon copies behind this client's copy, which runs once it is sent.
                stream = StreamedPut(area, namespace, keys, blocks, overwrite)
                done = yield from session_call(
                    Op.PUT_STAGED, stream.request, pb.CommitResponse, stream.write, size
                )
                area.put_took(total, True, time.perf_counter() - began_s)
                return commit_results(done)
            if area.staging is not None and area.staging[1] >= need:
                staged_put = staged_put_request(area, namespace, keys, blocks, overwrite)
                done = yield from session_call(
                    Op.PUT_STAGED, staged_put, pb.CommitResponse, size_class=size
                )
                area.put_took(total, False, time.perf_counter() - began_s)
                return commit_results(done)
        finally:
            area.drop_staging()
    request = reserve_request(namespace, keys, blocks, overwrite)
    reserved = yield from session_call(Op.RESERVE, request, pb.ReserveResponse)
    try:
        checksums = fill_slots(area, reserved.slots, blocks)
    except BaseException:
        abort = pb.CommitRequest(lease_id=reserved.lease_id, abort=True)
        yield from session_call(Op.COMMIT, abort, pb.CommitResponse)
        raise
    commit = pb.CommitRequest(lease_id=reserved.lease_id, xxh3_64=checksums)
    return commit_results((yield from session_call(Op.COMMIT, commit, pb.CommitResponse)))


def _hold(area: WriteArea) -> Operation[bool]:
    """The staging range, waited for while another put holds it (see put_many)."""
    if area.hold_staging():
        return True
    step = HoldStaging(area)
    try:
        return bool((yield step))
    except BaseException:
        area.drop_staging_of(step)  # taken for this step before the failure came
        raise


def get_many(
    namespace: str, keys: Sequence[bytes | str], buffers: Sequence[Any], verify: bool = False
) -> Operation[list[int | None]]:
    """Copy many blocks into their buffers with one round trip; None for each miss. A
    block's buffer may be a list of buffers, filled in order (as put_many takes them)."""
    if len(keys) != len(buffers):
        raise InvalidArgument("get_many needs one buffer per key")
    call_started_s = time.perf_counter()  # the direct reads' call, as the caller waits
    views = [block_parts(buf, writable=True) for buf in buffers]
    arena = yield from session()
    if arena is None:
        copied_bytes = []
        for key, parts in zip(keys, views, strict=True):
            copied_bytes.append(copy_bytes((yield from get(namespace, key)), parts))
        return copied_bytes
    key_bytes = as_keys(keys)
    directory = directory_of(arena)
    if directory is None:
        return (yield from _acquire_into(namespace, key_bytes, views, arena, verify))
    # Direct reads first (no round trip); what they miss is acquired in one batch.
    out: list[int | None] = []
    due = False
    hit_blocks = hit_bytes = 0
    for key, parts in zip(key_bytes, views, strict=True):
        started_s = time.perf_counter()
        size = directory.read_into(namespace, key, arena, parts, verify)
        if size is not None:
            due |= directory.hit(namespace, key, size, time.perf_counter() - started_s)
            hit_blocks += 1
            hit_bytes += size
        out.append(size)
    if hit_blocks:
        directory.call(namespace, hit_blocks, hit_bytes, time.perf_counter() - call_started_s)
    missed = [i for i, size in enumerate(out) if size is None]
    if missed or due:
        for hits in directory.take_hits():  # ahead of the Acquire: no reply awaited
            yield SessionSend(Op.HITS, hits)
    if missed:
        acquired = yield from _acquire_into(
            namespace, [key_bytes[i] for i in missed], [views[i] for i in missed], arena, verify
        )
        for i, size in zip(missed, acquired, strict=True):
            out[i] = size
    return out


def _acquire_into(
    namespace: str, keys: list[bytes], views: list[Parts], arena: memoryview, verify: bool
) -> Operation[list[int | None]]:
    """Pin the blocks under one lease, copy them out, release it (no reply awaited)."""
    request = pb.AcquireRequest(namespace=namespace, keys=keys)
    started_s = time.perf_counter()
    leased = yield from session_call(Op.ACQUIRE, request, pb.AcquireResponse)
    copied: list[int | None] = []
    try:
        copied = copy_out(arena, leased.blocks, views, verify)
        return copied
    finally:
        if leased.lease_id:
            # No reply awaited: the caller has its bytes; the pin goes a moment later.
            yield SessionSend(Op.RELEASE, release_request(leased.lease_id, started_s, copied))


# GPU engines: CUDA IPC (same node; the daemon serves the GPU).
def register_cuda(tensor: Any) -> Operation[int]:
    """Register a contiguous CUDA tensor (the engine's KV cache) once; blocks are then
    named by (offset, size) in bytes. It must stay allocated while registered (until
    this client closes). Returns the buffer id."""
    return (yield from register_cuda_handle(*cuda_ipc_handle(tensor)))


def register_cuda_handle(
    device: int, ipc_handle: bytes, offset_bytes: int, size_bytes: int
) -> Operation[int]:
    """`register_cuda` from a raw cudaIpcMemHandle (and the tensor's offset in its
    allocation), for engines that are not torch."""
    request = register_request(device, ipc_handle, offset_bytes, size_bytes)
    return (yield from gpu_call(Op.REGISTER_CUDA, request, pb.RegisterCudaResponse)).buffer_id


def put_from_cuda(
    namespace: str,
    keys: Sequence[bytes | str],
    buffer_id: int,
    block_slices: Sequence[tuple[int, int]],
    overwrite: bool = False,
) -> Operation[list[bool]]:
    """Store blocks straight from GPU memory, each a (offset, size) in bytes of the
    registered buffer (the daemon copies them on its streams); per block: stored now,
    or already there. Returns once the copies are done."""
    request = put_request(namespace, keys, buffer_id, block_slices, overwrite)
    return commit_results((yield from gpu_call(Op.CUDA_PUT, request, pb.CudaPutResponse)))


def get_into_cuda(
    namespace: str,
    keys: Sequence[bytes | str],
    buffer_id: int,
    block_slices: Sequence[tuple[int, int]],
) -> Operation[list[bool]]:
    """Copy cached blocks into GPU memory; per block found (False: a miss, its range
    untouched). Returns once the copies are done."""
    request = get_request(namespace, keys, buffer_id, block_slices)
    return found((yield from gpu_call(Op.CUDA_GET, request, pb.CudaGetResponse)))


def start_get_into_cuda(
    namespace: str,
    keys: Sequence[bytes | str],
    buffer_id: int,
    block_slices: Sequence[tuple[int, int]],
    group_sizes: Sequence[int],
) -> Operation[int]:
    """Start a grouped get_into_cuda; the request id that `cuda_wait` names."""
    request = get_request(namespace, keys, buffer_id, block_slices, group_sizes)
    return (yield from gpu_call(Op.CUDA_GET, request, pb.CudaGetResponse)).request_id


def cuda_wait(request_id: int, group: int) -> Operation[list[bool]]:
    """Wait for one group of a started grouped get; per block found."""
    request = wait_request(request_id, group)
    return found((yield from gpu_call(Op.CUDA_WAIT, request, pb.CudaGetResponse)))


# ---- what both clients hold ----------------------------------------------------------------
class _Arena(Protocol):
    view: memoryview
    directory: DirectoryReader | None

    def close(self) -> None: ...


ArenaT = TypeVar("ArenaT", bound=_Arena)
ChannelT = TypeVar("ChannelT")


class ClientBase(ABC, Generic[ArenaT, ChannelT]):
    """The state both clients share: the target, the credentials, the channel and the
    same-node session. Lifecycle: construction opens the channel (no I/O until the first
    call); the first call that can use the session attaches it (`OpenSession`); a lost
    session is closed, and the next call attaches again; `close()` ends both.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout_s: float | None = 60.0,
        token: str | None = None,
        tls: bool | None = None,
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
        tls_server_name: str | None = None,
        tune_malloc: bool = True,
        direct_reads: bool = True,
        spin_s: float | None = None,
    ) -> None:
        self.target = normalize_target(target)
        # False: every zero-copy get acquires a lease, never reads the directory itself.
        self.direct_reads = direct_reads
        # The sync client's poll for a session reply (client/ways.py).
        self.spin_s = SPIN_S if spin_s is None else max(spin_s, 0.0)
        # The byte path's multi-MiB messages: see kvtier/_malloc.py. False leaves this
        # process's allocator as it is (then a 4 MiB get costs page faults in every copy).
        self._tune_malloc = tune_malloc
        self.timeout_s = timeout_s
        self._metadata = auth_metadata(token)
        security = channel_security(self.target, tls, tls_ca, tls_cert, tls_key, tls_server_name)
        self._channel = self._open_channel(
            security.credentials, [*CHANNEL_OPTIONS, *security.options]
        )
        calls = make_calls(self._channel)
        self._stub, self._put, self._get = calls.stub, calls.put, calls.get
        self._put_block, self._get_block = calls.put_block, calls.get_block
        self._arena: ArenaT | None = None
        self._attach_lock = threading.Lock()  # threads of one Client attach one session
        self._zero_copy_possible = self.target.startswith("unix:")
        self._attach_again_at_s = 0.0  # after transient failures: not before then

    @abstractmethod
    def _open_channel(
        self, credentials: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]
    ) -> ChannelT:
        """The channel to `self.target`: plain when `credentials` is None, else TLS."""

    def _grpc(
        self, method: str, request: Any, timeout_s: float | _Timeout | None = CLIENT_TIMEOUT
    ) -> Any:
        """Start the call: its response (blocking), or what to await or iterate (asyncio,
        and every server stream)."""
        timeout = self.timeout_s if timeout_s is CLIENT_TIMEOUT else timeout_s
        # The byte path's calls carry the copy-saving codecs; the others are the stub's own.
        if method == "Put":
            call = self._put
        elif method == "Get":
            call = self._get
        elif method == "PutBlock":
            call = self._put_block
        elif method == "GetBlock":
            call = self._get_block
        else:
            call = getattr(self._stub, method)
        if self._tune_malloc and method in BYTE_PATH:
            tune_malloc_once()
        return call(request, timeout=timeout, metadata=self._metadata)

    def _attached(self, run: Run[Any] | None = None) -> ArenaT:
        """The session `run`'s requests go to: the one its OpenSession gave it. A session
        another call attached since (after this one was lost) is not it: its write area
        and arena views are not the ones `run` holds, so its requests would name bytes it
        never wrote."""
        arena = self._arena
        if arena is None:  # another call lost it since this operation's OpenSession
            raise Unavailable("the session with the daemon is closed")
        if run is not None and run.session is not None and run.session is not arena:
            raise Unavailable("the session this call began on was lost; call again")
        return arena

    def _attached_now(self, arena: ArenaT) -> ArenaT:
        """A session just attached, set up as this client wants it."""
        if arena.directory is not None:
            arena.directory.enabled = arena.directory.enabled and self.direct_reads
        return arena

    def _pending_hits(self) -> list[pb.HitsRequest]:
        """The direct reads not reported yet, taken (sent before the next request)."""
        arena = self._arena
        if arena is None or arena.directory is None or not arena.directory.pending:
            return []
        return arena.directory.take_hits()

    def _may_attach(self) -> bool:
        return (
            self._arena is None
            and self._zero_copy_possible
            and time.monotonic() >= self._attach_again_at_s
        )

    def _attach_failed(self, err: Exception, tries_left: int) -> bool:
        """After a failed attach: True to try again now (after ATTACH_PAUSE_S)."""
        code = err.code() if isinstance(err, grpc.RpcError) else None
        if isinstance(err, grpc.RpcError) and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # Over a rate limit for now: not a reason to give up zero-copy.
            raise translate(err) from None
        # The side socket shed or reset (OSError, Unavailable): this attach, not the path.
        transient = isinstance(err, (OSError, Unavailable)) or code == grpc.StatusCode.UNAVAILABLE
        if transient and tries_left > 0:
            return True
        if transient:
            self._attach_again_at_s = time.monotonic() + ATTACH_RETRY_S
            logger.info(
                "zero-copy path unavailable for now (%s); using the gRPC byte path, "
                "attaching again in %.0f s",
                err,
                ATTACH_RETRY_S,
            )
        else:
            self._zero_copy_possible = False
            logger.info("zero-copy path unavailable (%s); using the gRPC byte path", err)
        return False

    def _close_session(self) -> None:
        if self._arena is not None:
            self._arena.close()  # the daemon ends the session and any lease left
            self._arena = None

    def _failure(self, err: BaseException) -> BaseException:
        """What an operation is told when one of its steps failed: a gRPC status or a lost
        session as the KVTierError for it, anything else (a cancellation) as it is."""
        if isinstance(err, grpc.RpcError):
            return translate(err)
        if isinstance(err, OSError):
            self._close_session()  # the next call attaches again
            return Unavailable(f"lost the session with the daemon: {err}")
        return err


_SELF = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
F = TypeVar("F", bound=Callable[..., Any])


def as_method(method: F, operation: Callable[..., Any]) -> F:
    """`method`, which runs `operation`, named and documented as it: its docstring, and
    its signature with `self` first, so that help() and editors show the real arguments.
    A trailing underscore (`list_`, to keep the builtin's name free) is dropped."""
    method.__name__ = method.__qualname__ = operation.__name__.rstrip("_")
    method.__doc__ = operation.__doc__
    signature = inspect.signature(operation)
    method.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[_SELF, *signature.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )
    return method
