"""The Prometheus endpoint of a real daemon, scraped over HTTP after a short workload."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvtier
from tests.conftest import DaemonProcess, block_bytes, free_port

StartDaemon = Callable[..., DaemonProcess]
NS = "llama3-8b/metrics"
# Every label a kvtier metric may carry: bounded sets, never a key or a request id.
ALLOWED_LABELS = {
    "tier",
    "src",
    "dst",
    "reason",
    "decision",
    "path",
    "method",
    "code",
    "tenant",
    "model",
}


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


def metric_value(
    metrics: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str
) -> float:
    want = tuple(sorted(labels.items()))
    samples = metrics[name]
    return sum(v for k, v in samples.items() if all(item in k for item in want))


def test_every_design_metric_is_exported_with_sensible_values(start_daemon: StartDaemon) -> None:
    port = free_port()
    daemon = start_daemon(dram="4MiB", nvme="6MiB", extra=["--metrics-listen", f"127.0.0.1:{port}"])
    size = 1 << 20
    keys = [f"secret-key-{i}".encode() for i in range(12)]
    with daemon.client() as client:
        for i, key in enumerate(keys):  # 12 MiB through 4 MiB of DRAM and 6 MiB of NVMe
            client.put(NS, key, block_bytes(i, size))
        stored = client.lookup(NS, keys).tiers
        assert None in stored and "nvme" in stored and "dram" in stored
        assert stored[-1] == "dram" and client.get(NS, keys[-1]) == block_bytes(11, size)
        sink = bytearray(size)
        served = 0
        for i, (key, tier) in enumerate(zip(keys, stored, strict=True)):
            # Promotions evict as they go, so a block listed above may be gone by now.
            if tier is not None and client.get_into(NS, key, sink) is not None:
                assert bytes(sink) == block_bytes(i, size)
                served += 1
        assert served >= 4
        nvme_key = next(
            k for k, t in zip(keys, client.lookup(NS, keys).tiers, strict=True) if t == "nvme"
        )
        client.get(NS, nvme_key)
        lost = [k for k, t in zip(keys, stored, strict=True) if t is None]
        assert all(client.get(NS, k) is None for k in lost)  # evicted earlier: lost reuse
        client.plan(NS, keys, 8)
        with pytest.raises(kvtier.InvalidArgument):
            client.get(NS, b"x" * 1000)
        stats = client.stats()
    m = scrape(port)
    for name in ("dram", "nvme"):
        assert metric_value(m, "kvtier_tier_capacity_bytes", tier=name) > 0
        assert metric_value(m, "kvtier_tier_used_bytes", tier=name) > 0
        assert metric_value(m, "kvtier_tier_blocks", tier=name) > 0
        assert metric_value(m, "kvtier_hits_total", tier=name) > 0
    assert metric_value(m, "kvtier_tier_used_bytes", tier="dram") <= 4 << 20
    assert metric_value(m, "kvtier_misses_total") >= len(lost)
    assert metric_value(m, "kvtier_lost_reuse_total") == stats["lost_reuse"] >= len(lost)
    assert metric_value(m, "kvtier_evictions_by_reason_total", tier="dram", reason="demoted") > 0
    assert metric_value(m, "kvtier_evictions_by_reason_total", tier="nvme", reason="capacity") > 0
    assert metric_value(m, "kvtier_nvme_admissions_total", decision="written") > 0
    assert metric_value(m, "kvtier_promotions_total") > 0
    assert metric_value(m, "kvtier_checksum_failures_total") == 0
    for src, dst in (("dram", "nvme"), ("nvme", "dram"), ("nvme", "client"), ("dram", "engine")):
        assert metric_value(m, "kvtier_transfer_seconds_count", src=src, dst=dst) > 0, (src, dst)
        assert metric_value(m, "kvtier_transfer_seconds_sum", src=src, dst=dst) > 0
        assert metric_value(m, "kvtier_transfer_bytes_total", src=src, dst=dst) >= size
    assert metric_value(m, "kvtier_requests_total", method="PutBlock", code="OK") == len(keys)
    assert metric_value(m, "kvtier_requests_total", method="GetBlock", code="INVALID_ARGUMENT") == 1
    assert metric_value(m, "kvtier_requests_total", method="GetBlock", code="NOT_FOUND") == len(
        lost
    )
    assert metric_value(m, "kvtier_requests_total", method="session/ACQUIRE", code="OK") > 0
    assert metric_value(m, "kvtier_recompute_avoided_seconds_total") >= 0
    assert metric_value(m, "kvtier_fetch_regret_seconds_total") >= 0
    assert metric_value(m, "kvtier_plan_blocks_total", decision="fetch") + metric_value(
        m, "kvtier_plan_blocks_total", decision="recompute"
    ) == len(keys)
    for name, samples in m.items():
        for labels in samples:
            names = {k for k, _ in labels} - {"le"}
            assert names <= ALLOWED_LABELS, (name, names)
            assert not any(b"secret-key" in v.encode() for _, v in labels), name
