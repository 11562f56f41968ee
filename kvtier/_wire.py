"""Wire-compatible fast paths for the data chunks of Put and Get.

`PutRequest` and `GetResponse` carry data as field 2 (`bytes chunk`) of a oneof, so a chunk
message on the wire is exactly `0x12 <varint length> <data>`. Generated protobuf code would
copy the data twice per chunk (parse, then field access); these (de)serializers build and
read that framing directly, with at most one copy, and fall back to protobuf for every
other message. Clients in other languages still speak plain protobuf: the bytes on the
wire are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from kvtier._proto import kvtier_pb2 as pb

CHUNK_TAG = b"\x12"  # field number 2, wire type 2 (length-delimited)
Buffer = bytes | bytearray | memoryview
M = TypeVar("M", pb.PutRequest, pb.GetResponse)


class RawChunk:
    """A data chunk that skipped protobuf: `data` views the received message's bytes."""

    __slots__ = ("data",)

    def __init__(self, data: Buffer) -> None:
        self.data = data


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def chunk_message(data: Buffer) -> bytes:
    """The serialized chunk message for `data` (one copy of the data)."""
    return b"".join((CHUNK_TAG, _varint(len(data)), data))


def _chunk_view(message: bytes) -> memoryview | None:
    if not message or message[0] != CHUNK_TAG[0]:
        return None
    length = shift = 0
    pos = 1
    while pos < len(message) and pos < 11:
        byte = message[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return memoryview(message)[pos:] if pos + length == len(message) else None
        shift += 7
    return None


def _serializer(msg: RawChunk | pb.PutRequest | pb.GetResponse) -> bytes:
    if isinstance(msg, RawChunk):
        return chunk_message(msg.data)
    return msg.SerializeToString()


def _deserializer(cls: type[M]) -> Callable[[bytes], RawChunk | M]:
    def parse(message: bytes) -> RawChunk | M:
        view = _chunk_view(message)
        return RawChunk(view) if view is not None else cls.FromString(message)

    return parse


class Undecodable:
    """What a request deserializer returns for bytes that are not a valid message: the
    handler answers INVALID_ARGUMENT (a raising deserializer would make gRPC answer
    UNKNOWN and log a traceback per request)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_mark(message: bytes) -> Any:
        try:
            return parse(message)
        except DecodeError as err:
            return Undecodable(str(err) or "malformed protobuf")

    return parse_or_mark


put_request_serializer = _serializer
get_response_serializer = _serializer
put_request_deserializer = _deserializer(pb.PutRequest)
get_response_deserializer = _deserializer(pb.GetResponse)

PUT_METHOD = "/kvtier.v1.KVTier/Put"
GET_METHOD = "/kvtier.v1.KVTier/Get"
