"""A demotion batch's checks and headers in C (kvtier/tiers/_batch_native.c) against the
Python they stand for (kvtier/tiers/record_batch.py): the same digests of any split of a
payload into buffers, the same header bytes (and nothing else in the buffer touched),
and the same refusals."""

from __future__ import annotations

import os
from types import ModuleType

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers import record_batch
from kvtier.tiers.record import ALIGN_BYTES, RecordHeader, decode_header, header_size_for

pytestmark = pytest.mark.skipif(
    record_batch.NATIVE is None and os.environ.get("KVTIER_REQUIRE_NATIVE") != "1",
    reason="kvtier/tiers/_batch_native.c was not built (no C compiler at install)",
)


def native() -> ModuleType:
    assert record_batch.NATIVE is not None, "the C extension was not built"
    return record_batch.NATIVE


PAYLOAD = st.binary(max_size=3000)
CUTS = st.lists(st.integers(0, 3000), max_size=4)


def split(data: bytes, cuts: list[int]) -> list[memoryview]:
    """`data` as consecutive views cut at `cuts` (empty views included)."""
    view, out, at = memoryview(data), [], 0
    for cut in sorted(min(c, len(data)) for c in cuts):
        out.append(view[at:cut])
        at = cut
    out.append(view[at:])
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(PAYLOAD, CUTS, st.integers(-50, 3500)), max_size=8))
def test_digests_are_the_python_ones(batch: list[tuple[bytes, list[int], int]]) -> None:
    payloads = [split(data, cuts) for data, cuts, _ in batch]
    wanted = [max(0, extra) for _, _, extra in batch]  # more than the payload, or fewer
    got = native().digests(payloads, wanted)
    assert got == record_batch._py_digests(payloads, wanted)
    # and what they are: the first `wanted` bytes (all of them, if fewer), hashed
    hashed = [xxhash.xxh3_64_intdigest(d[:n]) for (d, _, _), n in zip(batch, wanted, strict=True)]
    assert got == hashed


def test_a_large_batch_is_hashed_whole() -> None:
    # Above GIL_FREE_BYTES the C lets go of the GIL: the same digests.
    blocks = [os.urandom(64 << 10) for _ in range(4)]
    payloads = [[memoryview(b)[:4096], memoryview(b)[4096:]] for b in blocks]
    sizes = [len(b) for b in blocks]
    assert sum(sizes) > native().GIL_FREE_BYTES
    assert native().digests(payloads, sizes) == [xxhash.xxh3_64_intdigest(b) for b in blocks]


@pytest.mark.parametrize("digests", ["native", "python"])
def test_digests_refuse_what_they_cannot_hash(digests: str) -> None:
    fn = native().digests if digests == "native" else record_batch._py_digests
    with pytest.raises(ValueError):
        fn([[b"ab"]], [1, 2])  # a count too many
    with pytest.raises(ValueError):
        fn([[b"ab"]], [-1])
    with pytest.raises(TypeError):
        fn([[object()]], [1])  # type: ignore[list-item]


NS = st.sampled_from(["default|a", "t|é-ns", "", "x" * 300])
HEADERS = st.lists(
    st.tuples(
        NS,
        st.binary(max_size=400),
        st.integers(0, 2**64 - 1),  # generation
        st.integers(0, 2**64 - 1),  # payload bytes
        st.integers(0, 2**64 - 1),  # xxh3
        st.integers(0, 2),  # more pages than the least
        st.integers(0, 3),  # pages of gap before it
    ),
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(HEADERS, st.binary(min_size=1, max_size=1))
def test_headers_are_encode_headers_bytes(
    specs: list[tuple[str, bytes, int, int, int, int, int]], fill: bytes
) -> None:
    headers, starts, at = [], [], 0
    for ns, key, gen, payload, xxh3, more, gap in specs:
        size = header_size_for(ns, key) + more * ALIGN_BYTES
        headers.append(RecordHeader(ns, key, gen, payload, xxh3, size))
        at += gap * ALIGN_BYTES
        starts.append(at)
        at += size
    end = at + ALIGN_BYTES
    c, py = bytearray(fill * end), bytearray(fill * end)  # old bytes: cleared where written
    native().encode_headers(memoryview(c), starts, headers)
    record_batch._py_encode_headers(memoryview(py), starts, headers)
    assert c == py
    for start, header in zip(starts, headers, strict=True):
        assert decode_header(bytes(c[start : start + header.header_bytes])) == header


@pytest.mark.parametrize("encode", ["native", "python"])
def test_headers_refuse_what_does_not_fit(encode: str) -> None:
    fn = native().encode_headers if encode == "native" else record_batch._py_encode_headers
    ns, key = "default|a", b"k" * 64
    header = RecordHeader(ns, key, 1, 10, 2, header_size_for(ns, key))
    buf = memoryview(bytearray(2 * ALIGN_BYTES))
    with pytest.raises(ValueError):
        fn(buf, [ALIGN_BYTES + 8], [header])  # past the buffer's end
    with pytest.raises(ValueError):
        fn(buf, [-8], [header])
    with pytest.raises(ValueError):
        fn(buf, [0, ALIGN_BYTES], [header])  # a start too many
    long_key = RecordHeader(ns, b"k" * ALIGN_BYTES, 1, 10, 2, ALIGN_BYTES)
    with pytest.raises(ValueError):
        fn(buf, [0], [long_key])  # its namespace and key do not fit its header
    if encode == "native":  # checked before anything is written
        assert bytes(buf) == bytes(2 * ALIGN_BYTES)
