"""Framing of kvtier requests on an attached session's UNIX socket (the low-latency path).

A same-node client that attached the shared arena already holds a connected UNIX socket
to the daemon. On this machine a gRPC unary round trip costs ~0.6 ms even for an empty
message, which would dominate moving a 256 KiB block at memory speed, so the zero-copy
control messages (the proto's Reserve/Commit/Acquire/Release messages, unchanged) and
the planner's (Plan, ReportPrefill) travel on
that socket with a 5-byte frame header. The same calls stay available over gRPC.

    request:  u32 payload length | u8 op     | serialized request message
    response: u32 payload length | u8 status | serialized response (status 0), or a UTF-8
                                               error message (status = gRPC code value)
    Release gets no response: the client does not wait for it; order is kept per socket.
"""

from __future__ import annotations

import struct
from enum import IntEnum

from google.protobuf.message import Message

from kvtier._proto import kvtier_pb2 as pb

HEADER = struct.Struct("<IB")
MAX_FRAME_BYTES = 64 << 20


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
}


def frame(code: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), code) + payload
