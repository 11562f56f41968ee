"""A demotion batch's work on its I/O thread: each block checked against the xxh3-64 its
put stored (`digests`), and each record's header encoded (`encode_headers`). In C where
it was built (kvtier/tiers/_batch_native.c), else the Python it stands for.

Why C: the daemon is bound by the GIL, not by one thread. A streamed block's wall time is
the event loop's CPU plus most of the Python an I/O thread runs for it (10 µs more a
record there was ~8 µs more a block: BENCHMARKS.md, "A demotion batch's checks and
headers in C"), and these two were ~5 µs of it a record: the xxhash package holds the
GIL over a 64 KiB block, and a header was a struct, a few memoryview slices and a second
hash. The C hashes a batch's blocks with the GIL let go once and encodes its headers in
one call. Same bytes, same digests (tests/tiers/test_record_batch.py);
`KVTIER_NATIVE=0` asks for the Python where the C exists (A/B).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import xxhash

from kvtier.env import python_twins_asked_for
from kvtier.tiers.record import RecordHeader, encode_header

__all__ = ["NATIVE", "digests", "encode_headers", "implementation"]

Buffer = bytes | bytearray | memoryview


def _native() -> ModuleType | None:
    try:
        from kvtier.tiers import _batch_native
    except ImportError:
        return None
    return _batch_native


NATIVE = _native()


def _py_digests(payloads: Sequence[Sequence[Buffer]], nbytes: Sequence[int]) -> list[int]:
    if len(payloads) != len(nbytes):
        raise ValueError("digests: one byte count a payload")
    out = []
    for views, wanted in zip(payloads, nbytes, strict=True):
        if wanted < 0:
            raise ValueError("digests: a negative byte count")
        hasher, left = xxhash.xxh3_64(), wanted
        for view in views:
            if left <= 0:
                break
            part = memoryview(view).cast("B")
            hasher.update(part[:left])
            left -= part.nbytes
        out.append(int(hasher.intdigest()))
    return out


def _py_encode_headers(
    buf: memoryview, starts: Sequence[int], headers: Sequence[RecordHeader]
) -> None:
    if len(starts) != len(headers):
        raise ValueError("encode_headers: one start a header")
    for start, header in zip(starts, headers, strict=True):
        if start < 0 or start + header.header_bytes > buf.nbytes:
            raise ValueError("encode_headers: a header past the buffer")
        encode_header(header, buf[start : start + header.header_bytes])


# digests(payloads, nbytes): the xxh3-64 of the first nbytes[i] bytes of each payloads[i]
# (its buffers taken as one run of bytes; all of them if they hold fewer).
# encode_headers(buf, starts, headers): `encode_header` of each plaintext header into
# buf[starts[i]:][:header_bytes]. The C functions themselves where they were built: a
# wrapper would be a Python call more a batch.
digests: Callable[[Sequence[Sequence[Buffer]], Sequence[int]], list[int]]
encode_headers: Callable[[memoryview, Sequence[int], Sequence[RecordHeader]], None]
if NATIVE is not None and not python_twins_asked_for():
    digests, encode_headers = NATIVE.digests, NATIVE.encode_headers
else:
    digests, encode_headers = _py_digests, _py_encode_headers


def implementation() -> str:
    """Where a demotion batch's checks and headers run, for the daemon's start-up log."""
    if digests is not _py_digests:
        return "in C (kvtier/tiers/_batch_native.c)"
    if NATIVE is None:
        return "in Python (the C extension was not built)"
    return "in Python (KVTIER_NATIVE=0)"
