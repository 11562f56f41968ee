"""AES-256-GCM records (nvme.encryption_key_file): round trips, tampering, keys, recovery."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import pytest
import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.cli import main as cli_main
from kvtier.config import NvmeConfig
from kvtier.errors import ConfigError, CorruptRecord
from kvtier.tiers.allocator import round_up
from kvtier.tiers.crypto import SEAL, RecordCipher, load_key_file, parse_key
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for, record_size_for
from tests.tiers.conftest import reopen

NS = "alice|m/l"
KEY = bytes(range(1, 33))
OTHER_KEY = bytes(range(2, 34))
MARKER = b"SECRET-PROMPT-OF-ALICE:"


def open_tier(
    opened: list[NvmeTier], root: Path, key: bytes | None, direct: bool = True
) -> NvmeTier:
    return reopen(opened, root, key, direct)[0]


def header_for(key: bytes, data: bytes, generation: int = 1, ns: str = NS) -> RecordHeader:
    return RecordHeader(
        ns, key, generation, len(data), xxhash.xxh3_64_intdigest(data), header_size_for(ns, key)
    )


def write(
    tier: NvmeTier, key: bytes, data: bytes, generation: int = 1, ns: str = NS
) -> RecordHeader:
    header = header_for(key, data, generation, ns)
    buf = aligned_buffer(round_up(max(len(data), 1), 4096))
    buf[: len(data)] = data
    before = bytes(buf)
    payload = [memoryview(buf)[: round_up(len(data), 4096)]] if data else []
    assert tier.write(header, payload) == header.record_bytes
    assert bytes(buf) == before  # the caller's buffer (a DRAM-arena extent) is only read
    return header


def read(tier: NvmeTier, header: RecordHeader) -> bytes:
    buf, offset = tier.read(header)
    return bytes(buf[offset : offset + header.payload_bytes])


def read_into(tier: NvmeTier, header: RecordHeader) -> tuple[bytes, bytes]:
    """(payload, padding) as read into an extent full of another block's bytes."""
    body_bytes = header.record_bytes - header.header_bytes
    extent = aligned_buffer(body_bytes)
    extent[:] = b"\xff" * len(extent)
    tier.read_into(header, memoryview(extent)[:body_bytes])
    return bytes(extent[: header.payload_bytes]), bytes(extent[header.payload_bytes : body_bytes])


def secret(size: int) -> bytes:
    data = (MARKER + os.urandom(max(size, 0)))[:size]
    return data


def files_under(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def reseal_header(path: Path, edit: dict[int, bytes]) -> bytes:
    """A record file with header bytes replaced at the given offsets and its header checksum
    recomputed: what someone who can write the directory (but has no key) can forge."""
    data = bytearray(path.read_bytes())
    header_bytes = struct.unpack_from("<I", data, 12)[0]
    for offset, value in edit.items():
        data[offset : offset + len(value)] = value
    end = header_bytes - 8
    struct.pack_into("<Q", data, end, xxhash.xxh3_64_intdigest(bytes(data[:end])))
    return bytes(data)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, (3 << 20) + 5])
def test_round_trip_through_write_read_and_read_into(
    opened: list[NvmeTier], tmp_path: Path, direct: bool, size: int
) -> None:
    tier = open_tier(opened, tmp_path, KEY, direct)
    data = secret(size)
    header = write(tier, b"key", data)
    assert read(tier, header) == data
    payload, padding = read_into(tier, header)
    assert payload == data and padding == bytes(len(padding))
    path = tier.record_path(NS, b"key", 1)
    # What capacity is charged: the same as a plaintext record of the block.
    assert path.stat().st_size == header.record_bytes == record_size_for(NS, b"key", size)
    assert path.stat().st_size % 4096 == 0


def test_records_larger_than_the_kept_buffer_round_trip(
    opened: list[NvmeTier], tmp_path: Path
) -> None:
    tier = open_tier(opened, tmp_path, KEY, direct=False)
    big = secret((17 << 20) + 1)
    small = secret(70_000)
    headers = [write(tier, b"big", big), write(tier, b"small", small)]
    assert read(tier, headers[0]) == big and read(tier, headers[1]) == small
    assert read_into(tier, headers[0])[0] == big and read_into(tier, headers[1])[0] == small


def test_io_threads_do_not_share_buffers(opened: list[NvmeTier], tmp_path: Path) -> None:
    tier = open_tier(opened, tmp_path, KEY)
    failures: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for i in range(15):
                data = secret(4096 * (1 + (index * 7 + i) % 40) + i)
                header = write(tier, f"t{index}-{i}".encode(), data)
                assert read(tier, header) == data
                assert read_into(tier, header)[0] == data
        except BaseException as err:  # reported below, with the thread's traceback
            failures.append(err)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def test_disk_holds_neither_the_plaintext_nor_its_checksum(
    opened: list[NvmeTier], tmp_path: Path
) -> None:
    tier = open_tier(opened, tmp_path, KEY)
    data = secret(200_000)
    header = write(tier, b"key", data)
    on_disk = files_under(tmp_path)
    assert MARKER not in on_disk
    assert data[1000:1032] not in on_disk
    assert struct.pack("<Q", header.xxh3_64) not in on_disk  # stored masked
    assert b"alice|m/l" in on_disk  # the header stays readable: recovery needs it


def test_every_flipped_byte_is_detected_and_never_served(
    opened: list[NvmeTier], tmp_path: Path
) -> None:
    tier = open_tier(opened, tmp_path, KEY)
    data = secret(10_000)
    header = write(tier, b"key", data)
    path = tier.record_path(NS, b"key", 1)
    original = path.read_bytes()
    for offset in range(0, len(original), 97):
        damaged = bytearray(original)
        damaged[offset] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptRecord):
            read(tier, header)
        extent = aligned_buffer(len(original) - header.header_bytes)
        with pytest.raises(CorruptRecord):
            tier.read_into(header, memoryview(extent))
        assert MARKER not in bytes(extent)  # no unauthenticated plaintext left behind
    path.write_bytes(original)
    assert read(tier, header) == data


def test_a_record_copied_onto_another_keys_path_fails(
    opened: list[NvmeTier], tmp_path: Path
) -> None:
    tier = open_tier(opened, tmp_path, KEY)
    a = write(tier, b"a", secret(5000))
    b = write(tier, b"b", b"B" * 5000)
    path_a, path_b = tier.record_path(NS, b"a", 1), tier.record_path(NS, b"b", 1)
    path_b.write_bytes(path_a.read_bytes())  # the header names another block
    with pytest.raises(CorruptRecord, match="catalog"):
        read(tier, b)
    assert read(tier, a).startswith(MARKER)


_NS_AT = 48  # the namespace id follows the fixed fields


@pytest.mark.parametrize(
    ("ns", "key", "generation", "edit"),
    [
        (NS, b"b", 1, {_NS_AT + len(NS): b"b"}),  # another key
        (NS, b"a", 2, {16: struct.pack("<Q", 2)}),  # another generation
        ("bobby|m/l", b"a", 1, {_NS_AT: b"bobby"}),  # another tenant
    ],
    ids=["key", "generation", "tenant"],
)
def test_a_relabelled_record_fails_authentication(
    opened: list[NvmeTier],
    tmp_path: Path,
    ns: str,
    key: bytes,
    generation: int,
    edit: dict[int, bytes],
) -> None:
    """The header rewritten, checksum and all, and moved where it would belong: only the
    associated data (no key needed to forge the rest) stops it."""
    tier = open_tier(opened, tmp_path, KEY)
    write(tier, b"a", secret(5000))
    dest = tier.record_path(ns, key, generation)
    dest.write_bytes(reseal_header(tier.record_path(NS, b"a", 1), edit))
    found = tier._read_header(dest)  # passes every check a header alone allows
    assert (found.ns_id, found.key, found.generation) == (ns, key, generation)
    with pytest.raises(CorruptRecord, match="authentication"):
        read(tier, found)
    with pytest.raises(CorruptRecord, match="authentication"):
        tier.read_into(found, memoryview(aligned_buffer(8192))[:8192])


def test_another_key_or_no_key_cannot_read_a_sealed_record(
    opened: list[NvmeTier], tmp_path: Path
) -> None:
    tier = open_tier(opened, tmp_path, KEY)
    header = write(tier, b"key", secret(9000))
    path = tier.record_path(NS, b"key", 1)
    tier = open_tier(opened, tmp_path / "other", OTHER_KEY)
    (tmp_path / "other" / path.relative_to(tmp_path)).write_bytes(path.read_bytes())
    with pytest.raises(CorruptRecord, match="another key"):
        read(tier, header)
    # A header claiming the other key's id still fails: the tag is checked with the key.
    seal_at = header.header_bytes - 8 - SEAL.size
    forged = reseal_header(path, {seal_at: RecordCipher(OTHER_KEY).key_id})
    (tmp_path / "other" / path.relative_to(tmp_path)).write_bytes(forged)
    with pytest.raises(CorruptRecord):
        read(tier, tier._read_header(tmp_path / "other" / path.relative_to(tmp_path)))
    tier = open_tier(opened, tmp_path / "none", None)
    (tmp_path / "none" / path.relative_to(tmp_path)).write_bytes(path.read_bytes())
    with pytest.raises(CorruptRecord, match="encrypted, but"):
        read(tier, header)


def test_a_tier_with_a_key_refuses_plaintext_records(
    opened: list[NvmeTier], tmp_path: Path
) -> None:
    tier = open_tier(opened, tmp_path, None)
    header = write(tier, b"key", b"planted" * 100)
    tier = open_tier(opened, tmp_path / "keyed", KEY)
    path = tier.record_path(NS, b"key", 1)
    path.write_bytes((tmp_path / path.relative_to(tmp_path / "keyed")).read_bytes())
    with pytest.raises(CorruptRecord, match="not encrypted"):
        read(tier, header)


def test_recovery_keeps_records_of_its_key_and_drops_the_rest(
    opened: list[NvmeTier], tmp_path: Path
) -> None:
    tier = open_tier(opened, tmp_path, KEY)
    data = {f"k{i}".encode(): secret(3000 * i + 1) for i in range(5)}
    headers = {key: write(tier, key, value) for key, value in data.items()}
    write(tier, b"k0", data[b"k0"], generation=2)  # supersedes generation 1
    headers[b"k0"] = header_for(b"k0", data[b"k0"], 2)
    tier, report = reopen(opened, tmp_path, KEY)
    assert report.dropped_stale == 1
    assert sorted(r.header.key for r in report.records) == sorted(data)
    for rec in report.records:
        assert rec.header == headers[rec.header.key]  # plaintext xxh3, as the catalog has it
        assert read(tier, rec.header) == data[rec.header.key]
    _, report = reopen(opened, tmp_path, OTHER_KEY)
    assert report.records == [] and report.dropped_corrupt == 5


def test_a_plaintext_tier_drops_sealed_records_at_start(
    opened: list[NvmeTier], tmp_path: Path
) -> None:
    tier = open_tier(opened, tmp_path, KEY)
    write(tier, b"k", secret(100))
    _, report = reopen(opened, tmp_path, None)
    assert report.records == [] and report.dropped_corrupt == 1


# ---- the key file ---------------------------------------------------------------------
def key_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "kvtier.key"
    path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606])
def test_a_key_file_others_can_access_is_refused(tmp_path: Path, mode: int) -> None:
    path = key_file(tmp_path, KEY.hex().encode(), mode)
    with pytest.raises(ConfigError, match="chmod 600") as info:
        load_key_file(path)
    assert str(path) in str(info.value) and "nvme.encryption_key_file" in str(info.value)
    config = NvmeConfig(path=str(tmp_path / "nvme"), encryption_key_file=str(path))
    with pytest.raises(ConfigError, match="chmod 600"):
        NvmeTier.from_config(config)


@pytest.mark.parametrize(
    ("content", "mode"),
    [
        (KEY.hex().encode(), 0o600),
        (KEY.hex().encode() + b"\n", 0o400),
        (KEY.hex().upper().encode() + b"\r\n", 0o600),
    ],
)
def test_key_file_formats(tmp_path: Path, content: bytes, mode: int) -> None:
    assert load_key_file(key_file(tmp_path, content, mode)) == KEY


@pytest.mark.parametrize(
    "content",
    [b"", b"00" * 16, KEY.hex().encode()[:-1], b"zz" * 32, KEY, bytes(32), b"00" * 32],
)
def test_malformed_keys_are_refused(content: bytes) -> None:
    with pytest.raises(ConfigError):
        parse_key(content)


def test_a_missing_key_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kvtier keygen"):
        load_key_file(tmp_path / "absent.key")


def test_keygen_makes_a_private_key_file_and_never_replaces_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kvtier.key"
    old_umask = os.umask(0)  # keygen must not depend on the caller's umask
    try:
        assert cli_main(["keygen", str(path)]) == 0
    finally:
        os.umask(old_umask)
    assert path.stat().st_mode & 0o777 == 0o600
    text = path.read_text()
    assert len(text) == 65 and text.endswith("\n") and bytes.fromhex(text.strip())
    assert "encryption_key_file" in capsys.readouterr().out
    assert cli_main(["keygen", str(path)]) == 2
    assert path.read_text() == text
    assert "never replaces" in capsys.readouterr().err
    config = NvmeConfig(path=str(tmp_path / "nvme"), encryption_key_file=str(path))
    tier = NvmeTier.from_config(config)
    assert tier.cipher is not None
    assert tier.cipher.key_id == RecordCipher(bytes.fromhex(text)).key_id


def test_encryption_is_off_by_default(tmp_path: Path) -> None:
    assert NvmeTier.from_config(NvmeConfig(path=str(tmp_path))).cipher is None
