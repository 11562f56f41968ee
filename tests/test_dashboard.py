"""deploy/grafana/kvtier.json queries only what a real daemon exports.

Every PromQL expression in the dashboard (panel targets, the node variable's query) is
parsed by a real PromQL parser after Grafana's variables are put in; each selector's
metric must be a series a daemon's /metrics serves after a short workload, each label it
matches on or groups by must be one of that metric's labels (or one Prometheus adds).
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import DaemonProcess, block_bytes, free_port

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtier.json"
NS = "llama3-8b/dashboard"
# What Prometheus attaches to every scraped series, and histogram buckets' bound.
SCRAPE_LABELS = {"instance", "job"}
# Grafana's variables, as a query at 5-minute resolution over 6 hours would see them.
VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "6h",
    "$instance": ".*",
}
StartDaemon = Callable[..., DaemonProcess]


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in _panels(dash["panels"]) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        # label_values(METRIC_SELECTOR, label) is Grafana's, not PromQL: its selector is.
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match, f"variable {var['name']}: unexpected query {query!r}"
        exprs.append(f"count by ({match.group(2)}) ({match.group(1)})")
    return exprs


def _substitute(expr: str) -> str:
    for name, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
    return expr


def referenced(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """(metric -> labels its selectors match on, labels the expression groups by)."""
    metrics: dict[str, set[str]] = {}
    grouping: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.MatrixSelector):
            node = node.vector_selector
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            labels = {m.name for m in node.matchers.matchers} - {"__name__"}
            metrics.setdefault(node.name, set()).update(labels)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None:
                grouping.update(matching.labels)

    promql_parser.walk(promql_parser.parse(_substitute(expr)), pre_visit=visit)
    return metrics, grouping


def exported(port: int) -> dict[str, set[str]]:
    """Series names /metrics serves (a histogram's _bucket, _sum and _count, a counter's
    _total) -> the label names they carry."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_the_parser_finds_metrics_not_functions_labels_or_durations() -> None:
    # The extraction itself: functions, label names and values, durations and numbers are
    # not metrics; histogram suffixes stay on the name they are served under.
    metrics, grouping = referenced(
        'histogram_quantile(0.99, sum by (le, src) (rate(a_seconds_bucket{tier=~"$instance"}'
        "[$__rate_interval]))) / ignoring(dst) group_left sum(b_total offset 5m) > bool 2"
    )
    assert metrics == {"a_seconds_bucket": {"tier"}, "b_total": set()}
    assert grouping == {"le", "src", "dst"}


def test_dashboard_queries_are_valid_promql() -> None:
    queries = dashboard_queries()
    assert len(queries) >= 10
    for expr in queries:
        referenced(expr)  # raises on a syntax error


@pytest.fixture
def metrics_port(start_daemon: StartDaemon) -> int:
    """A daemon after a workload that leaves every series the dashboard draws non-empty:
    evictions to NVMe and past it, NVMe hits and promotions, zero-copy reads, a plan."""
    port = free_port()
    daemon = start_daemon(dram="4MiB", nvme="6MiB", extra=["--metrics-listen", f"127.0.0.1:{port}"])
    size = 1 << 20
    keys = [f"block-{i}".encode() for i in range(12)]
    with daemon.client() as client:
        for i, key in enumerate(keys):  # 12 MiB through 4 MiB of DRAM and 6 MiB of NVMe
            client.put(NS, key, block_bytes(i, size))
        sink = bytearray(size)
        for key, tier in zip(keys, client.lookup(NS, keys).tiers, strict=True):
            if tier is not None:
                client.get_into(NS, key, sink)
        for key, tier in zip(keys, client.lookup(NS, keys).tiers, strict=True):
            if tier == "nvme":
                client.get(NS, key)
        assert client.get(NS, keys[0]) is None  # gone from every tier: lost reuse
        client.plan(NS, keys, 8)
    return port


def test_every_metric_the_dashboard_queries_is_exported(metrics_port: int) -> None:
    served = exported(metrics_port)
    assert "kvtier_transfer_seconds_bucket" in served  # the workload reached the histograms
    missing: list[str] = []
    bad_labels: list[str] = []
    for expr in dashboard_queries():
        metrics, grouping = referenced(expr)
        for name, labels in metrics.items():
            if name not in served:
                missing.append(f"{name} (in {expr})")
            elif unknown := labels - served[name] - SCRAPE_LABELS:
                bad_labels.append(f"{name}{sorted(unknown)} (in {expr})")
        known = set().union(*(served.get(n, set()) for n in metrics)) | SCRAPE_LABELS
        if unknown := grouping - known:
            bad_labels.append(f"by/on {sorted(unknown)} (in {expr})")
    assert missing == [], "the dashboard queries series the daemon does not export"
    assert bad_labels == [], "the dashboard uses labels those series do not have"
