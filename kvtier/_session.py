"""Framing of kvtier requests on an attached session's UNIX socket (the low-latency path).

A same-node client that attached the shared arena already holds a connected UNIX socket
to the daemon. On this machine a gRPC unary round trip costs ~0.6 ms even for an empty
message, which would dominate moving a 256 KiB block at memory speed, so the zero-copy
control messages (the proto's Reserve/Commit/Acquire/Release messages, unchanged, and
Stage/StagedPut: a put in one exchange) and the planner's (Plan, ReportPrefill) travel
on that socket with a 5-byte frame header. The others stay available over gRPC too;
Stage and StagedPut exist only here (they name a write area only a session has).

    request:  u32 payload length | u8 op     | serialized request message
    response: u32 payload length | u8 status | serialized response (status 0), or a UTF-8
                                               error message (status = gRPC code value)
    Release and Hits get no response: the client does not wait for them; order is kept
    per socket.

Requests are small control messages (the bytes move through the arena), so each op has a
cap on its payload (`request_caps`): its message with every field at its widest, batches
at the daemon's largest (`limits.max_plan_blocks` keys of `limits.max_key_bytes`), and
never more than the session's buffer. A daemon answers a request over its op's cap with
RESOURCE_EXHAUSTED (its bytes dropped unread) and ends a session whose frame header
declares more than MAX_FRAME_BYTES.
"""

from __future__ import annotations

import struct
from enum import IntEnum

from google.protobuf.message import Message

from kvtier._proto import kvtier_pb2 as pb

HEADER = struct.Struct("<IB")
MAX_FRAME_BYTES = 64 << 20  # a header over this is not a kvtier client's: the session ends


class Op(IntEnum):
    RESERVE = 1
    COMMIT = 2
    ACQUIRE = 3
    RELEASE = 4  # no response
    PLAN = 5
    REPORT_PREFILL = 6
    REGISTER_CUDA = 7
    CUDA_PUT = 8
    CUDA_GET = 9
    CUDA_WAIT = 10
    STAGE = 11  # the session's staging range for one-exchange puts
    PUT_STAGED = 12  # a put in one exchange: the blocks are in the staging range already
    HITS = 13  # gets served from the tenant's directory, reported afterwards; no response


# Ops the daemon answers with nothing: the client does not wait (order is kept per socket).
NO_REPLY_OPS = frozenset({Op.RELEASE, Op.HITS})


REQUEST_TYPES: dict[Op, type[Message]] = {
    Op.RESERVE: pb.ReserveRequest,
    Op.COMMIT: pb.CommitRequest,
    Op.ACQUIRE: pb.AcquireRequest,
    Op.RELEASE: pb.ReleaseRequest,
    Op.PLAN: pb.PlanRequest,
    Op.REPORT_PREFILL: pb.ReportPrefillRequest,
    Op.REGISTER_CUDA: pb.RegisterCudaRequest,
    Op.CUDA_PUT: pb.CudaPutRequest,
    Op.CUDA_GET: pb.CudaGetRequest,
    Op.CUDA_WAIT: pb.CudaWaitRequest,
    Op.STAGE: pb.StageRequest,
    Op.PUT_STAGED: pb.StagedPutRequest,
    Op.HITS: pb.HitsRequest,
}


def frame(code: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), code) + payload


# Field bounds for request_caps, wider than protobuf needs: a tag is one byte (field numbers
# under 16), a varint at most 10 bytes, a UTF-8 character at most 4.
_SCALAR_BYTES = 11  # tag + a 10-byte varint (an int32 below 0 takes all 10) or a double
_MESSAGE_SLACK_BYTES = 1024  # the scalar fields around a batch, and a short string (overlap)
_IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t
_ITEM_SLACK_BYTES = 3 * _SCALAR_BYTES + 1 + 5  # a batch item's own tag and length, sizes, a group
# A HITS report carries at most this many calls (`DirectCall`: one get_many's direct reads
# each; a client sends its hits once 64 are pending, so a report rarely holds more calls).
MAX_CALLS_PER_HITS = 64
_UNKNOWN_OP_CAP_BYTES = 1024  # no op: answered INVALID_ARGUMENT whatever it carries


def _length_delimited(content_bytes: int) -> int:
    """A bytes, string or message field holding `content_bytes`: tag + length + content."""
    return 1 + max(1, -(-content_bytes.bit_length() // 7)) + content_bytes


def request_caps(
    max_items: int,
    max_key_bytes: int,
    max_namespace_chars: int,
    max_leases: int,
    buffer_bytes: int,
) -> dict[Op, int]:
    """The largest payload a well-formed request of each op can have: `max_items` keys of
    `max_key_bytes` in a batch (Reserve, Acquire, Plan, CudaPut, CudaGet), `max_leases`
    lease ids in a Release, capped at `buffer_bytes` (a session never buffers more)."""
    namespace = _length_delimited(4 * max_namespace_chars)
    fixed = _MESSAGE_SLACK_BYTES + namespace
    batch = fixed + max_items * (_length_delimited(max_key_bytes) + _ITEM_SLACK_BYTES)
    caps = {
        Op.RESERVE: batch,
        Op.COMMIT: fixed + max_items * _SCALAR_BYTES,
        Op.ACQUIRE: batch,
        Op.RELEASE: fixed + max_leases * _SCALAR_BYTES,
        Op.PLAN: batch,
        Op.REPORT_PREFILL: fixed,
        Op.REGISTER_CUDA: fixed + _length_delimited(_IPC_HANDLE_BYTES),
        Op.CUDA_PUT: batch,
        Op.CUDA_GET: batch,
        Op.CUDA_WAIT: fixed,
        Op.STAGE: fixed,
        Op.PUT_STAGED: batch + max_items * 2 * _SCALAR_BYTES,  # + offset and checksum
        # + size and duration; + the calls those hits came from
        Op.HITS: batch
        + max_items * 2 * _SCALAR_BYTES
        + MAX_CALLS_PER_HITS * _length_delimited(3 * _SCALAR_BYTES),
    }
    return {op: min(cap, buffer_bytes) for op, cap in caps.items()}


def request_cap(caps: dict[Op, int], op: int) -> int:
    """The cap for a frame's op byte (any value a client sends)."""
    try:
        return caps[Op(op)]
    except ValueError:
        return _UNKNOWN_OP_CAP_BYTES
