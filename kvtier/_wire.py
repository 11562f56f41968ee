"""Wire-compatible fast paths for the data chunks of Put and Get.

`PutRequest` and `GetResponse` carry data as field 2 (`bytes chunk`) of a oneof, so a chunk
message on the wire is exactly `0x12 <varint length> <data>`. Generated protobuf code would
copy the data twice per chunk (parse, then field access); these (de)serializers build and
read that framing directly, with at most one copy, and fall back to protobuf for every
other message. Clients in other languages still speak plain protobuf: the bytes on the
wire are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


# ---- PutBlock / GetBlock: one block in one message ----------------------------------------
# Their messages are a header submessage (field 1) and the data (field 2, `bytes`), plus
# GetBlockResponse's use_stream (field 3, varint). Read here field by field, the data as a
# view of the received bytes (generated code would copy it twice); written with the data
# copied once. Anything unusual (a field twice, another wire type, bytes past the end)
# goes to protobuf itself, so other clients' encodings are read exactly as protobuf would.

INLINE_MAX_BYTES = 8 << 20  # the largest block PutBlock / GetBlock carry in one message
DEFAULT_INLINE_BYTES = (4 << 20) - (64 << 10)  # GetBlock's when the request says 0
INLINE_HEADROOM_BYTES = 64 << 10  # for the header: the key, the namespace


class InlinePut:
    """A PutBlock request: `header`, and `data` (a view of the received bytes on the
    daemon, the caller's buffer in a client)."""

    __slots__ = ("data", "header")

    def __init__(self, header: pb.PutHeader, data: Buffer) -> None:
        self.header = header
        self.data = data


class InlineBlock:
    """A GetBlock response: `header`, and `data` viewing the received bytes (empty when
    `use_stream`: the block is larger than the request allowed inline)."""

    __slots__ = ("data", "header", "use_stream")

    def __init__(self, header: pb.GetHeader, data: Buffer, use_stream: bool) -> None:
        self.header = header
        self.data = data
        self.use_stream = use_stream


def _read_varint(message: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        byte = message[pos]  # IndexError past the end: the caller falls back
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("varint longer than 10 bytes")


def _fields(message: bytes) -> dict[int, memoryview | int] | None:
    """The top-level fields of a message of varint and length-delimited fields, each at
    most once (a length-delimited one as a view); None for anything else."""
    fields: dict[int, memoryview | int] = {}
    view = memoryview(message)
    pos, end = 0, len(message)
    try:
        while pos < end:
            tag, pos = _read_varint(message, pos)
            number, wire_type = tag >> 3, tag & 7
            if number in fields or number == 0:
                return None
            if wire_type == 0:
                fields[number], pos = _read_varint(message, pos)
            elif wire_type == 2:
                length, pos = _read_varint(message, pos)
                if pos + length > end:
                    return None
                fields[number] = view[pos : pos + length]
                pos += length
            else:
                return None
    except (IndexError, ValueError):
        return None
    return fields


EMPTY = memoryview(b"")


def _view(fields: dict[int, memoryview | int], number: int) -> memoryview | None:
    """Field `number` as a view (an absent field is empty); None if it is a varint."""
    value = fields.get(number, EMPTY)
    return value if isinstance(value, memoryview) else None


def _length_delimited(number: int, data: Buffer) -> tuple[bytes, Buffer]:
    return bytes((number << 3 | 2,)) + _varint(memoryview(data).nbytes), data


def put_block_request_serializer(msg: InlinePut | pb.PutBlockRequest) -> bytes:
    if isinstance(msg, pb.PutBlockRequest):
        return msg.SerializeToString()
    return b"".join(
        (*_length_delimited(1, msg.header.SerializeToString()), *_length_delimited(2, msg.data))
    )


def put_block_request_deserializer(message: bytes) -> InlinePut:
    fields = _fields(message)
    if fields is not None and fields.keys() <= {1, 2}:
        header, data = _view(fields, 1), _view(fields, 2)
        if header is not None and data is not None:
            return InlinePut(pb.PutHeader.FromString(bytes(header)), data)
    parsed = pb.PutBlockRequest.FromString(message)
    return InlinePut(parsed.header, parsed.data)


def get_block_message(header: pb.GetHeader, data: Sequence[Buffer], use_stream: bool) -> bytes:
    """A serialized GetBlockResponse: `header`, the pieces of `data` back to back (copied
    once, here), and `use_stream` if set."""
    size_bytes = sum(memoryview(d).nbytes for d in data)
    parts: list[Buffer] = list(_length_delimited(1, header.SerializeToString()))
    if use_stream:
        parts.append(b"\x18\x01")
    if size_bytes:
        parts += (bytes((2 << 3 | 2,)) + _varint(size_bytes), *data)
    return b"".join(parts)


def get_block_response_serializer(msg: bytes | pb.GetBlockResponse) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def get_block_response_deserializer(message: bytes) -> InlineBlock:
    fields = _fields(message)
    if fields is not None and fields.keys() <= {1, 2, 3}:
        header, data, flag = _view(fields, 1), _view(fields, 2), fields.get(3, 0)
        if header is not None and data is not None and isinstance(flag, int):
            return InlineBlock(pb.GetHeader.FromString(bytes(header)), data, bool(flag))
    parsed = pb.GetBlockResponse.FromString(message)
    return InlineBlock(parsed.header, parsed.data, parsed.use_stream)


put_request_serializer = _serializer
get_response_serializer = _serializer
put_request_deserializer = _deserializer(pb.PutRequest)
get_response_deserializer = _deserializer(pb.GetResponse)

PUT_METHOD = "/kvtier.v1.KVTier/Put"
GET_METHOD = "/kvtier.v1.KVTier/Get"
PUT_BLOCK_METHOD = "/kvtier.v1.KVTier/PutBlock"
GET_BLOCK_METHOD = "/kvtier.v1.KVTier/GetBlock"
