"""Answers framed requests from an attached session's socket (see kvtier._session).

The ops themselves are the servicer's (their gRPC twins run the same code); this is the
socket's half of a call: decode the frame, charge the session's tenant, run the op, and
reply with a status value and payload. A failure is answered through
kvtier.server.rpc.answer, so a code and message are the ones the gRPC twin would send.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from google.protobuf.message import DecodeError, Message

from kvtier._session import REQUEST_TYPES, Op
from kvtier.engine.telemetry import Telemetry
from kvtier.errors import InvalidArgument
from kvtier.server.rpc import answer

# (session id, tenant, request) -> response
SessionOp = Callable[[int, str, Any], Awaitable[Message]]
# Ops that finish work a Reserve or an Acquire was admitted for: never rate-limited. So
# is Stage, which prepares the put that will be charged (PutStaged) and costs nothing
# unless it grows the staging range, bounded by the tenant's arena.
# Hits (a report of direct reads, up to a batch of them) is charged as one request: a
# client cannot flood the loop with reports past its tenant's rate; one over the rate is
# dropped unanswered, as any Hits is (the reads were done; the policy sees fewer of them).
FINISHING_OPS = frozenset({Op.COMMIT, Op.RELEASE, Op.CUDA_WAIT, Op.STAGE})


class SessionDispatch:
    """The arena socket's request handler: `(session id, op, payload) -> (status, reply)`."""

    def __init__(
        self,
        ops: Mapping[Op, SessionOp],
        tenant_of: Callable[[int], str],
        admit: Callable[[str], None],
        telemetry: Telemetry,
    ) -> None:
        """`tenant_of`: the live session's tenant, else raises; `admit`: charges one
        request to a tenant, else raises RateLimited."""
        self._ops = dict(ops)
        self._tenant_of = tenant_of
        self._admit = admit
        self._telemetry = telemetry

    async def __call__(self, session_id: int, op: int, payload: bytes) -> tuple[int, bytes]:
        try:
            kind, request = _decode(op, payload)
            tenant = self._tenant_of(session_id)
            if kind not in FINISHING_OPS:
                self._admit(tenant)
            response = await self._ops[kind](session_id, tenant, request)
        except Exception as err:
            status = answer(f"session op {_op_name(op)}", err)
            self._telemetry.request(f"session/{_op_name(op)}", status.code.name)
            return status.value, status.message.encode()
        self._telemetry.request(f"session/{kind.name}", "OK")
        return 0, response.SerializeToString()


def _decode(op: int, payload: bytes) -> tuple[Op, Message]:
    try:
        kind = Op(op)
        return kind, REQUEST_TYPES[kind].FromString(payload)
    except (ValueError, DecodeError):
        raise InvalidArgument("malformed session request") from None


def _op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return "UNKNOWN_OP"  # bounded: one label value for any number a client sends
