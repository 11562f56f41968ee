"""`kvtier replay TRACE.jsonl`: the flags, the tables and the plots of the trace replay.

The simulators are kvtier/sim/: one node (`kvtier.sim.replay`) or a fleet of them behind a
router (`kvtier.sim.fleet`, with `--nodes`, `--routing` or `--remote`). This module picks
which one a command line asks for, so neither simulator has to know the other's flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kvtier.bench.plan_cli import parse_rate
from kvtier.errors import InvalidArgument
from kvtier.index.planner import OVERLAPS, PrefillCost, TierCost
from kvtier.index.policy import ADMISSIONS, POLICIES
from kvtier.profiles import MODELS
from kvtier.sim import fleet
from kvtier.sim.queue import QueueConfig, queue_replay, speedup_for_busy
from kvtier.sim.replay import ORACLE, ReplayConfig, Request, read_trace, replay
from kvtier.sim.transform import transform
from kvtier.sizes import human_size, parse_size


def _blocks(text: str, block_bytes: int) -> int:
    """A capacity as a block count ('5000') or a size ('320GiB')."""
    if text.strip().isdigit():
        return int(text)
    return parse_size(text) // block_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "trace", type=Path, help="Mooncake-format JSONL (timestamp, input_length, hash_ids)"
    )
    p.add_argument(
        "--dram-capacity",
        default="5000",
        help="blocks (5000) or a size (320GiB); several, comma-separated (5000,10000,20000), "
        "print every policy at each size side by side with its ratio to LRU and the oracle",
    )
    p.add_argument("--nvme-capacity", default="", help="blocks or a size; default 4x DRAM")
    p.add_argument(
        "--policy",
        action="append",
        choices=[*POLICIES, ORACLE, "all"],
        help="repeatable; default all: lru, s3fifo, kvtier and the oracle",
    )
    p.add_argument(
        "--transform",
        default="",
        metavar="SPEC",
        help="replay other traffic made from the trace: NAME:ARG,... (interleave:SEED, "
        "shift:SEED:SIGMA_S, gaps:FACTOR, speed:FACTOR, scale:FACTOR, sample:FRACTION:SEED, "
        "head:N; kvtier/sim/transform.py)",
    )
    p.add_argument("--admission", choices=ADMISSIONS, default="selective")
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    p.add_argument("--kv-bytes-per-token", type=int, help="overrides the model's")
    p.add_argument("--tokens-per-block", type=int, default=512)
    p.add_argument("--dram-bandwidth", default="50GB/s", help="DRAM -> engine, bytes/s")
    p.add_argument("--nvme-bandwidth", default="7GB/s", help="NVMe -> engine, bytes/s")
    p.add_argument("--dram-latency", type=float, default=10e-6, help="seconds per fetch")
    p.add_argument("--nvme-latency", type=float, default=100e-6, help="seconds per fetch")
    p.add_argument("--overlap", choices=OVERLAPS, default="none")
    p.add_argument("--gpu-hour-cost", type=float, default=2.0, help="USD per GPU-hour")
    p.add_argument("--json", action="store_true", help="one JSON object (a list for several)")
    p.add_argument("--plot", type=Path, help="PNG: hit ratio and tier occupancy over time")
    fleet = p.add_argument_group("fleet (--nodes > 1: capacities are per node)")
    fleet.add_argument("--nodes", type=int, default=1, help="simulated nodes, one engine each")
    fleet.add_argument(
        "--routing",
        action="append",
        choices=["sticky", "round-robin", "prefix-aware", "all"],
        help="repeatable; default all",
    )
    fleet.add_argument(
        "--ttft-slo", type=float, default=2.0, help="seconds; goodput = share of requests within"
    )
    fleet.add_argument(
        "--speedup", type=float, default=1.0, help="arrivals this many times faster (more load)"
    )
    fleet.add_argument(
        "--remote",
        default="",
        metavar="CAPACITY",
        help="a remote tier shared by every node behind its NVMe: blocks or a size (40000, "
        "2.5TiB); default none",
    )
    # Defaults of the same class as DRAM's and NVMe's: a GPU node's 100 Gb/s RDMA NIC (what
    # Mooncake Store's transfer engine is built for), at an effective 10 GB/s.
    fleet.add_argument("--remote-bandwidth", default="10GB/s", help="remote -> engine, bytes/s")
    fleet.add_argument("--remote-latency", type=float, default=50e-6, help="seconds per fetch")
    queue = p.add_argument_group("queue (one node behind one prefill server: TTFT)")
    queue.add_argument(
        "--queue", action="store_true", help="model the engine's queue; report TTFT p50/p99"
    )
    queue.add_argument(
        "--prefetch",
        action="store_true",
        help="implies --queue: waiting requests announce their chains, NVMe blocks are "
        "promoted and protected; reported next to prefetch off, same trace and capacities",
    )
    queue.add_argument(
        "--busy",
        type=float,
        default=0.0,
        help="pick the arrival speedup so the server is this busy with prefetch off "
        "(0.8: 80 %%); default: use --speedup",
    )
    queue.add_argument(
        "--hint-ttl", type=float, default=300.0, help="seconds an announced chain is protected"
    )


def configs(args: argparse.Namespace, dram_capacity: str | None = None) -> Iterator[ReplayConfig]:
    profile = MODELS[args.model]
    kv = args.kv_bytes_per_token or profile.kv_bytes_per_token
    block_bytes = args.tokens_per_block * kv
    dram = _blocks(dram_capacity or args.dram_capacity.split(",")[0], block_bytes)
    nvme = _blocks(args.nvme_capacity, block_bytes) if args.nvme_capacity else 4 * dram
    names: Iterable[str] = args.policy or ["all"]
    if "all" in names:
        names = [*POLICIES, ORACLE]
    for name in dict.fromkeys(names):
        yield ReplayConfig(
            dram_blocks=dram,
            nvme_blocks=nvme,
            policy=name,
            admission=args.admission,
            tokens_per_block=args.tokens_per_block,
            kv_bytes_per_token=kv,
            prefill=PrefillCost(profile.a_s_per_token, profile.c_s_per_token2),
            dram=TierCost(parse_rate(args.dram_bandwidth), args.dram_latency),
            nvme=TierCost(parse_rate(args.nvme_bandwidth), args.nvme_latency),
            remote=TierCost(parse_rate(args.remote_bandwidth), args.remote_latency),
            overlap=args.overlap,
            gpu_hour_usd=args.gpu_hour_cost,
        )


def plot(path: Path, runs: list[tuple[dict[str, Any], list[dict[str, float]]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for report, series in runs:
        xs = [p["t_s"] for p in series]
        top.plot(xs, [p["block_hit_ratio"] for p in series], label=report["policy"])
        bottom.plot(xs, [p["dram_blocks"] for p in series], label=f"{report['policy']} DRAM")
        bottom.plot(
            xs, [p["nvme_blocks"] for p in series], linestyle="--", label=f"{report['policy']} NVMe"
        )
    first = runs[0][0]
    top.set_ylabel("cumulative block hit ratio")
    top.set_title(
        f"replay: DRAM {first['dram_blocks']} blocks, NVMe {first['nvme_blocks']} blocks "
        f"({human_size(first['block_bytes'])} each)"
    )
    top.legend()
    bottom.set_ylabel("blocks held")
    bottom.set_xlabel("trace time (s)")
    bottom.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_fleet(path: Path, runs: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> None:
    """Per-node utilization over time, one panel per routing policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), sharex=True)
    for ax, (report, series) in zip([axes] if len(runs) == 1 else axes, runs, strict=True):
        xs = [p["t_s"] for p in series]
        for node in range(report["nodes"]):
            ax.plot(xs, [p["busy"][node] for p in series], label=f"node {node}", linewidth=1)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("busy")
        remote = " + remote" if report.get("remote") else ""
        ax.set_title(
            f"{report['routing']}{remote}: goodput {report['goodput']:.1%} "
            f"(TTFT <= {report['ttft_slo_s']:g} s), load max/mean "
            f"{report['load_max_over_mean']:.2f}",
            fontsize="medium",
        )
    ax.set_xlabel("time (s)")
    ax.legend(fontsize="small", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _printed_json(args: argparse.Namespace, reports: list[dict[str, Any]]) -> bool:
    """With --json: print the reports (one object, or a list for several) and say so."""
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
    return bool(args.json)


def _plotting_missing() -> str | None:
    """Why --plot cannot work here, or None; asked before a replay that may run minutes."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(in a checkout: pip install -e '.[bench]'), or leave out --plot"
        )
    return None


def main(args: argparse.Namespace) -> int:
    if args.plot and (why := _plotting_missing()):
        print(f"kvtier replay: {why}", file=sys.stderr)
        return 2
    try:
        requests = read_trace(args.trace)
        if args.transform:
            requests = transform(requests, args.transform)
        sizes = [c.strip() for c in args.dram_capacity.split(",") if c.strip()]
        if not sizes:
            raise ValueError("--dram-capacity: give at least one size")
        for size in sizes:
            _blocks(size, 1)
    except (OSError, ValueError, InvalidArgument) as err:
        print(f"kvtier replay: {err}", file=sys.stderr)
        return 2
    if not requests:
        print("kvtier replay: no requests left to replay", file=sys.stderr)
        return 2
    if args.nodes > 1 or args.routing or args.remote:
        return fleet_main(args, requests)
    if args.queue or args.prefetch:
        return queue_main(args, requests)  # at the first --dram-capacity size
    if len(sizes) > 1:
        return sizes_main(args, requests, sizes)
    runs = [replay(cfg, requests) for cfg in configs(args)]
    if args.plot:
        plot(args.plot, runs)
    reports = [r for r, _ in runs]
    if _printed_json(args, reports):
        return 0
    print(
        f"{len(requests)} requests, {reports[0]['block_refs']} block references; DRAM "
        f"{reports[0]['dram_blocks']} blocks, NVMe {reports[0]['nvme_blocks']} blocks of "
        f"{human_size(reports[0]['block_bytes'])}"
    )
    header = (
        f"{'policy':<8} {'hit ratio':>9} {'dram hits':>10} {'nvme hits':>10} "
        f"{'saved (s)':>10} {'regret (s)':>10} {'lost reuse':>10} {'NVMe written':>13} "
        f"{'WA':>5} {'USD':>8}"
    )
    print(header)
    for r in reports:
        print(
            f"{r['policy']:<8} {r['block_hit_ratio']:>9.1%} {r['tiers']['dram']['hits']:>10} "
            f"{r['tiers']['nvme']['hits']:>10} {r['prefill_seconds_saved']:>10.1f} "
            f"{r['fetch_regret_seconds']:>10.2f} {r['lost_reuse']:>10} "
            f"{human_size(r['nvme_bytes_written']):>13} {_wa(r):>5} {r['usd_saved']:>8.2f}"
        )
    print(
        'WA: write amplification of nvme.layout = "segments" (bytes written to the '
        "segments per byte admitted, reclaim's copies included)"
    )
    return 0


def _wa(report: dict[str, Any]) -> str:
    wa = report.get("nvme_write_amplification")
    return "-" if wa is None else f"{wa:.2f}"


def sizes_main(args: argparse.Namespace, requests: list[Request], sizes: list[str]) -> int:
    """Every policy at every DRAM size: prefill seconds saved, × LRU and × the oracle."""
    if args.plot:
        print("kvtier replay: --plot takes one --dram-capacity", file=sys.stderr)
        return 2
    reports = [replay(cfg, requests)[0] for size in sizes for cfg in configs(args, size)]
    if _printed_json(args, reports):
        return 0
    print(
        f"{len(requests)} requests, {reports[0]['block_refs']} block references"
        f"{' (transformed: ' + args.transform + ')' if args.transform else ''}; blocks of "
        f"{human_size(reports[0]['block_bytes'])}, NVMe "
        f"{'as given' if args.nvme_capacity else '4x DRAM'}, admission {args.admission}"
    )
    print(
        f"{'DRAM':>8} {'policy':<8} {'hit ratio':>9} {'dram hits':>10} {'nvme hits':>10} "
        f"{'saved (s)':>10} {'x LRU':>7} {'x oracle':>8}"
    )
    for size in dict.fromkeys(r["dram_blocks"] for r in reports):
        row = [r for r in reports if r["dram_blocks"] == size]
        base = {r["policy"]: r["prefill_seconds_saved"] for r in row}
        for r in row:
            saved = r["prefill_seconds_saved"]
            vs_lru = f"{saved / base['lru']:.3f}" if base.get("lru") else "-"
            vs_oracle = f"{saved / base[ORACLE]:.3f}" if base.get(ORACLE) else "-"
            print(
                f"{size:>8} {r['policy']:<8} {r['block_hit_ratio']:>9.1%} "
                f"{r['tiers']['dram']['hits']:>10} {r['tiers']['nvme']['hits']:>10} "
                f"{saved:>10.1f} {vs_lru:>7} {vs_oracle:>8}"
            )
    return 0


def fleet_main(args: argparse.Namespace, requests: list[Request]) -> int:
    if args.nodes < 1 or args.speedup <= 0 or args.ttft_slo <= 0:
        print("kvtier replay: --nodes, --speedup and --ttft-slo must be > 0", file=sys.stderr)
        return 2
    policies = [p for p in (args.policy or ["kvtier"]) if p != "all"] or ["kvtier"]
    if ORACLE in policies:
        print("kvtier replay: the oracle policy cannot run in a fleet", file=sys.stderr)
        return 2
    args.policy = policies[:1]
    node_config = next(configs(args))
    try:
        remote_blocks = _blocks(args.remote, node_config.block_bytes) if args.remote else 0
    except ValueError as err:
        print(f"kvtier replay: --remote: {err}", file=sys.stderr)
        return 2
    routings = args.routing or ["all"]
    names = list(fleet.ROUTINGS) if "all" in routings else list(dict.fromkeys(routings))
    runs = [
        fleet.fleet_replay(
            node_config,
            fleet.FleetConfig(
                args.nodes, name, args.ttft_slo, args.speedup, remote_blocks=remote_blocks
            ),
            requests,
        )
        for name in names
    ]
    if args.plot:
        plot_fleet(args.plot, runs)
    reports = [r for r, _ in runs]
    if _printed_json(args, reports):
        return 0
    print(
        f"{len(requests)} requests over {args.nodes} nodes (arrivals x{args.speedup:g}), each "
        f"DRAM {node_config.dram_blocks} + NVMe {node_config.nvme_blocks} blocks, policy "
        f"{node_config.policy}; SLO: TTFT <= {args.ttft_slo:g} s"
    )
    if remote_blocks:
        cost = node_config.remote
        print(
            f"shared remote tier: {remote_blocks} blocks, "
            f"{cost.bandwidth_bytes_per_s / 1e9:g} GB/s + {cost.latency_s * 1e6:g} us "
            f"per block ({cost.fetch_s(node_config.block_bytes) * 1e3:.1f} ms a block)"
        )
    print(
        f"{'routing':<13} {'goodput':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'hit ratio':>9} "
        f"{'saved (s)':>10} {'load max/mean':>13} {'remote hits':>11}"
    )
    for r in reports:
        print(
            f"{r['routing']:<13} {r['goodput']:>8.1%} {r['ttft_p50_s']:>8.2f}s "
            f"{r['ttft_p99_s']:>8.2f}s {r['block_hit_ratio']:>9.1%} "
            f"{r['prefill_seconds_saved']:>10.0f} {r['load_max_over_mean']:>13.2f} "
            f"{r['remote']['hits'] if r['remote'] else '-':>11}"
        )
    return 0


def queue_main(args: argparse.Namespace, requests: list[Request]) -> int:
    """One node behind a FIFO prefill server: TTFT and prefill saved, prefetch off (and on)."""
    if args.busy < 0 or args.speedup <= 0 or args.hint_ttl <= 0:
        print("kvtier replay: --busy must be >= 0, --speedup and --hint-ttl > 0", file=sys.stderr)
        return 2
    if args.plot:
        print("kvtier replay: --plot is not drawn for --queue", file=sys.stderr)
        return 2
    args.policy = [p for p in (args.policy or ["kvtier"]) if p != "all"] or ["kvtier"]
    reports = []
    for cfg in configs(args):
        speedup = speedup_for_busy(cfg, requests, args.busy) if args.busy else args.speedup
        for prefetch in (False, True) if args.prefetch else (False,):
            queue = QueueConfig(speedup=speedup, prefetch=prefetch, hint_ttl_s=args.hint_ttl)
            reports.append(queue_replay(cfg, queue, requests))
    if _printed_json(args, reports):
        return 0
    first = reports[0]
    print(
        f"{len(requests)} requests, one prefill server; DRAM {first['dram_blocks']} blocks, "
        f"NVMe {first['nvme_blocks']} blocks of {human_size(first['block_bytes'])}; "
        f"a promotion {first['promotion_s_per_block'] * 1e3:.1f} ms a block"
    )
    print(
        f"{'policy':<8} {'prefetch':>8} {'speedup':>8} {'busy':>6} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'saved (s)':>10} {'dram hits':>10} {'nvme hits':>10} "
        f"{'prefetched':>10} {'used':>8}"
    )
    for r in reports:
        print(
            f"{r['policy']:<8} {'on' if r['prefetch'] else 'off':>8} {r['speedup']:>8.3f} "
            f"{r['server_busy']:>6.1%} {r['ttft_p50_s']:>8.2f}s {r['ttft_p99_s']:>8.2f}s "
            f"{r['prefill_seconds_saved']:>10.1f} {r['tiers']['dram']['hits']:>10} "
            f"{r['tiers']['nvme']['hits']:>10} {r['prefetched_blocks']:>10} "
            f"{r['prefetched_used']:>8}"
        )
    return 0
