"""The event-loop stall probe (kvtier/server/looplag.py): a deliberate stall is measured at
least as long as it was, an idle loop reads small, and the daemon exports both."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.server import looplag
from kvtier.server.looplag import LoopLag
from kvtier.server.metrics import loop_lag_metrics
from tests.conftest import DaemonProcess, free_port

StartDaemon = Callable[..., DaemonProcess]
INTERVAL_S = 0.005


async def _wakeups(lag: LoopLag, n: int) -> None:
    """Until the probe has woken `n` more times (a wait-for, not a guess at timing)."""
    want = lag.read().wakeups + n
    deadline = time.monotonic() + 10
    while lag.read().wakeups < want:
        assert time.monotonic() < deadline, "the probe stopped waking up"
        await asyncio.sleep(INTERVAL_S / 2)


def test_observe_keeps_the_longest_gap_since_start_and_since_the_last_read() -> None:
    lag = LoopLag(INTERVAL_S)
    for gap_s in (0.005, 0.25, 0.006):
        lag.observe(gap_s)
    assert lag.read(reset_recent=True) == looplag.LagReading(0.25, 0.25, 3)
    lag.observe(0.04)
    assert lag.read() == looplag.LagReading(0.25, 0.04, 4)
    # The histogram holds lateness: gap minus the interval, never negative.
    assert lag.lateness.count == 4
    assert lag.lateness.sum_s == pytest.approx(0.245 + 0.001 + 0.035)


@pytest.mark.parametrize("stall_s", [0.15, 0.3])
async def test_a_blocking_call_is_measured_at_least_as_long_as_it_was(stall_s: float) -> None:
    lag = LoopLag(INTERVAL_S)
    lag.start()
    try:
        await _wakeups(lag, 3)
        lag.read(reset_recent=True)
        started = time.monotonic()
        time.sleep(stall_s)  # noqa: ASYNC251 - the stall under test
        blocked_s = time.monotonic() - started
        await _wakeups(lag, 2)
        reading = lag.read()
        assert reading.recent_stall_max_s >= blocked_s >= stall_s
        assert reading.stall_max_s >= reading.recent_stall_max_s
        # ... and not wildly longer: the probe's error is about one interval (the margin
        # is for a busy shared machine descheduling the test).
        assert reading.recent_stall_max_s < blocked_s + 0.25
    finally:
        lag.stop()


async def test_an_idle_loop_reads_small() -> None:
    lag = LoopLag(INTERVAL_S)
    lag.start()
    try:
        await _wakeups(lag, 3)
        lag.read(reset_recent=True)
        await _wakeups(lag, 40)
        # About the interval; generous for a shared 2-core machine.
        assert INTERVAL_S <= lag.read().recent_stall_max_s < 0.1
    finally:
        lag.stop()


def test_metrics_export_the_longest_stall_and_the_lateness_histogram() -> None:
    lag = LoopLag(INTERVAL_S)
    for gap_s in (0.005, 0.02, 0.2):
        lag.observe(gap_s)
    families = {f.name: f for f in loop_lag_metrics(lag)}
    assert families["kvtier_event_loop_stall_max_seconds"].samples[0].value == 0.2
    samples = {
        (s.name, s.labels.get("le")): s.value
        for s in families["kvtier_event_loop_lag_seconds"].samples
    }
    assert samples["kvtier_event_loop_lag_seconds_count", None] == 3
    assert samples["kvtier_event_loop_lag_seconds_bucket", "0.025"] == 2  # 0 and 0.015 late
    assert samples["kvtier_event_loop_lag_seconds_bucket", "0.1"] == 2
    assert samples["kvtier_event_loop_lag_seconds_bucket", "0.25"] == 3
    assert list(loop_lag_metrics(None)) == []


def test_the_daemon_reports_stalls_in_stats_and_on_the_metrics_endpoint(
    start_daemon: StartDaemon,
) -> None:
    port = free_port()
    daemon = start_daemon(
        dram="8MiB", nvme="16MiB", extra=["--metrics-listen", f"127.0.0.1:{port}"]
    )
    with daemon.client() as client:
        first = client.stats()
        second = client.stats()
    # Start-up work (calibration, recovery) is measured: a stall of at least the interval.
    assert INTERVAL_S <= first.event_loop_stall_max_s < 60
    assert first.event_loop_stall_recent_max_s == first.event_loop_stall_max_s
    assert second.event_loop_stall_max_s >= first.event_loop_stall_max_s
    assert second.event_loop_stall_recent_max_s <= second.event_loop_stall_max_s
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }
    assert values["kvtier_event_loop_stall_max_seconds"] >= second.event_loop_stall_max_s
    assert values["kvtier_event_loop_lag_seconds_count"] > 0
