"""The remote tier's record format, checks and codec, over an in-memory backend (the real
stores are in tests/integration/test_remote.py)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import CorruptRecord
from kvtier.tiers import codec
from kvtier.tiers.remote import RemoteTier, object_name

NS = "alice|llama3-8b/v1"


class MemoryBackend:
    name = "memory"

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def put(self, name: str, value: bytes) -> None:
        with self.lock:
            self.values[name] = bytes(value)

    def get(self, name: str) -> bytes | None:
        return self.values.get(name)

    def exists(self, names: Sequence[str]) -> list[bool]:
        return [n in self.values for n in names]

    def delete(self, name: str) -> None:
        self.values.pop(name, None)

    def close(self) -> None:
        pass


def _kv_like(size_bytes: int, seed: int = 0) -> bytes:
    """bf16-shaped bytes: random low bytes, a narrow range of high (sign/exponent) bytes,
    as real activations have; the codec gains on these and nothing on random bytes."""
    rnd = os.urandom(size_bytes // 2)
    out = bytearray(size_bytes)
    out[0::2] = rnd
    out[1::2] = bytes(0x3C + (b + seed) % 4 for b in rnd)
    return bytes(out)


def _put(tier: RemoteTier, key: bytes, payload: bytes, encoded: bool = False) -> None:
    digest = xxhash.xxh3_64_intdigest(payload)
    tier.send(NS, key, tier.encode(NS, key, 7, memoryview(payload), digest, encoded))


def _get(tier: RemoteTier, key: bytes, size_bytes: int = 1 << 20) -> bytes | None:
    fetched = tier.fetch(NS, key, size_bytes)
    if fetched is None:
        return None
    out = bytearray(fetched.payload_bytes + 100)
    tier.fill(fetched, memoryview(out))
    assert out[fetched.payload_bytes :] == bytes(100)  # the tail is zeroed
    return bytes(out[: fetched.payload_bytes])


@pytest.mark.parametrize("encoded", [False, True])
def test_round_trip_plain_and_encoded(encoded: bool) -> None:
    tier = RemoteTier(MemoryBackend(), codec_mode="off")
    payload = _kv_like(64 << 10)
    _put(tier, b"k", payload, encoded)
    assert _get(tier, b"k") == payload
    assert _get(tier, b"other") is None


def test_encoded_value_is_smaller_on_kv_like_data_and_marked_in_its_header() -> None:
    backend = MemoryBackend()
    tier = RemoteTier(backend, codec_mode="on")
    payload = _kv_like(256 << 10)
    _put(tier, b"k", payload, encoded=True)
    (value,) = backend.values.values()
    assert len(value) < 0.9 * len(payload)
    fetched = tier.fetch(NS, b"k", 1 << 20)
    assert fetched is not None
    assert fetched.header.codec == codec.CODEC_SHUFFLE_LZ4 | (2 << 8)


def test_object_names_lead_with_the_tenant_and_hide_the_namespace() -> None:
    name = object_name(NS, b"\x01\xff")
    assert name.startswith("kvtier/v1/alice/")
    assert "llama3" not in name and name.endswith("/01ff")
    assert object_name("bob|llama3-8b/v1", b"\x01\xff") != name


def _planted(tier: RemoteTier, backend: MemoryBackend, mutate: str) -> None:
    payload = _kv_like(32 << 10)
    _put(tier, b"k", payload)
    name = object_name(NS, b"k")
    value = bytearray(backend.values[name])
    fetched = tier.fetch(NS, b"k", 1 << 20)
    assert fetched is not None
    head = fetched.header.header_bytes
    if mutate == "payload byte":
        value[head + 100] ^= 0x01
    elif mutate == "header byte":
        value[20] ^= 0x01
    elif mutate == "truncated":
        del value[-1]
    elif mutate == "garbage":
        value = bytearray(os.urandom(len(value)))
    elif mutate == "another key's record":
        _put(tier, b"other", payload)
        value = bytearray(backend.values[object_name(NS, b"other")])
    elif mutate == "another tenant's record":
        other = RemoteTier(MemoryBackend())
        bob = "bob|llama3-8b/v1"
        other.send(bob, b"k", other.encode(bob, b"k", 1, memoryview(payload), 0, False))
        value = bytearray(next(iter(other.backend.values.values())))  # type: ignore[attr-defined]
    backend.values[name] = bytes(value)


@pytest.mark.parametrize(
    "mutate",
    [
        "payload byte",
        "header byte",
        "truncated",
        "garbage",
        "another key's record",
        "another tenant's record",
    ],
)
def test_a_planted_or_damaged_value_is_corrupt_never_served(mutate: str) -> None:
    backend = MemoryBackend()
    tier = RemoteTier(backend, codec_mode="off")
    _planted(tier, backend, mutate)
    with pytest.raises(CorruptRecord):
        _get(tier, b"k")


def test_a_damaged_encoded_payload_is_corrupt_and_leaves_no_bytes_behind() -> None:
    backend = MemoryBackend()
    tier = RemoteTier(backend, codec_mode="on")
    payload = _kv_like(64 << 10)
    _put(tier, b"k", payload, encoded=True)
    name = object_name(NS, b"k")
    value = bytearray(backend.values[name])
    value[-50] ^= 0x40
    backend.values[name] = bytes(value)
    fetched = tier.fetch(NS, b"k", 1 << 20)
    assert fetched is not None
    out = bytearray(b"\xee" * len(payload))
    with pytest.raises(CorruptRecord):
        tier.fill(fetched, memoryview(out))
    assert not out.strip(b"\0") or out == bytearray(b"\xee" * len(payload))


def test_a_value_larger_than_the_caller_accepts_is_refused() -> None:
    tier = RemoteTier(MemoryBackend(), codec_mode="off")
    _put(tier, b"k", _kv_like(64 << 10))
    with pytest.raises(CorruptRecord, match="too large"):
        tier.fetch(NS, b"k", 32 << 10)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=5000), element_bytes=st.integers(1, 8))
def test_codec_round_trips_any_bytes(data: bytes, element_bytes: int) -> None:
    blob = codec.encode(data, element_bytes)
    out = bytearray(len(data))
    codec.decode(blob, element_bytes, len(data), memoryview(out))
    assert bytes(out) == data


@settings(max_examples=200, deadline=None)
@given(
    ratio=st.floats(0.5, 4.0),
    decode_gbps=st.floats(0.05, 20.0),
    bandwidth_gbps=st.floats(0.01, 50.0),
)
def test_codec_is_used_exactly_when_it_makes_a_read_faster(
    ratio: float, decode_gbps: float, bandwidth_gbps: float
) -> None:
    meter = codec.CodecMeter()
    raw = 1 << 20
    meter.observe(raw, int(raw / ratio), raw / 1e9, raw / (decode_gbps * 1e9))
    fig = meter.figures
    assert fig is not None
    b = bandwidth_gbps * 1e9
    plain_s = raw / b
    encoded_s = raw / fig.ratio / b + raw / fig.decode_bytes_per_s
    assert meter.worth_it(b) == (encoded_s < plain_s)
    if meter.break_even_bytes_per_s() > 0 and abs(b / meter.break_even_bytes_per_s() - 1) > 1e-6:
        assert meter.worth_it(b) == (b < meter.break_even_bytes_per_s())


def test_auto_codec_turns_on_only_for_a_slow_path() -> None:
    tier = RemoteTier(MemoryBackend(), codec_mode="auto")
    payload = _kv_like(256 << 10)
    for i in range(3):
        _put(tier, f"k{i}".encode(), payload)  # the first write is a trial: figures exist
    fig = tier.meter.figures
    assert fig is not None and fig.ratio > 1.1
    assert tier.use_codec(1e6)  # 1 MB/s: any codec pays
    assert not tier.use_codec(100e9)  # faster than the codec can decode: never


def test_with_a_cluster_key_only_records_signed_with_it_are_served() -> None:
    backend = MemoryBackend()
    key, other_key = os.urandom(32), os.urandom(32)
    signed = RemoteTier(backend, codec_mode="off", signing_key=key)
    payload = _kv_like(32 << 10)
    _put(signed, b"k", payload)
    assert _get(signed, b"k") == payload
    # Anyone who can write to the store but lacks the key: a well-formed, checksummed
    # record, unsigned or signed with another key, is refused.
    for writer in (RemoteTier(backend, "off"), RemoteTier(backend, "off", signing_key=other_key)):
        _put(writer, b"k", _kv_like(32 << 10, seed=1))
        with pytest.raises(CorruptRecord, match="not signed"):
            _get(signed, b"k")
    # And a node without the key does not serve signed records (its length check fails).
    _put(signed, b"k", payload)
    with pytest.raises(CorruptRecord):
        _get(RemoteTier(backend, "off"), b"k")
