from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier._proto import kvtier_pb2 as pb
from kvtier._wire import (
    RawChunk,
    chunk_message,
    get_response_deserializer,
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
    import pytest
    from google.protobuf.message import DecodeError

    with pytest.raises(DecodeError):
        put_request_deserializer(b"\x12\x05ab")  # declares 5 bytes, carries 2
