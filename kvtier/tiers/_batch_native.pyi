from collections.abc import Sequence

from kvtier.tiers.record import RecordHeader

Buffer = bytes | bytearray | memoryview

GIL_FREE_BYTES: int  # a batch of more bytes than this is hashed with the GIL let go

def digests(payloads: Sequence[Sequence[Buffer]], nbytes: Sequence[int], /) -> list[int]:
    """The xxh3-64 of the first nbytes[i] bytes of each payload (record_batch.py)."""

def encode_headers(buf: Buffer, starts: Sequence[int], headers: Sequence[RecordHeader], /) -> None:
    """record.encode_header of each plaintext header into buf at starts[i]."""
