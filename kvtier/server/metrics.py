"""Prometheus metrics, read from the store's counters at scrape time (nothing on the hot path)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvtier.engine.nvme import SegmentCounters
from kvtier.engine.store import Store
from kvtier.server import looplag
from kvtier.server.arena_socket import SideSocketCounters


class StoreCollector(Collector):
    def __init__(self, store: Store, side_socket: SideSocketCounters | None = None) -> None:
        self._store = store
        self._side_socket = side_socket  # the zero-copy socket's, where the daemon has one

    def collect(self) -> Iterator[Metric]:
        s = self._store.stats()
        used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes held by a tier", labels=["tier"])
        cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Capacity of a tier", labels=["tier"])
        blocks = GaugeMetricFamily("kvtier_tier_blocks", "Blocks held by a tier", labels=["tier"])
        hits = CounterMetricFamily("kvtier_hits", "Gets served, by tier", labels=["tier"])
        evictions = CounterMetricFamily(
            "kvtier_evictions", "Blocks evicted from a tier", labels=["tier"]
        )
        online = GaugeMetricFamily(
            "kvtier_tier_online",
            "1 while a tier is in use, 0 while offline after repeated I/O errors",
            labels=["tier"],
        )
        io_errors = CounterMetricFamily(
            "kvtier_tier_io_errors", "I/O errors a tier returned", labels=["tier"]
        )
        for t in s.tiers:
            online.add_metric([t.name], 1.0 if t.online else 0.0)
            io_errors.add_metric([t.name], t.io_errors)
            used.add_metric([t.name], t.used_bytes)
            cap.add_metric([t.name], t.capacity_bytes)
            blocks.add_metric([t.name], t.blocks)
            hits.add_metric([t.name], t.hits)
            evictions.add_metric([t.name], t.evictions)
        yield from (used, cap, blocks, hits, evictions, online, io_errors)
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
        if self._store.nvme is not None:
            yield CounterMetricFamily(
                "kvtier_nvme_refused_files",
                "Files in the NVMe tier refused and removed for not being regular files "
                "(symbolic links, FIFOs, sockets, devices, extra hard links): never opened "
                "blocking, never written through",
                value=self._store.nvme.refused_files,
            )
            yield from _segment_metrics(self._store.nvme.segment_counters())
        yield GaugeMetricFamily("kvtier_leases", "Zero-copy leases held now", value=s.leases)
        yield CounterMetricFamily(
            "kvtier_remote_puts", "Blocks this node put into the remote tier", value=s.remote_puts
        )
        yield CounterMetricFamily(
            "kvtier_remote_fetches",
            "Blocks fetched from the remote tier (verified) into DRAM",
            value=s.remote_fetches,
        )
        yield CounterMetricFamily(
            "kvtier_promotions", "Blocks copied NVMe -> DRAM for leased gets", value=s.promotions
        )
        prefetch = self._store.prefetch.counters
        for name, doc, value in (
            (
                "announced",
                "announced by engines for requests waiting in their queue",
                prefetch.announced_blocks,
            ),
            ("promoted", "prefetched into DRAM for a waiting request", prefetch.prefetched),
            ("used", "prefetched and then loaded by the request", prefetch.used),
            ("expired", "prefetched and never loaded before their hints ended", prefetch.expired),
        ):
            yield CounterMetricFamily(
                f"kvtier_prefetch_{name}_blocks", f"Queue prefetch: blocks {doc}", value=value
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
        yield CounterMetricFamily(
            "kvtier_lost_reuse",
            "Misses on blocks evicted from every tier shortly before (reuse lost to eviction)",
            value=s.lost_reuse,
        )
        admissions = CounterMetricFamily(
            "kvtier_nvme_admissions",
            "Blocks leaving DRAM, by whether admission wrote them to NVMe",
            labels=["decision"],
        )
        admissions.add_metric(["written"], s.admitted)
        admissions.add_metric(["skipped"], s.not_admitted)
        yield admissions
        reasons = CounterMetricFamily(
            "kvtier_evictions_by_reason",
            "Copies evicted from a tier: demoted (kept on NVMe), dropped (gone from every "
            "tier), capacity (NVMe record removed for room), corrupt (failed verification)",
            labels=["tier", "reason"],
        )
        for (tier, reason), n in sorted(s.eviction_reasons.items()):
            reasons.add_metric([tier, reason], n)
        yield reasons
        yield from self._transfers()
        yield from self._estimates()
        yield from loop_lag_metrics(looplag.running())
        if self._side_socket is not None:
            yield from _side_socket(self._side_socket)

    def _transfers(self) -> Iterator[Metric]:
        t = self._store.telemetry
        seconds = HistogramMetricFamily(
            "kvtier_transfer_seconds",
            "Time to move one block (or one leased batch, dram -> engine) along a path",
            labels=["src", "dst"],
        )
        moved = CounterMetricFamily(
            "kvtier_transfer_bytes", "Bytes moved along a path", labels=["src", "dst"]
        )
        for (src, dst), hist in sorted(t.transfer_seconds.items()):
            seconds.add_metric([src, dst], hist.cumulative(), hist.sum_s)
            moved.add_metric([src, dst], t.transfer_bytes[src, dst])
        yield from (seconds, moved)
        handled = CounterMetricFamily(
            "kvtier_requests",
            "Requests answered, by method (gRPC, or session/<op> on the zero-copy socket) "
            "and status code",
            labels=["method", "code"],
        )
        for (method, code), n in sorted(t.requests.items()):
            handled.add_metric([method, code], n)
        yield handled

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


def loop_lag_metrics(lag: looplag.LoopLag | None) -> Iterator[Metric]:
    """The event-loop probe's record (kvtier/server/looplag.py); nothing if none runs."""
    if lag is None:
        return
    yield GaugeMetricFamily(
        "kvtier_event_loop_stall_max_seconds",
        "Longest time between two wake-ups of the event-loop probe since start: an upper "
        f"bound on the longest stall ({lag.interval_s * 1e3:g} ms coarse; idle reads about that)",
        value=lag.read().stall_max_s,
    )
    hist = HistogramMetricFamily(
        "kvtier_event_loop_lag_seconds",
        "How late each wake-up of the event-loop probe was (about 0 while nothing stalls the loop)",
    )
    hist.add_metric([], lag.lateness.cumulative(), lag.lateness.sum_s)
    yield hist


def _side_socket(c: SideSocketCounters) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "kvtier_session_socket_accepting",
        "1 while the zero-copy socket accepts connections (0: its accept loop ended)",
        value=1.0 if c.accepting else 0.0,
    )
    yield CounterMetricFamily(
        "kvtier_session_socket_accept_errors",
        "Failed accepts on the zero-copy socket (out of fds or memory), each retried",
        value=c.accept_errors,
    )
    yield CounterMetricFamily(
        "kvtier_session_socket_handshakes_shed",
        "Connections closed before presenting a nonce: too many were waiting for one",
        value=c.handshakes_shed,
    )
    yield CounterMetricFamily(
        "kvtier_session_socket_sessions_refused",
        "Attach calls refused: the tenant held limits.max_sessions_per_tenant",
        value=c.sessions_refused,
    )
    yield GaugeMetricFamily(
        "kvtier_session_socket_sessions", "Zero-copy sessions attached now", value=c.sessions
    )
    yield GaugeMetricFamily(
        "kvtier_session_socket_sessions_paused",
        "Sessions not being read now: their queued requests and unread replies exceed "
        "limits.session_buffer_bytes",
        value=c.sessions_paused,
    )
    yield CounterMetricFamily(
        "kvtier_session_socket_read_pauses",
        "Times a session's reading was paused for its buffer",
        value=c.read_pauses,
    )
    yield CounterMetricFamily(
        "kvtier_session_socket_poll_seconds",
        "Seconds the event loop polled after session replies instead of sleeping "
        "(server.poll_after_reply_s): at most this much CPU",
        value=c.poll_s,
    )
    yield CounterMetricFamily(
        "kvtier_session_socket_oversize_requests",
        "Session requests over their op's size cap (refused, or the session ended)",
        value=c.oversize_requests,
    )


def _segment_metrics(counters: SegmentCounters | None) -> Iterator[Metric]:
    """The segment layout's appends and reclaim (nothing for the file layout): what its
    write amplification costs the drive, and whether reclaim keeps up."""
    if counters is None:
        return
    yield CounterMetricFamily(
        "kvtier_nvme_written_bytes",
        "Record bytes appended to the NVMe segments by demotion, write-through and flush",
        value=counters.written_bytes,
    )
    yield CounterMetricFamily(
        "kvtier_nvme_relocated_bytes",
        "Live record bytes reclaim copied out of segments it was freeing",
        value=counters.relocated_bytes,
    )
    yield CounterMetricFamily(
        "kvtier_nvme_reclaimed_segments",
        "Segments reclaim emptied and deleted",
        value=counters.reclaimed_segments,
    )
    yield GaugeMetricFamily(
        "kvtier_nvme_write_amplification",
        "Bytes appended to the segments per record byte written, since start: "
        "(written + relocated) / written; 1 while reclaim has moved nothing",
        value=counters.write_amplification,
    )
    yield GaugeMetricFamily(
        "kvtier_nvme_segment_files_bytes",
        "Bytes of segment files on disk: at most the tier's capacity, and a segment more "
        "while reclaim copies",
        value=counters.allocated_bytes,
    )
