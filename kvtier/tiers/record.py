"""The record format: one block as a checksummed header region naming it, then its payload.

Layout (little-endian). The header region fills whole multiples of `align_bytes`: 4 KiB
on disk, so a record can go through O_DIRECT, and 8 bytes in the remote tier's values,
which carry the payload unpadded (kvtier/tiers/remote.py):

    header region (header_bytes, a multiple of align_bytes)
      magic "KVTREC01" | version u16 | codec u16 | header_bytes u32 | generation u64 |
      payload_bytes u64 | payload_xxh3 u64 | ns_len u16 | key_len u16 | flags u32 |
      namespace id | key | zero padding |
      seal: key_id 8 bytes | salt 16 | nonce 12 | tag 16 (zeros unless FLAG_SEALED) |
      header_xxh3 u64 (over everything before it)
    payload (payload_bytes), then (on disk) zero padding to a multiple of 4096

A sealed record (FLAG_SEALED) holds AES-256-GCM ciphertext of the same length as its
payload (kvtier/tiers/crypto.py); the associated data is the header up to the tag, and
payload_xxh3 (of the plaintext, checked again after decryption) is stored masked. The
header stays readable without the key, so recovery and `kvtier wipe` work from headers
alone. The seal's room is reserved in every header, so a record's size does not depend on
whether it is encrypted.

Format only: bytes in, bytes out; the one read (`read_header_region`) is of a descriptor
the caller opened. Where records live on disk (directories, atomic writes, the free pool,
tombstones, recovery) is kvtier/tiers/nvme.py.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.errors import CorruptRecord
from kvtier.tiers.allocator import round_up
from kvtier.tiers.crypto import SEAL, TAG_BYTES, RecordCipher, Seal

__all__ = [
    "ALIGN_BYTES",
    "CODEC_NONE",
    "FLAG_SEALED",
    "MAGIC",
    "VERSION",
    "ParsedHeader",
    "RecordHeader",
    "decode_header",
    "encode_header",
    "header_size_for",
    "open_header",
    "open_sealed_payload",
    "parse_header",
    "payload_xxh3",
    "read_header_region",
    "record_size_for",
    "seal_record",
    "verify_record",
]

MAGIC = b"KVTREC01"
VERSION = 1
CODEC_NONE = 0
ALIGN_BYTES = 4096
FLAG_SEALED = 0x1  # payload is AES-256-GCM ciphertext; the header's seal opens it
_KNOWN_FLAGS = FLAG_SEALED
_FIXED = struct.Struct("<8sHHIQQQHHI")
_CHECKSUM = struct.Struct("<Q")
_MAX_HEADER_BYTES = 64 << 10  # longest namespace and key fit many times over


@dataclass(frozen=True, slots=True)
class RecordHeader:
    ns_id: str
    key: bytes
    generation: int
    payload_bytes: int
    xxh3_64: int
    header_bytes: int
    codec: int = CODEC_NONE

    @property
    def record_bytes(self) -> int:
        return self.header_bytes + round_up(self.payload_bytes, ALIGN_BYTES)


def header_size_for(ns_id: str, key: bytes, align_bytes: int = ALIGN_BYTES) -> int:
    """A record's header region. The seal's room is counted whether or not the tier
    encrypts, so a block's size on disk (what capacity is charged) never depends on it.
    On disk it fills whole pages (O_DIRECT); over a network (the remote tier) 8 bytes do."""
    body_bytes = _FIXED.size + len(ns_id.encode()) + len(key) + SEAL.size + _CHECKSUM.size
    return round_up(body_bytes, align_bytes)


def record_size_for(ns_id: str, key: bytes, payload_bytes: int) -> int:
    """Bytes a record of this block takes on disk (what NVMe capacity is charged)."""
    return header_size_for(ns_id, key) + round_up(payload_bytes, ALIGN_BYTES)


def payload_xxh3(payload: bytes | memoryview | mmap.mmap) -> int:
    """The payload checksum a header carries (of the plaintext, also for sealed records)."""
    return xxhash.xxh3_64_intdigest(payload)


def _tag_offset(header_bytes: int) -> int:
    """Where a sealed record's tag sits: the associated data is everything before it."""
    return header_bytes - _CHECKSUM.size - TAG_BYTES


def _header_region(
    header: RecordHeader,
    flags: int,
    stored_xxh3: int,
    seal: bytes,
    into: memoryview | None = None,
) -> memoryview:
    """Everything of a header region but its checksum (see `_finish_header`), in `into`
    (a reused aligned buffer of header_bytes: cleared first) or a new buffer."""
    ns = header.ns_id.encode()
    if into is None:
        buf = memoryview(aligned_buffer(header.header_bytes))
    else:
        buf = into
        buf[:] = bytes(header.header_bytes)
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        header.codec,
        header.header_bytes,
        header.generation,
        header.payload_bytes,
        stored_xxh3,
        len(ns),
        len(header.key),
        flags,
    )
    body_end = _FIXED.size + len(ns) + len(header.key)
    buf[: _FIXED.size] = fixed
    buf[_FIXED.size : body_end] = ns + header.key
    seal_at = header.header_bytes - _CHECKSUM.size - SEAL.size
    buf[seal_at : seal_at + len(seal)] = seal
    return buf


def _finish_header(buf: memoryview, header_bytes: int) -> None:
    end = header_bytes - _CHECKSUM.size
    buf[end:header_bytes] = _CHECKSUM.pack(xxhash.xxh3_64_intdigest(buf[:end]))


def encode_header(header: RecordHeader, into: memoryview | None = None) -> memoryview:
    """The header region of a plaintext record (in `into`, see `_header_region`)."""
    buf = _header_region(header, 0, header.xxh3_64, b"", into)
    _finish_header(buf, header.header_bytes)
    return buf


def seal_record(
    cipher: RecordCipher,
    header: RecordHeader,
    payload: Sequence[memoryview | mmap.mmap],
    head: memoryview,
    body: memoryview,
) -> None:
    """Seal a record under a fresh seal: its header region into `head` (header_bytes,
    cleared first) and the ciphertext of `payload`, zero-padded, into `body`
    (record_bytes - header_bytes). `payload` is only read."""
    seal = cipher.new_seal()
    _header_region(header, FLAG_SEALED, header.xxh3_64 ^ cipher.xxh3_mask(seal), seal.pack(), head)
    plaintext: list[memoryview] = []
    left = header.payload_bytes
    for buf in payload:
        part = memoryview(buf)[:left]
        plaintext.append(part)
        left -= len(part)
    end = header.payload_bytes
    tag_at = _tag_offset(header.header_bytes)
    tag = cipher.encrypt(seal, bytes(head[:tag_at]), plaintext, body[:end])
    body[end:] = bytes(len(body) - end)  # callers reuse buffers: clear the padding
    head[tag_at : tag_at + TAG_BYTES] = tag
    _finish_header(head, header.header_bytes)


@dataclass(frozen=True, slots=True)
class ParsedHeader:
    """A verified header region as stored: `header.xxh3_64` is masked when `seal` is set."""

    header: RecordHeader
    seal: Seal | None


def parse_header(data: bytes | memoryview, align_bytes: int = ALIGN_BYTES) -> ParsedHeader:
    """Parse and verify a header region without a key; CorruptRecord says what is wrong."""
    if len(data) < _FIXED.size:
        raise CorruptRecord("record shorter than its fixed header")
    (
        magic,
        version,
        codec,
        header_bytes,
        generation,
        payload_bytes,
        xxh3_64,
        ns_len,
        key_len,
        flags,
    ) = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptRecord("bad magic")
    if version != VERSION:
        raise CorruptRecord(f"unknown record version {version}")
    if flags & ~_KNOWN_FLAGS:
        raise CorruptRecord(f"unknown record flags {flags:#x}")
    sealed = bool(flags & FLAG_SEALED)
    # Records written before the seal's room was reserved have none: fine unless sealed.
    least = _FIXED.size + ns_len + key_len + (SEAL.size if sealed else 0) + _CHECKSUM.size
    if header_bytes % align_bytes or header_bytes < least:
        raise CorruptRecord("bad header length")
    if len(data) < header_bytes:
        raise CorruptRecord("truncated header")
    end = header_bytes - _CHECKSUM.size
    (stored,) = _CHECKSUM.unpack_from(data, end)
    if stored != xxhash.xxh3_64_intdigest(data[:end]):
        raise CorruptRecord("header checksum mismatch")
    body = bytes(data[_FIXED.size : _FIXED.size + ns_len + key_len])
    try:
        ns_id = body[:ns_len].decode()
    except UnicodeDecodeError:
        raise CorruptRecord("namespace is not UTF-8") from None
    header = RecordHeader(
        ns_id=ns_id,
        key=body[ns_len:],
        generation=generation,
        payload_bytes=payload_bytes,
        xxh3_64=xxh3_64,
        header_bytes=header_bytes,
        codec=codec,
    )
    seal = Seal.unpack(data[end - SEAL.size : end]) if sealed else None
    return ParsedHeader(header, seal)


def open_header(parsed: ParsedHeader, cipher: RecordCipher | None) -> RecordHeader:
    """The header as a tier with `cipher` (None: no encryption) serves it: a sealed record
    needs this tier's key, a plaintext one needs a tier without a key (anything else could
    be a planted record); the plaintext's xxh3 unmasked."""
    if parsed.seal is None:
        if cipher is not None:
            raise CorruptRecord("record is not encrypted, but nvme.encryption_key_file is set")
        return parsed.header
    if cipher is None:
        raise CorruptRecord("record is encrypted, but nvme.encryption_key_file is not set")
    if parsed.seal.key_id != cipher.key_id:
        raise CorruptRecord("record is encrypted with another key")
    xxh3_64 = parsed.header.xxh3_64 ^ cipher.xxh3_mask(parsed.seal)
    return replace(parsed.header, xxh3_64=xxh3_64)


def decode_header(data: bytes | memoryview, cipher: RecordCipher | None = None) -> RecordHeader:
    """Parse and verify a header region as a tier with `cipher` reads it (`open_header`)."""
    return open_header(parse_header(data), cipher)


def verify_record(
    head: memoryview, body: memoryview, expected: RecordHeader, cipher: RecordCipher | None
) -> Seal | None:
    """Header equal to the catalog's, zero padding after the payload, and the payload
    checksum (of a sealed record: after decryption, `open_sealed_payload`); returns the
    seal. CorruptRecord says what differs."""
    parsed = parse_header(head)
    found = open_header(parsed, cipher)
    if found != expected:
        raise CorruptRecord("header does not match the catalog")
    end = found.payload_bytes
    if parsed.seal is None and payload_xxh3(body[:end]) != found.xxh3_64:
        raise CorruptRecord("payload checksum mismatch")
    if body[end:].tobytes().strip(b"\0"):
        raise CorruptRecord("non-zero padding after the payload")
    return parsed.seal


def open_sealed_payload(
    cipher: RecordCipher,
    seal: Seal,
    header: RecordHeader,
    head: memoryview,
    body: memoryview,
    dest: memoryview,
) -> None:
    """Decrypt a sealed record `verify_record` passed into `dest` (its padding zeroed) and
    check the plaintext's checksum; on any failure `dest` is left zeroed, never holding
    unauthenticated bytes."""
    end = header.payload_bytes
    cipher.decrypt(seal, bytes(head[: _tag_offset(header.header_bytes)]), body[:end], dest[:end])
    dest[end:] = bytes(len(dest) - end)
    if payload_xxh3(dest[:end]) != header.xxh3_64:
        # Sealed by a writer that checksummed other bytes than it encrypted: a bug, but
        # still never served.
        dest[:end] = bytes(end)
        raise CorruptRecord("payload checksum mismatch after decryption")


def read_header_region(fd: int) -> bytes:
    """A record's header region from the file open as `fd` (as much of it as the file
    has): one page, and the rest when the header says it is longer."""
    data = os.pread(fd, ALIGN_BYTES, 0)
    if len(data) < _FIXED.size:
        raise CorruptRecord("truncated header")
    header_bytes = _FIXED.unpack_from(data, 0)[3]
    if ALIGN_BYTES < header_bytes <= _MAX_HEADER_BYTES:
        data += os.pread(fd, header_bytes - ALIGN_BYTES, ALIGN_BYTES)
    return data
