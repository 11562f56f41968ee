"""The client's operations (kvtier/client/_core.py) driven step by step, with no daemon: the
requests they build, how they read replies, and how failures reach them."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import grpc
import pytest
import xxhash

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from kvtier._wire import INLINE_MAX_BYTES, InlineBlock, InlinePut, RawChunk
from kvtier.client import _core
from kvtier.client._common import translate
from kvtier.client._core import OpenSession, Rpc, Run, SessionCall, SessionSend, Step, Stream
from kvtier.errors import (
    AlreadyExists,
    DataLoss,
    InvalidArgument,
    KVTierError,
    NotFound,
    PermissionDenied,
    RateLimited,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "", trailing: Any = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailing


def drive(operation: _core.Operation[Any], replies: Iterable[Any]) -> tuple[list[Step], Any]:
    """Run `operation`, answering its steps in turn with `replies` (an exception is thrown
    in, as a client does with a failed step): the steps it took and its result."""
    run = Run(operation)
    steps: list[Step] = []
    answers = iter(replies)
    while (step := run.next_step()) is not None:
        steps.append(step)
        answer = next(answers)
        if isinstance(answer, BaseException):
            run.failure = answer
        else:
            run.reply = answer
    assert next(answers, None) is None, "the operation took fewer steps than expected"
    return steps, run.result


@pytest.mark.parametrize(
    ("code", "trailing", "expected", "retry_after_s"),
    [
        (grpc.StatusCode.NOT_FOUND, (), NotFound, None),
        (grpc.StatusCode.ALREADY_EXISTS, (), AlreadyExists, None),
        (grpc.StatusCode.PERMISSION_DENIED, (), PermissionDenied, None),
        (grpc.StatusCode.DATA_LOSS, (), DataLoss, None),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, (), ResourceExhausted, None),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, (("retry-after-ms", "250"),), RateLimited, 0.25),
        (grpc.StatusCode.DEADLINE_EXCEEDED, (), Unavailable, None),
        (grpc.StatusCode.INTERNAL, (), KVTierError, None),
    ],
)
def test_a_grpc_status_maps_to_its_exception(
    code: grpc.StatusCode, trailing: Any, expected: type[KVTierError], retry_after_s: float | None
) -> None:
    err = translate(FakeRpcError(code, "why", trailing))
    assert type(err) is expected
    assert "why" in str(err)
    if retry_after_s is not None:
        assert isinstance(err, RateLimited) and err.retry_after_s == retry_after_s


def put_header(data: bytes, overwrite: bool) -> pb.PutHeader:
    return pb.PutHeader(
        namespace="m/l",
        key=b"k",
        size_bytes=len(data),
        xxh3_64=xxhash.xxh3_64_intdigest(data),
        overwrite=overwrite,
    )


def test_put_sends_one_checksummed_message_up_to_the_inline_limit() -> None:
    data = bytes(range(256)) * 9
    run = Run(_core.put("m/l", "k", data, overwrite=True))
    step = run.next_step()
    assert isinstance(step, Rpc) and step.method == "PutBlock"
    assert isinstance(step.request, InlinePut)
    assert step.request.header == put_header(data, overwrite=True)
    assert bytes(step.request.data) == data
    run.reply = pb.PutResponse(already_present=True)
    assert run.next_step() is None and run.result is False  # already there: not stored now


def assert_put_stream(step: Step | None, data: bytes) -> None:
    assert isinstance(step, Rpc) and step.method == "Put"
    header, *chunks = list(step.request)
    assert header.header == put_header(data, overwrite=False)
    assert b"".join(bytes(c.data) for c in chunks) == data


def test_put_streams_a_block_larger_than_one_message() -> None:
    data = bytes(INLINE_MAX_BYTES + 1)
    run = Run(_core.put("m/l", "k", data))
    assert_put_stream(run.next_step(), data)
    run.reply = pb.PutResponse()
    assert run.next_step() is None and run.result is True


def test_put_to_a_daemon_without_putblock_streams_instead() -> None:
    data = b"abc"
    run = Run(_core.put("m/l", "k", data))
    assert isinstance(run.next_step(), Rpc)
    run.failure = Unimplemented("Method not found!")
    assert_put_stream(run.next_step(), data)
    run.reply = pb.PutResponse()
    assert run.next_step() is None and run.result is True


def get_header(data: bytes, tier: int = pb.TIER_DRAM) -> pb.GetResponse:
    size, checksum = len(data), xxhash.xxh3_64_intdigest(data)
    return pb.GetResponse(header=pb.GetHeader(size_bytes=size, xxh3_64=checksum, tier=tier))


def inline(data: bytes, use_stream: bool = False, sent: bytes | None = None) -> InlineBlock:
    """A GetBlock answer for `data` (carrying `sent` instead, to damage it)."""
    header = get_header(data).header
    return InlineBlock(header, b"" if use_stream else data if sent is None else sent, use_stream)


def test_get_reads_one_message_and_checks_it() -> None:
    steps, got = drive(_core.get("ns", b"k"), [inline(b"abcd")])
    request = pb.GetBlockRequest(namespace="ns", key=b"k", max_inline_bytes=INLINE_MAX_BYTES)
    assert steps == [Rpc("GetBlock", request)]
    assert got == b"abcd" and type(got) is bytes
    assert drive(_core.get("ns", b"k"), [inline(b"")])[1] == b""


def test_get_assembles_the_stream_and_checks_it() -> None:
    for first in (inline(b"abcd", use_stream=True), Unimplemented("Method not found!")):
        run = Run(_core.get("ns", b"k"))
        assert isinstance(run.next_step(), Rpc)
        if isinstance(first, BaseException):
            run.failure = first  # a daemon older than GetBlock
        else:
            run.reply = first  # too large for one message
        step = run.next_step()
        assert isinstance(step, Stream) and step.request == pb.GetRequest(namespace="ns", key=b"k")
        run.reply = [step.on_message(m) for m in (get_header(b"abcd"), RawChunk(b"ab"))]
        run.reply = [*run.reply, step.on_message(pb.GetResponse(chunk=b"cd"))]
        assert run.next_step() is None and run.result == b"abcd"


@pytest.mark.parametrize("sent", [b"abce", b"abc", b"abcde"])
def test_get_of_a_missing_block_is_none_and_of_damaged_bytes_data_loss(sent: bytes) -> None:
    assert drive(_core.get("ns", b"k"), [NotFound("no such block")])[1] is None
    with pytest.raises(DataLoss):
        drive(_core.get("ns", b"k"), [inline(b"abcd", sent=sent)])
    run = Run(_core.get("ns", b"k"))
    run.next_step()
    run.reply = inline(b"abcd", use_stream=True)
    step = run.next_step()
    assert isinstance(step, Stream)
    step.on_message(get_header(b"abcd"))
    step.on_message(RawChunk(b"abce"))
    with pytest.raises(DataLoss):
        run.next_step()


def test_a_failure_the_operation_does_not_handle_propagates() -> None:
    with pytest.raises(PermissionDenied):
        drive(_core.stat("ns", b"k"), [PermissionDenied("another tenant's")])
    assert drive(_core.stat("ns", b"k"), [NotFound("gone")])[1] is None


def test_lookup_sends_the_keys_and_names_the_tiers() -> None:
    reply = pb.LookupResponse(prefix_blocks=2, tiers=[pb.TIER_HBM, pb.TIER_NVME, 0])
    steps, result = drive(_core.lookup("ns", ["a", b"b", "c"]), [reply])
    assert steps == [Rpc("Lookup", pb.LookupRequest(namespace="ns", keys=[b"a", b"b", b"c"]))]
    assert result == kvtier.LookupResult(2, ["hbm", "nvme", None])


def test_a_reply_of_the_wrong_type_is_a_protocol_error() -> None:
    with pytest.raises(KVTierError, match="protocol error: expected LookupResponse"):
        drive(_core.lookup("ns", [b"a"]), [pb.StatsResponse()])


def test_plan_goes_over_the_session_when_attached_else_grpc() -> None:
    reply = pb.PlanResponse(
        total_s=1.5, engine_blocks=1, fetch_start=1, fetch_end=2, tiers=[0, pb.TIER_DRAM, 0]
    )
    reply.fetch_s.extend([0.0, 0.1, 0.0])
    reply.recompute_s.extend([0.2, 0.3, 0.4])
    arena = memoryview(bytearray(16))
    steps, via_session = drive(_core.plan("ns", [b"a", b"b", b"c"], 16), [arena, reply])
    assert isinstance(steps[0], OpenSession)
    assert isinstance(steps[1], SessionCall) and steps[1].op is Op.PLAN
    assert steps[1].request.tokens_per_block == 16 and steps[1].request.overlap == "none"
    steps, via_grpc = drive(_core.plan("ns", [b"a", b"b", b"c"], 16), [None, reply])
    assert isinstance(steps[1], Rpc) and steps[1].method == "Plan"
    assert via_session == via_grpc
    assert isinstance(via_grpc, kvtier.PlanResult)
    assert [b.action for b in via_grpc.blocks] == ["engine", "fetch", "recompute"]
    assert via_grpc.blocks[1] == kvtier.BlockPlan(1, "fetch", "dram", 0.1, 0.3)


def test_report_prefill_returns_the_daemons_estimate() -> None:
    reply = pb.ReportPrefillResponse(a_s_per_token=1e-4, c_s_per_token2=1e-8, step_s=0.01)
    steps, cost = drive(_core.report_prefill("ns", 0, 512, 0.07), [None, reply])
    assert steps[1] == Rpc(
        "ReportPrefill",
        pb.ReportPrefillRequest(namespace="ns", start_token=0, end_token=512, seconds=0.07),
    )
    assert cost == kvtier.PrefillCost(1e-4, 1e-8, 0.01)


def test_cuda_calls_need_the_session() -> None:
    with pytest.raises(Unimplemented, match="UNIX socket"):
        drive(_core.register_cuda_handle(0, b"h" * 64, 0, 4096), [None])
    reply = pb.RegisterCudaResponse(buffer_id=7)
    steps, buffer_id = drive(
        _core.register_cuda_handle(0, b"h" * 64, 0, 4096), [memoryview(b""), reply]
    )
    assert isinstance(steps[1], SessionCall) and steps[1].op is Op.REGISTER_CUDA
    assert buffer_id == 7


def test_put_many_without_a_session_puts_each_block_over_grpc() -> None:
    steps, stored = drive(
        _core.put_many("ns", [("a", b"1"), ("b", [b"2", b"3"])]),
        [None, pb.PutResponse(), pb.PutResponse(already_present=True)],
    )
    assert [type(s) for s in steps] == [OpenSession, Rpc, Rpc]
    assert stored == [True, False]


def test_put_many_copies_into_the_reserved_slots_and_commits_their_checksums() -> None:
    arena = memoryview(bytearray(64))
    reserved = pb.ReserveResponse(
        lease_id=9, slots=[pb.Slot(offset=0, size_bytes=4), pb.Slot(offset=32, size_bytes=3)]
    )
    committed = pb.CommitResponse(
        results=[pb.CommitResult(stored=True), pb.CommitResult(stored=False)]
    )
    steps, stored = drive(
        _core.put_many("ns", [("a", b"abcd"), ("b", [b"x", b"yz"])]),
        [arena, reserved, committed],
    )
    reserve, commit = steps[1], steps[2]
    assert isinstance(reserve, SessionCall) and reserve.op is Op.RESERVE
    assert [(i.key, i.size_bytes) for i in reserve.request.items] == [(b"a", 4), (b"b", 3)]
    assert bytes(arena[0:4]) == b"abcd" and bytes(arena[32:35]) == b"xyz"
    assert isinstance(commit, SessionCall) and commit.op is Op.COMMIT
    assert commit.request.lease_id == 9 and not commit.request.abort
    assert list(commit.request.xxh3_64) == [
        xxhash.xxh3_64_intdigest(b"abcd"),
        xxhash.xxh3_64_intdigest(b"xyz"),
    ]
    assert stored == [True, False]


def test_put_many_aborts_its_reservation_when_the_copy_fails() -> None:
    arena = memoryview(bytearray(8))
    reserved = pb.ReserveResponse(lease_id=3, slots=[pb.Slot(offset=6, size_bytes=4)])
    run = Run(_core.put_many("ns", [("a", b"abcd")]))
    assert isinstance(run.next_step(), OpenSession)
    run.reply = arena
    run.next_step()
    run.reply = reserved  # a slot that runs past the end of the mapping
    abort = run.next_step()
    assert isinstance(abort, SessionCall) and abort.request.abort and abort.request.lease_id == 3
    run.reply = pb.CommitResponse()
    with pytest.raises(ValueError):
        run.next_step()


def test_a_failed_item_of_a_commit_raises_its_exception() -> None:
    reserved = pb.ReserveResponse(lease_id=1, slots=[pb.Slot(offset=0, size_bytes=1)])
    failed = pb.CommitResult(code=grpc.StatusCode.ALREADY_EXISTS.value[0], message="differs")
    with pytest.raises(AlreadyExists, match="differs"):
        drive(
            _core.put_many("ns", [("a", b"z")]),
            [memoryview(bytearray(4)), reserved, pb.CommitResponse(results=[failed])],
        )


def test_get_many_releases_its_lease_even_when_a_copy_fails() -> None:
    arena = memoryview(bytearray(b"0123456789"))
    leased = pb.AcquireResponse(
        lease_id=5,
        blocks=[pb.LeasedBlock(found=True, offset=2, size_bytes=4), pb.LeasedBlock(found=False)],
    )
    run = Run(_core.get_many("ns", ["a", "b"], [bytearray(4), bytearray(4)]))
    run.next_step()
    run.reply = arena
    acquire = run.next_step()
    assert isinstance(acquire, SessionCall) and acquire.op is Op.ACQUIRE
    run.reply = leased
    release = run.next_step()
    assert isinstance(release, SessionSend) and release.op is Op.RELEASE
    assert list(release.request.lease_ids) == [5] and release.request.fetch_bytes == 4
    assert run.next_step() is None and run.result == [4, None]

    too_small = Run(_core.get_many("ns", ["a"], [bytearray(2)]))
    too_small.next_step()
    too_small.reply = arena
    too_small.next_step()
    too_small.reply = pb.AcquireResponse(
        lease_id=6, blocks=[pb.LeasedBlock(found=True, offset=0, size_bytes=4)]
    )
    release = too_small.next_step()
    assert isinstance(release, SessionSend) and list(release.request.lease_ids) == [6]
    assert not release.request.fetch_bytes  # nothing copied: no fetch time to learn from
    with pytest.raises(InvalidArgument, match="too small"):
        too_small.next_step()


def test_get_many_needs_a_buffer_per_key() -> None:
    with pytest.raises(InvalidArgument, match="one buffer per key"):
        drive(_core.get_many("ns", ["a", "b"], [bytearray(1)]), [])


def test_streams_that_the_caller_iterates() -> None:
    listing = _core.list_("ns", limit=3)
    assert (listing.method, listing.request) == ("List", pb.ListRequest(namespace="ns", limit=3))
    assert listing.timeout_s is _core.CLIENT_TIMEOUT
    info = pb.BlockInfo(namespace="ns", key=b"k", size_bytes=5, tiers=[pb.TIER_DRAM])
    assert listing.on_message(pb.ListEntry(info=info)) == kvtier.BlockStat(
        "ns", b"k", 5, 0, ["dram"], 0
    )
    watch = _core.watch_events("ns", "e1", 4, timeout_s=2.0)
    assert watch.request == pb.WatchEventsRequest(namespace="ns", epoch="e1", after_seq=4)
    assert watch.timeout_s == 2.0
    event = pb.BlockEvent(seq=5, namespace="ns", key=b"k", tiers=[pb.TIER_NVME])
    assert watch.on_message(pb.WatchEventsResponse(epoch="e1", events=[event])) == (
        kvtier.EventBatch("e1", [kvtier.BlockEvent(5, "ns", b"k", ["nvme"])])
    )


class ScriptedClient(kvtier.Client):
    """A Client whose steps fail as scripted (no daemon): what `_run` tells operations."""

    def __init__(self, failures: list[BaseException]) -> None:
        super().__init__("unix:///nonexistent/kvtier.sock")
        self.failures = failures

    def _perform(self, run: Run[Any], step: Step) -> Any:
        raise self.failures.pop(0)


def test_the_blocking_client_throws_step_failures_in_as_kvtier_errors() -> None:
    with ScriptedClient([FakeRpcError(grpc.StatusCode.NOT_FOUND)]) as client:
        assert client.get("ns", b"k") is None
    unauthenticated = ScriptedClient([FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "token?")])
    with unauthenticated, pytest.raises(Unauthenticated, match="token"):
        unauthenticated.delete("ns", b"k")
    reset = ScriptedClient([ConnectionResetError("reset")])
    with reset, pytest.raises(Unavailable, match="lost the session"):
        reset.stats()
    interrupted = ScriptedClient([KeyboardInterrupt()])
    with interrupted, pytest.raises(KeyboardInterrupt):
        interrupted.stats()


class ScriptedAsyncClient(kvtier.AsyncClient):
    def __init__(self, replies: list[Any]) -> None:
        super().__init__("unix:///nonexistent/kvtier.sock")
        self.replies = replies

    async def _perform(self, run: Run[Any], step: Step) -> Any:
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply


async def test_the_async_client_runs_the_same_operations() -> None:
    stats = pb.StatsResponse(version="1.2", leases=3)
    async with ScriptedAsyncClient([stats, FakeRpcError(grpc.StatusCode.NOT_FOUND)]) as client:
        assert (await client.stats()).leases == 3
        assert await client.stat("ns", b"k") is None
    failure = FakeRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down", [("retry-after-ms", "9")]
    )
    async with ScriptedAsyncClient([failure]) as client:
        with pytest.raises(RateLimited):
            await client.lookup("ns", [b"a"])


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(getattr(cls, name))
        for name in dir(cls)
        if not name.startswith("_") and callable(getattr(cls, name))
    }


def test_both_clients_have_the_same_methods_with_the_same_arguments() -> None:
    blocking, asyncio = public_methods(kvtier.Client), public_methods(kvtier.AsyncClient)
    assert set(blocking) - {"wait_ready"} == set(asyncio)
    for name, signature in asyncio.items():
        assert signature.parameters == blocking[name].parameters, name
    bound = inspect.signature(kvtier.Client("unix:///nonexistent.sock").put)
    assert list(bound.parameters) == ["namespace", "key", "data", "overwrite"]
    assert kvtier.Client.list.__name__ == "list" and kvtier.Client.put.__doc__


def test_timeout_and_token_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        kvtier.Client("unix:///nonexistent.sock", 5.0)  # type: ignore[misc]
    client = kvtier.Client("unix:///nonexistent.sock", timeout_s=5.0, token="t")
    assert client.timeout_s == 5.0
    assert client._metadata == (("authorization", "Bearer t"),)
    client.close()
    watch = inspect.signature(kvtier.Client.watch_events).parameters["timeout_s"]
    assert watch.kind is inspect.Parameter.KEYWORD_ONLY


def test_as_keys_passes_bytes_chains_through_and_converts_the_rest() -> None:
    from kvtier.client._common import as_key, as_keys

    hashes = [bytes([i]) * 16 for i in range(8)]
    assert as_keys(hashes) == hashes
    mixed: list[bytes | str] = [b"a", "b", bytearray(b"c"), memoryview(b"d")]  # type: ignore[list-item]
    assert as_keys(mixed) == [as_key(k) for k in mixed] == [b"a", b"b", b"c", b"d"]
    assert all(type(k) is bytes for k in as_keys(mixed))


def test_an_operation_sends_only_on_the_session_it_opened() -> None:
    """Once an operation opened a session, its requests go there or fail Unavailable (the
    caller may call again): a session another call attached after that one was lost has
    another write area, so a put's request there would name bytes it never wrote."""
    from kvtier.client._core import session

    client = kvtier.Client("unix:///nonexistent/kvtier.sock")
    opened, other = object(), object()
    run = Run(session())
    run.session = opened
    client._arena = opened  # type: ignore[assignment]
    assert client._attached(run) is opened
    client._arena = other  # type: ignore[assignment]
    with pytest.raises(kvtier.errors.Unavailable, match="call again"):
        client._attached(run)
    assert client._attached() is other  # a step of no operation: the client's session
    fresh = Run(session())  # an operation that has not opened one takes the current
    assert client._attached(fresh) is other
    client._arena = None
    with pytest.raises(kvtier.errors.Unavailable, match="closed"):
        client._attached(run)
    client.close()
