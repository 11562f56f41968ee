"""The record format on its own (no files): what encode writes parse reads back, any
damaged byte is CorruptRecord, and the bytes themselves do not drift."""

from __future__ import annotations

import hashlib

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.buffers import aligned_buffer
from kvtier.errors import CorruptRecord
from kvtier.tiers.allocator import round_up
from kvtier.tiers.crypto import RecordCipher
from kvtier.tiers.record import (
    ALIGN_BYTES,
    MAGIC,
    RecordHeader,
    decode_header,
    encode_header,
    header_size_for,
    open_sealed_payload,
    parse_header,
    payload_xxh3,
    record_size_for,
    seal_record,
    verify_record,
)

U64 = st.integers(0, (1 << 64) - 1)
ALIGNS = st.sampled_from([ALIGN_BYTES, 8])  # the NVMe tier's pages, the remote tier's words


@st.composite
def headers(draw: st.DrawFn, align_bytes: int = ALIGN_BYTES) -> RecordHeader:
    ns_id = draw(st.text(max_size=80))  # any UTF-8, tenant separators included
    key = draw(st.binary(max_size=300))
    return RecordHeader(
        ns_id=ns_id,
        key=key,
        generation=draw(U64),
        payload_bytes=draw(st.integers(0, 1 << 48)),
        xxh3_64=draw(U64),
        header_bytes=header_size_for(ns_id, key, align_bytes),
        codec=draw(st.integers(0, 0xFFFF)),
    )


def encoded(header: RecordHeader) -> bytes:
    return bytes(encode_header(header))[: header.header_bytes]


@settings(max_examples=300, deadline=None)
@given(st.data(), ALIGNS)
def test_parse_reads_back_what_encode_wrote(data: st.DataObject, align_bytes: int) -> None:
    header = data.draw(headers(align_bytes))
    region = encoded(header)
    assert len(region) == header.header_bytes and header.header_bytes % align_bytes == 0
    assert region.startswith(MAGIC)
    parsed = parse_header(region, align_bytes)
    assert parsed.header == header and parsed.seal is None
    if align_bytes == ALIGN_BYTES:
        assert decode_header(region) == header


@settings(max_examples=300, deadline=None)
@given(st.data(), ALIGNS)
def test_a_flipped_header_byte_is_corrupt_record(data: st.DataObject, align_bytes: int) -> None:
    header = data.draw(headers(align_bytes))
    region = bytearray(encoded(header))
    position = data.draw(st.integers(0, len(region) - 1), label="position")
    region[position] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(CorruptRecord):
        parse_header(bytes(region), align_bytes)


@given(headers(), st.integers(0, ALIGN_BYTES - 1))
def test_a_cut_header_is_corrupt_record(header: RecordHeader, keep_bytes: int) -> None:
    with pytest.raises(CorruptRecord):
        parse_header(encoded(header)[:keep_bytes])


@given(st.text(max_size=200), st.binary(max_size=5000), st.integers(0, 1 << 40), ALIGNS)
def test_sizes_hold_the_header_and_pad_the_payload_to_pages(
    ns_id: str, key: bytes, payload_bytes: int, align_bytes: int
) -> None:
    header_bytes = header_size_for(ns_id, key, align_bytes)
    # fixed fields 48, seal 52, header checksum 8
    assert header_bytes >= 48 + len(ns_id.encode()) + len(key) + 52 + 8
    assert header_bytes % align_bytes == 0 and header_bytes - align_bytes < (
        48 + len(ns_id.encode()) + len(key) + 52 + 8
    )
    size = record_size_for(ns_id, key, payload_bytes)
    header = RecordHeader(ns_id, key, 1, payload_bytes, 0, header_size_for(ns_id, key))
    assert size == header.record_bytes == header.header_bytes + round_up(payload_bytes, 4096)


# Digests of headers as the format was when it moved out of nvme.py: records already on
# disk must stay readable, so a change here is a format change (bump VERSION).
GOLDEN = [
    (
        RecordHeader("alice|llama3-8b/bf16", bytes(range(32)), 7, 5000, 0x0123456789ABCDEF, 4096),
        "e40bfddcb3d0cb87cebde52cf159fc1f6a046c079176072399a90f6c6454856e",
    ),
    (
        RecordHeader("bob|m/l", b"\x00\xffkey", 1 << 40, 1 << 20, 42, 120, 0x0401),
        "df24fb043d011ef720e2d0cc3c5f1c98500e3c4e91f98f9a7678fe6e793d7a4e",
    ),
]


@pytest.mark.parametrize(("header", "sha256"), GOLDEN)
def test_the_bytes_are_those_of_the_format_on_disk(header: RecordHeader, sha256: str) -> None:
    assert hashlib.sha256(encoded(header)).hexdigest() == sha256


def record(payload: bytes, cipher: RecordCipher | None) -> tuple[RecordHeader, bytearray]:
    """A whole record (header region, payload, padding) as a tier writes it."""
    ns_id, key = "alice|m/l", b"block-key"
    header = RecordHeader(
        ns_id, key, 3, len(payload), xxhash.xxh3_64_intdigest(payload), header_size_for(ns_id, key)
    )
    body_bytes = header.record_bytes - header.header_bytes
    plain = aligned_buffer(max(body_bytes, ALIGN_BYTES))
    plain[: len(payload)] = payload
    source = memoryview(plain)[:body_bytes]
    if cipher is None:
        return header, bytearray(bytes(encode_header(header)) + bytes(source))
    head = memoryview(aligned_buffer(header.header_bytes))
    body = memoryview(bytearray(b"\xee" * body_bytes))  # a reused buffer's old bytes
    seal_record(cipher, header, [source], head, body)
    return header, bytearray(bytes(head) + bytes(body))


def check(
    header: RecordHeader, raw: bytearray, cipher: RecordCipher | None, dest: memoryview
) -> None:
    """A tier's read: verify the record, then (sealed) decrypt it into `dest`."""
    view = memoryview(raw)
    head, body = view[: header.header_bytes], view[header.header_bytes :]
    seal = verify_record(head, body, header, cipher)
    if cipher is None:
        dest[:] = body
        return
    assert seal is not None
    open_sealed_payload(cipher, seal, header, head, body, dest)


PAYLOADS = st.binary(max_size=3 * ALIGN_BYTES)
CIPHERS = st.sampled_from([None, RecordCipher(bytes(range(32)))])


@settings(max_examples=100, deadline=None)
@given(PAYLOADS, CIPHERS)
def test_a_record_verifies_and_opens_to_its_payload(
    payload: bytes, cipher: RecordCipher | None
) -> None:
    header, raw = record(payload, cipher)
    assert len(raw) == header.record_bytes
    if cipher is not None:
        assert payload_xxh3(payload) != parse_header(bytes(raw)).header.xxh3_64  # masked
    dest = memoryview(bytearray(b"\xff" * (header.record_bytes - header.header_bytes)))
    check(header, raw, cipher, dest)
    assert bytes(dest[: len(payload)]) == payload
    assert not bytes(dest[len(payload) :]).strip(b"\0")


@settings(max_examples=200, deadline=None)
@given(st.data(), PAYLOADS, CIPHERS)
def test_any_flipped_record_byte_is_corrupt_record_and_never_served(
    data: st.DataObject, payload: bytes, cipher: RecordCipher | None
) -> None:
    header, raw = record(payload, cipher)
    position = data.draw(st.integers(0, len(raw) - 1), label="position")
    raw[position] ^= data.draw(st.integers(1, 255), label="xor")
    dest = memoryview(bytearray(header.record_bytes - header.header_bytes))
    with pytest.raises(CorruptRecord):
        check(header, raw, cipher, dest)
    if cipher is not None:
        assert not bytes(dest).strip(b"\0"), "unauthenticated plaintext left behind"


def test_a_record_of_another_block_generation_or_key_is_refused() -> None:
    header, raw = record(b"payload", None)
    body = memoryview(raw)[header.header_bytes :]
    head = memoryview(raw)[: header.header_bytes]
    for other in (
        RecordHeader(header.ns_id, b"other", 3, 7, header.xxh3_64, header.header_bytes),
        RecordHeader(header.ns_id, header.key, 4, 7, header.xxh3_64, header.header_bytes),
    ):
        with pytest.raises(CorruptRecord, match="does not match the catalog"):
            verify_record(head, body, other, None)
    with pytest.raises(CorruptRecord, match="not encrypted"):
        verify_record(head, body, header, RecordCipher(bytes(32)))
    sealed_header, sealed = record(b"payload", RecordCipher(bytes(range(32))))
    view = memoryview(sealed)
    with pytest.raises(CorruptRecord, match="another key"):
        verify_record(
            view[: sealed_header.header_bytes],
            view[sealed_header.header_bytes :],
            sealed_header,
            RecordCipher(bytes(32)),
        )
