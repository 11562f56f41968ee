"""The one exception-to-status mapping (kvtier.errors.to_status) against its documentation."""

from __future__ import annotations

import grpc
import pytest

from kvtier import errors
from kvtier.errors import (
    INTERNAL_MESSAGE,
    AlreadyExists,
    ConfigError,
    CorruptRecord,
    DataLoss,
    DeadlineExceeded,
    InvalidArgument,
    KVTierError,
    NotFound,
    NotRegularFile,
    PermissionDenied,
    RateLimited,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    to_status,
)

Code = grpc.StatusCode

# The status column of the tree in kvtier/errors.py's docstring, written out independently
# of the classes' grpc_code: a changed code must change this table and the docstring too.
DOCUMENTED: list[tuple[type[KVTierError], grpc.StatusCode]] = [
    (KVTierError, Code.INTERNAL),
    (ConfigError, Code.FAILED_PRECONDITION),
    (InvalidArgument, Code.INVALID_ARGUMENT),
    (NotFound, Code.NOT_FOUND),
    (AlreadyExists, Code.ALREADY_EXISTS),
    (ResourceExhausted, Code.RESOURCE_EXHAUSTED),
    (RateLimited, Code.RESOURCE_EXHAUSTED),
    (DataLoss, Code.DATA_LOSS),
    (Unavailable, Code.UNAVAILABLE),
    (Unauthenticated, Code.UNAUTHENTICATED),
    (PermissionDenied, Code.PERMISSION_DENIED),
    (Unimplemented, Code.UNIMPLEMENTED),
    (DeadlineExceeded, Code.DEADLINE_EXCEEDED),
    (CorruptRecord, Code.DATA_LOSS),
    (NotRegularFile, Code.DATA_LOSS),
]


def make(cls: type[KVTierError], message: str) -> KVTierError:
    if cls is RateLimited:
        return RateLimited(message, retry_after_s=0.25)
    return cls(message)


def test_the_table_has_every_exception_class_of_the_module() -> None:
    classes = {
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, KVTierError)
    }
    assert classes == {cls for cls, _ in DOCUMENTED}


@pytest.mark.parametrize(("cls", "code"), DOCUMENTED, ids=[c.__name__ for c, _ in DOCUMENTED])
def test_each_class_maps_to_its_documented_status(
    cls: type[KVTierError], code: grpc.StatusCode
) -> None:
    status = to_status(make(cls, "namespace is empty: pass one"))
    assert status.code is code
    assert status.value == code.value[0]
    assert status.message == "namespace is empty: pass one"
    assert status.trailing_metadata == ((("retry-after-ms", "250"),) if cls is RateLimited else ())


@pytest.mark.parametrize(("cls", "code"), DOCUMENTED, ids=[c.__name__ for c, _ in DOCUMENTED])
def test_the_docstring_tree_shows_the_same_status(
    cls: type[KVTierError], code: grpc.StatusCode
) -> None:
    assert errors.__doc__ is not None
    rows = [line.split() for line in errors.__doc__.splitlines()]
    assert [cls.__name__, code.name] in [[w for w in r if w.isidentifier()][:2] for r in rows]


@pytest.mark.parametrize(
    ("retry_after_s", "retry_ms"),
    [(0.0, "1"), (0.0001, "1"), (0.25, "250"), (1.0001, "1001"), (30.0, "30000")],
)
def test_a_rate_limit_sends_its_retry_hint_rounded_up_to_milliseconds(
    retry_after_s: float, retry_ms: str
) -> None:
    status = to_status(RateLimited("over limits.requests_per_s", retry_after_s))
    assert status.trailing_metadata == (("retry-after-ms", retry_ms),)


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError("tenant acme, key b'secret'"),
        ValueError("tenant acme, key b'secret'"),
        KeyError(b"secret"),
        AssertionError("secret"),
        OSError(5, "EIO on secret"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_unexpected_exception_is_internal_and_its_text_is_not_sent(err: Exception) -> None:
    status = to_status(err)
    assert status.code is Code.INTERNAL
    assert status.message == INTERNAL_MESSAGE
    assert "secret" not in status.message
    assert status.trailing_metadata == ()
