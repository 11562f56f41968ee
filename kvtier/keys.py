"""Namespaces, block keys, and the chained prefix-hash helper engines and tools share."""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Sequence

from kvtier.errors import InvalidArgument

DEFAULT_TENANT = "default"
_SEGMENT = r"[A-Za-z0-9_.:@+=-]+"
_NAMESPACE_RE = re.compile(rf"^{_SEGMENT}(/{_SEGMENT})*$")
_TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_namespace(namespace: str, max_chars: int) -> str:
    """`namespace` if it is a valid "model/layout" string, else InvalidArgument saying why."""
    if not namespace:
        raise InvalidArgument("namespace is empty: pass a string like 'llama3-8b/bf16-b16-tp1'")
    if len(namespace) > max_chars:
        raise InvalidArgument(
            f"namespace is {len(namespace)} characters; the limit is {max_chars} "
            "(limits.max_namespace_chars)"
        )
    if not _NAMESPACE_RE.match(namespace) or any(
        seg in (".", "..") for seg in namespace.split("/")
    ):
        raise InvalidArgument(
            "namespace must be '/'-separated segments of letters, digits and _ . : @ + = - "
            f"(no spaces, no empty, '.' or '..' segments); got {namespace[:80]!r}"
        )
    return namespace


def check_tenant(tenant: str) -> str:
    if not _TENANT_RE.match(tenant):
        raise InvalidArgument(f"tenant name must match {_TENANT_RE.pattern}")
    return tenant


def check_key(key: bytes, max_bytes: int) -> bytes:
    """`key` if its length is within 1..max_bytes, else InvalidArgument saying what to fix."""
    if not key:
        raise InvalidArgument("key is empty: pass 1 or more bytes (normally a 16-32 byte hash)")
    if len(key) > max_bytes:
        raise InvalidArgument(
            f"key is {len(key)} bytes; the limit is {max_bytes} (limits.max_key_bytes): "
            "hash long keys to 16-32 bytes"
        )
    return key


def check_keys(keys: Iterable[bytes], max_bytes: int) -> list[bytes]:
    """`keys` as a list if every one passes `check_key` (a chain of hundreds is checked by
    its shortest and longest, not key by key), else InvalidArgument for the first bad one."""
    out = list(keys)
    if out:
        lengths = list(map(len, out))
        if min(lengths) == 0 or max(lengths) > max_bytes:
            for key in out:
                check_key(key, max_bytes)
    return out


def distinct_prefix(keys: list[bytes]) -> int:
    """How many of `keys`, from the first, name no block twice."""
    if len(set(keys)) == len(keys):
        return len(keys)
    seen: set[bytes] = set()
    for i, key in enumerate(keys):
        if key in seen:
            return i
        seen.add(key)
    return len(keys)


def namespace_id(tenant: str, namespace: str) -> str:
    """The daemon-internal name of a namespace: tenant and namespace, never confusable."""
    return f"{tenant}|{namespace}"


def tenant_of(ns_id: str) -> str:
    """The tenant part of a namespace id."""
    return ns_id.partition("|")[0]


def namespace_of(ns_id: str) -> str:
    """The client's namespace in a namespace id (`namespace_id`'s inverse, tenant off)."""
    return ns_id.partition("|")[2]


def hash_token(token: str) -> str:
    """What the config stores for a bearer token (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def chain_keys(
    namespace: str,
    token_blocks: Iterable[Sequence[int]],
    extra: bytes = b"",
    digest_bytes: int = 32,
) -> list[bytes]:
    """Chained prefix keys: key_i = SHA-256(key_{i-1} ‖ tokens_i ‖ extra), salted by namespace.

    Every field is length-prefixed, so no two different chains share a key. Equal keys mean
    equal prefixes: block i's key commits to every token of blocks 0..i.
    """
    if not 16 <= digest_bytes <= 32:
        raise InvalidArgument("digest_bytes must be within 16..32")
    parent = hashlib.sha256(_field(b"kvtier-chain-v1") + _field(namespace.encode())).digest()
    keys: list[bytes] = []
    for tokens in token_blocks:
        payload = struct.pack(f"<{len(tokens)}q", *tokens)
        parent = hashlib.sha256(_field(parent) + _field(payload) + _field(extra)).digest()
        keys.append(parent[:digest_bytes])
    return keys
