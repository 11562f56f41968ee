"""The session socket's replies use the same status mapping as gRPC calls."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from kvtier.engine.telemetry import Telemetry
from kvtier.errors import INTERNAL_MESSAGE, KVTierError, RateLimited, Unavailable
from kvtier.server.session_dispatch import SessionDispatch
from tests.test_errors import DOCUMENTED, make

RELEASE = pb.ReleaseRequest(lease_ids=[7]).SerializeToString()


class Calls:
    def __init__(self, raises: Exception | None = None) -> None:
        self.raises = raises
        self.admitted: list[str] = []
        self.ops: list[tuple[int, str, Any]] = []

    async def op(self, session_id: int, tenant: str, request: Any) -> Message:
        self.ops.append((session_id, tenant, request))
        if self.raises is not None:
            raise self.raises
        return pb.ReleaseResponse(released=1)

    def tenant_of(self, session_id: int) -> str:
        return "acme"

    def admit(self, tenant: str) -> None:
        self.admitted.append(tenant)


def dispatch(calls: Calls, telemetry: Telemetry) -> SessionDispatch:
    return SessionDispatch(
        {Op.RELEASE: calls.op, Op.RESERVE: calls.op}, calls.tenant_of, calls.admit, telemetry
    )


async def test_a_served_op_replies_zero_and_the_response() -> None:
    calls, telemetry = Calls(), Telemetry()
    code, reply = await dispatch(calls, telemetry)(3, Op.RELEASE, RELEASE)
    assert (code, pb.ReleaseResponse.FromString(reply).released) == (0, 1)
    assert calls.ops == [(3, "acme", pb.ReleaseRequest(lease_ids=[7]))]
    assert calls.admitted == []  # a release finishes admitted work: never charged
    assert telemetry.requests == {("session/RELEASE", "OK"): 1}


@pytest.mark.parametrize(("cls", "code"), DOCUMENTED, ids=[c.__name__ for c, _ in DOCUMENTED])
async def test_a_failed_op_replies_the_documented_status(
    cls: type[KVTierError], code: grpc.StatusCode
) -> None:
    telemetry = Telemetry()
    reply = await dispatch(Calls(make(cls, "fix the key")), telemetry)(3, Op.RESERVE, b"")
    assert reply == (code.value[0], b"fix the key")
    assert telemetry.requests == {("session/RESERVE", code.name): 1}


async def test_a_rate_limited_tenant_is_refused_before_the_op_runs() -> None:
    calls = Calls()

    def refuse(tenant: str) -> None:
        raise RateLimited("over limits.requests_per_s", 0.5)

    handler = SessionDispatch({Op.RESERVE: calls.op}, calls.tenant_of, refuse, Telemetry())
    code, reply = await handler(3, Op.RESERVE, b"")
    assert (code, reply) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        b"over limits.requests_per_s",
    )
    assert calls.ops == []


async def test_an_ended_session_is_refused_with_its_status() -> None:
    calls = Calls()

    def ended(session_id: int) -> str:
        raise Unavailable("kvtier is shutting down")

    handler = SessionDispatch({Op.RESERVE: calls.op}, ended, calls.admit, Telemetry())
    assert await handler(3, Op.RESERVE, b"") == (
        grpc.StatusCode.UNAVAILABLE.value[0],
        b"kvtier is shutting down",
    )


@pytest.mark.parametrize(
    ("op", "payload", "label"),
    [(250, b"", "session/UNKNOWN_OP"), (Op.RELEASE, b"\xff\xff", "session/RELEASE")],
    ids=["unknown op", "undecodable payload"],
)
async def test_a_malformed_frame_is_invalid_argument(op: int, payload: bytes, label: str) -> None:
    calls, telemetry = Calls(), Telemetry()
    reply = await dispatch(calls, telemetry)(3, op, payload)
    assert reply == (grpc.StatusCode.INVALID_ARGUMENT.value[0], b"malformed session request")
    assert calls.ops == []
    assert telemetry.requests == {(label, "INVALID_ARGUMENT"): 1}


async def test_an_unexpected_exception_is_internal_logged_and_its_text_not_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    telemetry = Telemetry()
    with caplog.at_level(logging.ERROR):
        reply = await dispatch(Calls(KeyError(b"secret")), telemetry)(3, Op.RESERVE, b"")
    assert reply == (grpc.StatusCode.INTERNAL.value[0], INTERNAL_MESSAGE.encode())
    assert [r.name for r in caplog.records] == ["kvtier.server.rpc"]
    assert telemetry.requests == {("session/RESERVE", "INTERNAL"): 1}
