from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier._proto import kvtier_pb2 as pb
from kvtier._wire import (
    InlinePut,
    RawChunk,
    _varint,
    chunk_message,
    get_block_message,
    get_block_response_deserializer,
    get_block_response_serializer,
    get_response_deserializer,
    put_block_request_deserializer,
    put_block_request_serializer,
    put_request_deserializer,
    put_request_serializer,
)


@given(st.binary(max_size=70_000))
def test_chunk_framing_is_exactly_protobufs(data: bytes) -> None:
    wire = chunk_message(data)
    assert wire == pb.PutRequest(chunk=data).SerializeToString()
    assert wire == pb.GetResponse(chunk=data).SerializeToString()
    for parse in (put_request_deserializer, get_response_deserializer):
        parsed = parse(wire)
        assert isinstance(parsed, RawChunk) and bytes(parsed.data) == data


def test_other_messages_go_through_protobuf() -> None:
    header = pb.PutRequest(header=pb.PutHeader(namespace="m/l", key=b"k", size_bytes=3))
    wire = put_request_serializer(header)
    assert put_request_deserializer(wire) == header
    get_header = pb.GetResponse(header=pb.GetHeader(size_bytes=9, xxh3_64=1))
    assert get_response_deserializer(get_header.SerializeToString()) == get_header
    assert put_request_serializer(RawChunk(memoryview(b"abc"))) == chunk_message(b"abc")


def test_a_malformed_chunk_falls_back_to_protobuf_errors() -> None:
    from google.protobuf.message import DecodeError

    with pytest.raises(DecodeError):
        put_request_deserializer(b"\x12\x05ab")  # declares 5 bytes, carries 2


# ---- PutBlock / GetBlock: one block per message -------------------------------------------
put_headers = st.builds(
    pb.PutHeader,
    namespace=st.text(max_size=20),
    key=st.binary(max_size=40),
    size_bytes=st.integers(0, 1 << 40),
    xxh3_64=st.integers(0, (1 << 64) - 1),
    overwrite=st.booleans(),
)
get_headers = st.builds(
    pb.GetHeader,
    size_bytes=st.integers(0, 1 << 40),
    xxh3_64=st.integers(0, (1 << 64) - 1),
    tier=st.sampled_from([pb.TIER_UNSPECIFIED, pb.TIER_DRAM, pb.TIER_NVME]),
)


@given(put_headers, st.binary(max_size=70_000))
def test_put_block_framing_is_protobufs_and_reads_back(header: pb.PutHeader, data: bytes) -> None:
    wire = put_block_request_serializer(InlinePut(header, memoryview(data)))
    assert pb.PutBlockRequest.FromString(wire) == pb.PutBlockRequest(header=header, data=data)
    parsed = put_block_request_deserializer(wire)
    assert parsed.header == header and bytes(parsed.data) == data
    plain = pb.PutBlockRequest(header=header, data=data)
    assert put_block_request_serializer(plain) == plain.SerializeToString()


@given(get_headers, st.binary(max_size=70_000), st.booleans(), st.integers(1, 4))
def test_get_block_framing_is_protobufs_and_reads_back(
    header: pb.GetHeader, data: bytes, use_stream: bool, pieces: int
) -> None:
    data = b"" if use_stream else data
    cut = [data[i * len(data) // pieces : (i + 1) * len(data) // pieces] for i in range(pieces)]
    wire = get_block_message(header, [memoryview(c) for c in cut], use_stream)
    expected = pb.GetBlockResponse(header=header, data=data, use_stream=use_stream)
    assert pb.GetBlockResponse.FromString(wire) == expected
    parsed = get_block_response_deserializer(wire)
    assert (parsed.header, bytes(parsed.data), parsed.use_stream) == (header, data, use_stream)
    assert get_block_response_serializer(wire) is wire
    assert get_block_response_serializer(expected) == expected.SerializeToString()


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field, written by hand (protobuf would leave an empty one out)."""
    return bytes([number << 3 | 2]) + _varint(len(payload)) + payload


@given(put_headers, st.binary(max_size=300), st.binary(max_size=300), st.integers(0, 4))
def test_other_encodings_of_put_block_read_as_protobuf_reads_them(
    header: pb.PutHeader, data: bytes, other: bytes, shape: int
) -> None:
    """Fields reordered, repeated, unknown, or absent: what protobuf makes of it."""
    h, d = _field(1, header.SerializeToString()), _field(2, data)
    wire = [d + h, h + d + _field(2, other), h + _field(7, other) + d, d, h + h + d][shape]
    expected = pb.PutBlockRequest.FromString(wire)
    parsed = put_block_request_deserializer(wire)
    assert parsed.header == expected.header and bytes(parsed.data) == expected.data


@given(get_headers, st.binary(max_size=300), st.integers(0, 3))
def test_other_encodings_of_get_block_read_as_protobuf_reads_them(
    header: pb.GetHeader, data: bytes, shape: int
) -> None:
    h, d = _field(1, header.SerializeToString()), _field(2, data)
    wire = [d + h + b"\x18\x01", h + b"\x18\x00" + d, h + d + d, b"\x18\x01\x18\x00" + h][shape]
    expected = pb.GetBlockResponse.FromString(wire)
    parsed = get_block_response_deserializer(wire)
    assert (parsed.header, bytes(parsed.data), parsed.use_stream) == (
        expected.header,
        expected.data,
        expected.use_stream,
    )


@pytest.mark.parametrize(
    "wire",
    [
        b"\x0a\x05ab",
        b"\x0a\x00\x12\x09abc",
        b"\x0a\x00\x12\xff",
        b"\x0a\x00\x12\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
    ],
)
def test_a_torn_block_message_is_a_decode_error_never_a_short_block(wire: bytes) -> None:
    from google.protobuf.message import DecodeError

    for parse in (put_block_request_deserializer, get_block_response_deserializer):
        with pytest.raises(DecodeError):
            parse(wire)
