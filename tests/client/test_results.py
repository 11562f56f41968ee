"""Reply messages parsed into the clients' typed results (kvtier/client/_results.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier.client._results import snapshot_of, stats_of


def stats_reply() -> pb.StatsResponse:
    return pb.StatsResponse(
        version="0.1.0",
        uptime_s=12.5,
        hits=7,
        misses=2,
        leases=1,
        recompute_avoided_s=0.25,
        policy="lru",
        nvme_direct_io=True,
        tiers=[
            pb.TierStats(name="dram", used_bytes=4096, capacity_bytes=1 << 20, blocks=1, hits=5),
            pb.TierStats(name="nvme", capacity_bytes=1 << 30, online=False, io_errors=3),
        ],
    )


def test_a_stats_reply_parses_into_typed_fields() -> None:
    stats = stats_of(stats_reply())
    assert isinstance(stats, kvtier.Stats)
    assert (stats.version, stats.uptime_s, stats.hits, stats.misses) == ("0.1.0", 12.5, 7, 2)
    assert stats.leases == 1 and stats.recompute_avoided_s == 0.25 and stats.policy == "lru"
    assert stats.nvme_direct_io is True and stats.puts == 0
    assert list(stats.tiers) == ["dram", "nvme"]
    assert stats.tiers["dram"] == kvtier.TierStats(
        used_bytes=4096,
        capacity_bytes=1 << 20,
        blocks=1,
        hits=5,
        evictions=0,
        online=False,
        io_errors=0,
    )
    assert stats.tiers["nvme"].io_errors == 3 and stats.tiers["nvme"].online is False


def test_stats_are_frozen() -> None:
    stats = stats_of(stats_reply())
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.hits = 0  # type: ignore[misc]


def test_stats_read_as_the_dict_they_used_to_be() -> None:
    stats = stats_of(stats_reply())
    assert stats["leases"] == 1
    assert stats["tiers"]["dram"]["used_bytes"] == 4096
    assert dict(stats["tiers"]["dram"])["capacity_bytes"] == 1 << 20
    assert {"used_bytes", "capacity_bytes"} <= set(stats["tiers"]["dram"])
    assert "hits" in stats and "nope" not in stats
    with pytest.raises(KeyError):
        stats["nope"]


def test_stats_as_json() -> None:
    doc = json.loads(json.dumps(dataclasses.asdict(stats_of(stats_reply()))))
    assert doc["tiers"]["nvme"]["io_errors"] == 3 and doc["version"] == "0.1.0"


def test_a_snapshot_joins_its_batches() -> None:
    first = pb.SnapshotResponse(
        epoch="e", seq=9, blocks=[pb.BlockInfo(namespace="n", key=b"a", tiers=[pb.TIER_DRAM])]
    )
    last = pb.SnapshotResponse(
        epoch="e", seq=9, blocks=[pb.BlockInfo(namespace="n", key=b"b", tiers=[])]
    )
    snap = snapshot_of([first, last])
    assert (snap.epoch, snap.seq) == ("e", 9)
    assert [(b.key, b.tiers) for b in snap.blocks] == [(b"a", ["dram"]), (b"b", [])]
    assert snapshot_of([]) == kvtier.Snapshot("", 0, [])
