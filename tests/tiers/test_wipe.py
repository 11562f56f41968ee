"""`kvtier wipe`: a tenant's records overwritten and removed, everyone else's intact."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.cli import main as cli_main
from kvtier.errors import ConfigError
from kvtier.tiers.allocator import round_up
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for, parse_header
from kvtier.tiers.wipe import wipe
from tests.tiers.conftest import reopen

ALICE, BOB = "alice|llama3-8b/bf16", "bob|llama3-8b/bf16"
KEY = bytes(range(7, 39))


def write(tier: NvmeTier, ns: str, key: bytes, data: bytes, generation: int) -> RecordHeader:
    header = RecordHeader(
        ns, key, generation, len(data), xxhash.xxh3_64_intdigest(data), header_size_for(ns, key)
    )
    buf = aligned_buffer(round_up(len(data), 4096))
    buf[: len(data)] = data
    tier.write(header, [memoryview(buf)[: round_up(len(data), 4096)]])
    return header


def block(tenant: str, i: int, size: int = 20_000) -> bytes:
    return (f"<{tenant}-block-{i}>".encode() * size)[:size]


def everything_under(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def fill(opened: list[NvmeTier], root: Path, key: bytes | None) -> dict[bytes, bytes]:
    """Records of alice and bob, removed ones in free/, a stray temporary file, tombstones
    of both tenants; returns bob's live blocks (key -> bytes). The tier is closed after."""
    tier, _ = reopen(opened, root, key)
    bob: dict[bytes, bytes] = {}
    generation = 1
    for i in range(6):
        write(tier, ALICE, f"a{i}".encode(), block("alice", i), generation)
        write(tier, BOB, f"b{i}".encode(), block("bob", i), generation + 1)
        bob[f"b{i}".encode()] = block("bob", i)
        generation += 2
    # Removed records become recyclable files: alice's old bytes in free/.
    olds = [
        write(tier, ALICE, f"old{i}".encode(), block("alice", 100 + i), generation + i)
        for i in range(2)
    ]
    # Deleted, but the file was still there when the daemon died: the tombstone must keep
    # this one of bob's deleted through the wipe.
    gone = write(tier, BOB, b"gone", block("bob", 99), generation + 2)
    tier.tombstone(gone.ns_id, gone.key, gone.generation)
    for old in olds:
        tier.tombstone(old.ns_id, old.key, old.generation)
        tier.remove(old)
    (root / "tmp" / "half-written.tmp").write_bytes(block("alice", 200, 5000))
    while opened:
        opened.pop().close()
    return bob


@pytest.mark.parametrize("key", [None, KEY], ids=["plaintext", "encrypted"])
def test_wipe_removes_every_trace_of_one_tenant_and_keeps_the_others(
    opened: list[NvmeTier], tmp_path: Path, key: bytes | None
) -> None:
    bob = fill(opened, tmp_path, key)
    if key is None:
        assert b"<alice-block-" in everything_under(tmp_path)  # what the wipe must remove
    assert list((tmp_path / "free").iterdir()) and list((tmp_path / "tmp").iterdir())
    report = wipe(tmp_path, "alice")
    assert (report.records, report.unreadable_records) == (6, 0)
    assert report.record_bytes == 6 * (4096 + round_up(20_000, 4096))
    assert (report.recyclable_files, report.temporary_files) == (2, 1)
    assert report.tombstones_dropped == 2
    assert report.overwritten_bytes == report.record_bytes + 2 * (4096 + 20480) + 5000
    on_disk = everything_under(tmp_path)
    assert b"<alice-block-" not in on_disk and b"alice|" not in on_disk
    assert list((tmp_path / "free").iterdir()) == [] == list((tmp_path / "tmp").iterdir())
    owners = {parse_header(p.read_bytes()).header.ns_id for p in tmp_path.glob("v1/*/*.kvr")}
    assert owners == {BOB}
    tier, recovered = reopen(opened, tmp_path, key)
    assert recovered.dropped_deleted == 1  # bob's tombstone survived the rewrite
    assert sorted(r.header.key for r in recovered.records) == sorted(bob)
    for rec in recovered.records:
        buf, offset = tier.read(rec.header)
        assert bytes(buf[offset : offset + rec.header.payload_bytes]) == bob[rec.header.key]


def test_wipe_refuses_while_a_daemon_holds_the_tier(
    opened: list[NvmeTier], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(opened, tmp_path, None)
    reopen(opened, tmp_path)  # the "daemon": holds <root>/.lock
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match="in use by a running kvtier daemon; stop it"):
        wipe(tmp_path, "alice")
    assert cli_main(["wipe", "--tenant", "alice", "--nvme-path", str(tmp_path)]) == 2
    assert "stop it first" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_wipe_cli_reports_json_and_can_wipe_every_tenant(
    opened: list[NvmeTier], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(opened, tmp_path, None)
    (tmp_path / "v1" / "00" / "garbage.1.kvr").write_bytes(b"not a record" * 1000)
    assert cli_main(["wipe", "--all", "--nvme-path", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tenant"] is None and out["records"] == 13  # 6 + 6 + bob's "gone"
    assert out["unreadable_records"] == 1 and out["tombstones_dropped"] == 3
    assert list(tmp_path.glob("v1/*/*")) == []
    assert (tmp_path / "tombstones.log").read_bytes() == b""
    _, recovered = reopen(opened, tmp_path)
    assert recovered.records == []


def test_wipe_names_the_tier_from_the_config(
    opened: list[NvmeTier], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "nvme"
    fill(opened, root, None)
    config = tmp_path / "kvtier.toml"
    config.write_text(f'[nvme]\npath = "{root}"\n')
    assert cli_main(["wipe", "--tenant", "bob", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "wiped 7 records" in out and "of tenant 'bob'" in out and str(root) in out
    _, recovered = reopen(opened, root)
    assert {r.header.ns_id for r in recovered.records} == {ALICE}
    assert cli_main(["wipe", "--tenant", "no such/tenant", "--config", str(config)]) == 2


def test_wipe_never_writes_through_links(tmp_path: Path, opened: list[NvmeTier]) -> None:
    """Links planted in the tier (wipe may run as root) are removed, their targets kept."""
    root = tmp_path / "nvme"
    fill(opened, root, None)
    outside = tmp_path / "precious"
    outside.write_bytes(b"keep me" * 100)
    os.symlink(outside, root / "free" / "4096.symlink")
    os.link(outside, root / "tmp" / "hardlink.tmp")
    os.symlink(outside, root / "v1" / "00" / "link.1.kvr")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x.kvr").write_bytes(b"other data")
    os.symlink(elsewhere, root / "v1" / "zz")
    wipe(root, "alice")
    assert outside.read_bytes() == b"keep me" * 100
    assert (elsewhere / "x.kvr").read_bytes() == b"other data"
    assert not (root / "free" / "4096.symlink").is_symlink()
    assert not (root / "tmp" / "hardlink.tmp").exists()


def test_wipe_of_a_directory_without_a_tier_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no NVMe tier"):
        wipe(tmp_path, "alice")
