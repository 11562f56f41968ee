"""Every exception kvtier raises, and the one place they map to gRPC status codes.

    class                     status               how the caller recovers
    KVTierError               INTERNAL             base; never raised itself
    ├── ConfigError           FAILED_PRECONDITION  fix the named key/file and restart
    ├── InvalidArgument       INVALID_ARGUMENT     bad key, namespace or size: fix the request
    ├── NotFound              NOT_FOUND            the block is absent (clients return None)
    ├── AlreadyExists         ALREADY_EXISTS       same key, other bytes: overwrite=True or a
    │                                              new key
    ├── ResourceExhausted     RESOURCE_EXHAUSTED   oversize block, or no room (all pinned):
    │   │                                          retry later or smaller
    │   └── RateLimited       RESOURCE_EXHAUSTED   over the tenant's rate: retry after
    │                                              retry_after_s (trailing `retry-after-ms`)
    ├── DataLoss              DATA_LOSS            bytes changed in transit: retry the call
    ├── Unavailable           UNAVAILABLE          draining or a tier offline: retry
    │                                              elsewhere or later
    ├── Unauthenticated       UNAUTHENTICATED      missing or unknown bearer token: pass the
    │                                              right token
    ├── PermissionDenied      PERMISSION_DENIED    the credentials do not allow this (another
    │                                              tenant's session)
    ├── Unimplemented         UNIMPLEMENTED        needs what this daemon lacks (e.g. a GPU)
    ├── DeadlineExceeded      DEADLINE_EXCEEDED    the daemon ended a stream that stalled
    │                                              (limits.stream_idle_s): send without
    │                                              pausing, then retry
    └── CorruptRecord         DATA_LOSS            a stored record failed verification;
        │                                          internal: served as a miss, record dropped
        └── NotRegularFile    DATA_LOSS            a tier file is a link, FIFO, socket or
                                                   device; internal: refused, counted, removed
    any other exception       INTERNAL             a daemon bug: the caller gets a fixed
                                                   message, the daemon's log the traceback

The status is each class's `grpc_code`; `to_status` is the daemon's only way from an
exception to what a caller is told (gRPC handlers, the session socket and per-item batch
results all go through it). Clients receive the same classes: `kvtier.Client` converts a
gRPC status back through `from_grpc_code`, so callers catch one tree whichever side raised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import grpc


class KVTierError(Exception):
    """Base of every kvtier error."""

    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL


class ConfigError(KVTierError):
    """The configuration is invalid; the message names the key and the file to fix."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class InvalidArgument(KVTierError):
    """The request is malformed (key, namespace, size); retrying unchanged will fail again."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVTierError):
    """The block is not cached; recompute it."""

    grpc_code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KVTierError):
    """A block with this key and different bytes exists; pass overwrite=True to replace it."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(KVTierError):
    """Too large, or no room that can be freed now; send smaller blocks or retry later."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RateLimited(ResourceExhausted):
    """The tenant is over its request or payload rate; retry after `retry_after_s` seconds.

    Over gRPC the same hint travels as trailing metadata `retry-after-ms`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DataLoss(KVTierError):
    """The bytes that arrived do not match their checksum; nothing was stored. Retry."""

    grpc_code = grpc.StatusCode.DATA_LOSS


class Unavailable(KVTierError):
    """The daemon is draining or cannot be reached; retry later or recompute."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(KVTierError):
    """No or an unknown bearer token; pass the token the operator gave you."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KVTierError):
    """The caller's tenant may not do this (e.g. use another tenant's session)."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class Unimplemented(KVTierError):
    """The operation needs a capability this daemon was not started with."""

    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class DeadlineExceeded(KVTierError):
    """The daemon ended a call that made no progress for too long (a put stream that sent
    nothing for limits.stream_idle_s); nothing was stored. Retry, sending without pausing.

    Clients see it as any DEADLINE_EXCEEDED: kvtier.Client raises Unavailable."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class CorruptRecord(KVTierError):
    """A stored record failed verification. Internal: served as a miss, never as bytes."""

    grpc_code = grpc.StatusCode.DATA_LOSS


class NotRegularFile(CorruptRecord):
    """A file in the NVMe tier (record, spare, log) is not a regular file: a symbolic
    link, FIFO, socket, device or extra hard link, planted or left by something else.
    Internal: never opened blocking nor written through; the tier counts and removes it,
    and a record that is one is a miss."""

    def __init__(self, message: str, kind: str = "file") -> None:
        super().__init__(message)
        self.kind = kind  # "symbolic link", "FIFO", ...: what the tier counts and logs


_BY_CODE: dict[grpc.StatusCode, type[KVTierError]] = {
    cls.grpc_code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        ResourceExhausted,
        DataLoss,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
        Unimplemented,
    )
}


RETRY_AFTER_METADATA = "retry-after-ms"
# Deliberately says nothing about the exception: its text may hold a tenant's key or
# namespace, and the caller can do nothing with a daemon bug but report it.
INTERNAL_MESSAGE = "internal error in the kvtier daemon; its log has the details"


@dataclass(frozen=True, slots=True)
class Status:
    """What a caller is told about a failed call."""

    code: grpc.StatusCode
    message: str
    trailing_metadata: tuple[tuple[str, str], ...] = ()

    @property
    def value(self) -> int:
        """The code as the number the session socket and batch results carry."""
        number: int = self.code.value[0]
        return number


def to_status(err: Exception) -> Status:
    """The status for `err`: a kvtier exception's `grpc_code` and message (RateLimited adds
    its retry hint); any other exception is INTERNAL with a fixed message."""
    if not isinstance(err, KVTierError):
        return Status(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
    if isinstance(err, RateLimited):
        retry_ms = max(1, math.ceil(err.retry_after_s * 1000))
        return Status(err.grpc_code, str(err), ((RETRY_AFTER_METADATA, str(retry_ms)),))
    return Status(err.grpc_code, str(err))


def from_status_value(value: int, message: str) -> KVTierError:
    """The exception for a status code sent as a number (per-item results of batch calls)."""
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return from_grpc_code(code, message)
    return KVTierError(message)


def from_grpc_code(code: grpc.StatusCode | None, message: str) -> KVTierError:
    """The kvtier exception a client should raise for a gRPC status."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable(f"deadline exceeded: {message}")
    cls = _BY_CODE.get(code, KVTierError) if code is not None else KVTierError
    return cls(message)


__all__ = [
    "INTERNAL_MESSAGE",
    "RETRY_AFTER_METADATA",
    "AlreadyExists",
    "ConfigError",
    "CorruptRecord",
    "DataLoss",
    "DeadlineExceeded",
    "InvalidArgument",
    "KVTierError",
    "NotFound",
    "NotRegularFile",
    "PermissionDenied",
    "RateLimited",
    "ResourceExhausted",
    "Status",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "from_grpc_code",
    "from_status_value",
    "to_status",
]
