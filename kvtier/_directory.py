"""The layout of a tenant's directory (kvtier/engine/directory.py writes it, the client's
direct reads in kvtier/client/zerocopy.py read it): both sides' one definition, as
kvtier/_session.py is for the session socket's frames.

Each entry is ENTRY_WORDS little-endian u64 words,

    seq | digest_lo | digest_hi | offset | size_bytes | xxh3_64 | generation | 0

where `digest` is the xxh3-128 of `key_encoding(namespace, key)` and a block's entry is
one of the PROBE_SLOTS entries from `digest_lo % entries`.
"""

from __future__ import annotations

import xxhash

__all__ = [
    "DIGEST_HI",
    "DIGEST_LO",
    "ENTRY_BYTES",
    "ENTRY_WORDS",
    "GENERATION",
    "OFFSET",
    "PROBE_SLOTS",
    "SEQ",
    "SIZE",
    "XXH3",
    "key_digest",
    "key_encoding",
]

ENTRY_WORDS = 8
# Each word's index in an entry (the layout above).
SEQ, DIGEST_LO, DIGEST_HI, OFFSET, SIZE, XXH3, GENERATION = range(7)
ENTRY_BYTES = 8 * ENTRY_WORDS  # one cache line: entries never share one
PROBE_SLOTS = 8
_MASK_64 = (1 << 64) - 1


def key_encoding(namespace: bytes, key: bytes) -> bytes:
    """An unambiguous byte string for (namespace, key): length-prefixed namespace, key."""
    return len(namespace).to_bytes(4, "little") + namespace + key


def key_digest(namespace: bytes, key: bytes) -> tuple[int, int]:
    """(low, high) 64-bit halves of the xxh3-128 of (namespace, key)."""
    digest = xxhash.xxh3_128_intdigest(key_encoding(namespace, key))
    return digest & _MASK_64, digest >> 64
