"""Prometheus metrics, read from the store's counters at scrape time (nothing on the hot path)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.server.store import Store


class StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        s = self._store.stats()
        used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes held by a tier", labels=["tier"])
        cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Capacity of a tier", labels=["tier"])
        blocks = GaugeMetricFamily("kvtier_tier_blocks", "Blocks held by a tier", labels=["tier"])
        hits = CounterMetricFamily("kvtier_hits", "Gets served, by tier", labels=["tier"])
        evictions = CounterMetricFamily(
            "kvtier_evictions", "Blocks evicted from a tier", labels=["tier"]
        )
        for t in s.tiers:
            used.add_metric([t.name], t.used_bytes)
            cap.add_metric([t.name], t.capacity_bytes)
            blocks.add_metric([t.name], t.blocks)
            hits.add_metric([t.name], t.hits)
            evictions.add_metric([t.name], t.evictions)
        yield from (used, cap, blocks, hits, evictions)
        yield CounterMetricFamily("kvtier_misses", "Gets that found nothing", value=s.misses)
        yield CounterMetricFamily("kvtier_puts", "Blocks stored", value=s.puts)
        yield CounterMetricFamily(
            "kvtier_demotions", "Blocks moved DRAM -> NVMe", value=s.demotions
        )
        yield CounterMetricFamily(
            "kvtier_checksum_failures",
            "Stored records that failed verification (served as misses)",
            value=s.checksum_failures,
        )
        yield CounterMetricFamily(
            "kvtier_dropped_blocks", "Blocks evicted from every tier", value=s.dropped_blocks
        )
        yield GaugeMetricFamily("kvtier_leases", "Zero-copy leases held now", value=s.leases)
        yield CounterMetricFamily(
            "kvtier_promotions", "Blocks copied NVMe -> DRAM for leased gets", value=s.promotions
        )
        yield CounterMetricFamily(
            "kvtier_recompute_avoided_seconds",
            "Prefill seconds avoided by fetches a plan asked for (estimate)",
            value=s.recompute_avoided_s,
        )
        yield CounterMetricFamily(
            "kvtier_fetch_regret_seconds",
            "Seconds lost where a planned fetch took longer than recomputing would have",
            value=s.fetch_regret_s,
        )
        decisions = CounterMetricFamily(
            "kvtier_plan_blocks", "Blocks planned, by decision", labels=["decision"]
        )
        decisions.add_metric(["fetch"], s.planned_fetch_blocks)
        decisions.add_metric(["recompute"], s.planned_recompute_blocks)
        yield decisions
        yield from self._estimates()

    def _estimates(self) -> Iterator[Metric]:
        paths, prefill = self._store.estimates()
        bandwidth = GaugeMetricFamily(
            "kvtier_path_bandwidth_bytes_per_second",
            "Estimated bandwidth of a fetch path (dram: arena -> engine, nvme: record -> arena)",
            labels=["path"],
        )
        latency = GaugeMetricFamily(
            "kvtier_path_latency_seconds", "Estimated fixed cost of one fetch", labels=["path"]
        )
        for name, cost in paths.items():
            bandwidth.add_metric([name], cost.bandwidth_bytes_per_s)
            latency.add_metric([name], cost.latency_s)
        yield from (bandwidth, latency)
        a = GaugeMetricFamily(
            "kvtier_prefill_seconds_per_token",
            "Estimated linear prefill cost a (seconds per token)",
            labels=["tenant", "model"],
        )
        c = GaugeMetricFamily(
            "kvtier_prefill_attention_seconds_per_token2",
            "Estimated attention prefill cost c (seconds per token squared)",
            labels=["tenant", "model"],
        )
        for key, fit in prefill.items():
            tenant, _, model = key.partition("|")
            a.add_metric([tenant, model], fit.a_s_per_token)
            c.add_metric([tenant, model], fit.c_s_per_token2)
        yield from (a, c)
