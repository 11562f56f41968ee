"""Same-run A/B of the gRPC byte path (`Client.put` / `Client.get`, what a client without
the shared arena uses) against a git revision and against Redis, round by round.

    python benchmarks/grpc_bytes.py --baseline-rev main [--sizes 1MiB,4MiB] [--rounds 5]
        [--pool 128MiB] [--transport tcp|uds] [--json out.json]

Three worker processes, each started once and then asked for one round at a time, taking
turns in a rotating order: this checkout's client and daemon, the baseline revision's
client and daemon (each its own `kvtier serve`, started by that tree's
`kvtier.bench.daemon`), and redis-py (+hiredis) against a loopback `redis-server`
without persistence. Each worker is its own process, so each runs with its own
allocator settings, as a real program would. A round puts a pool of distinct random
blocks (larger than the L3 cache), then gets each back and compares it with what was put
(a difference voids the run), then deletes them. Figures: GB/s per pass (median over
rounds), per-call p50 / p99 (over every call of every round), and the CPU per call of the
client and of the daemon (redis-server for Redis).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _daemon import baseline_tree

ROOT = Path(__file__).resolve().parent.parent

# One worker: a line "SIZE_BYTES" on stdin -> one JSON line of that round's figures.
_WORKER = r"""
import contextlib, json, os, sys, tempfile, time, uuid
from pathlib import Path
import psutil

kind, pool_bytes, sizes, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
pools = {int(s): [os.urandom(int(s)) for _ in range(max(8, pool_bytes // int(s)))]
         for s in sizes.split(",")}
with contextlib.ExitStack() as stack:
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-grpc-ab-")))
    if kind == "redis":
        from kvtier.bench.daemon import redis_peer
        red = stack.enter_context(redis_peer(tmp))
        if red is None:
            raise SystemExit("redis-server or the redis package is missing")
        put, get = red.set, red.get
        def delete(keys): red.delete(*keys)
    else:
        import kvtier
        from kvtier.bench.daemon import daemon
        target = stack.enter_context(daemon(tmp, transport, 2 * pool_bytes + (64 << 20)))
        client = stack.enter_context(kvtier.Client(target))
        client.wait_ready()
        put = lambda k, v: client.put("bench/grpc", k, v)
        get = lambda k: client.get("bench/grpc", k)
        def delete(keys):
            for k in keys:
                client.delete("bench/grpc", k)
    server = psutil.Process().children()[0]
    for size, pool in pools.items():  # warm both ends once per size, untimed
        keys = [f"warm-{i}" for i in range(len(pool))]
        for k, v in zip(keys, pool):
            put(k, v)
        for k in keys:
            get(k)
        delete(keys)
    print("ready", flush=True)
    for line in sys.stdin:
        pool = pools[int(line)]
        tag = uuid.uuid4().hex
        keys = [f"{tag}-{i}" for i in range(len(pool))]
        figures = {}
        for phase in ("put", "get"):
            lat = []
            c0, s0 = time.process_time(), server.cpu_times()
            started = time.perf_counter()
            for i, key in enumerate(keys):
                t0 = time.perf_counter()
                if phase == "put":
                    put(key, pool[i])
                elif get(key) != pool[i]:
                    raise SystemExit(f"{kind}: a block came back different: the run is void")
                lat.append(time.perf_counter() - t0)
            wall = time.perf_counter() - started
            c1, s1 = time.process_time(), server.cpu_times()
            figures[phase] = {
                "gbps": len(pool) * len(pool[0]) / wall / 1e9,
                "latency_s": lat,
                "client_cpu_s": (c1 - c0) / len(pool),
                "server_cpu_s": (s1.user + s1.system - s0.user - s0.system) / len(pool),
            }
        delete(keys)
        print(json.dumps(figures), flush=True)
"""


def _pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(trees: dict[str, Path], args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = [_size(s) for s in args.sizes.split(",")]
    workers = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER,
                kind,
                str(_size(args.pool)),
                ",".join(map(str, sizes)),
                args.transport,
            ],
            cwd=tree,  # `-c` puts the working directory first on sys.path
            env={**os.environ, "PYTHONPATH": str(tree)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, kind, tree in (
            ("this", "kvtier", trees["this"]),
            ("baseline", "kvtier", trees["baseline"]),
            ("redis", "redis", trees["this"]),
        )
    }
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for worker in workers.values():
            assert worker.stdout is not None
            if worker.stdout.readline().strip() != "ready":
                raise SystemExit("a benchmark worker did not start")
        names = list(workers)
        for i in range(args.rounds):
            order = names[i % 3 :] + names[: i % 3]  # each goes first, second, third in turn
            for size in sizes:
                for name in order:
                    worker = workers[name]
                    assert worker.stdin is not None and worker.stdout is not None
                    worker.stdin.write(f"{size}\n")
                    worker.stdin.flush()
                    reply = worker.stdout.readline()
                    if not reply:
                        raise SystemExit(f"the {name} worker stopped")
                    rounds.setdefault((name, size), []).append(json.loads(reply))
    finally:
        for worker in workers.values():
            assert worker.stdin is not None
            worker.stdin.close()
            worker.wait(120)
    report = []
    for size in sizes:
        for name in names:
            row: dict[str, Any] = {"path": name, "block_bytes": size}
            for phase in ("put", "get"):
                per_round = [r[phase] for r in rounds[(name, size)]]
                latencies = [x for r in per_round for x in r["latency_s"]]
                row[phase] = {
                    "gbps": statistics.median(r["gbps"] for r in per_round),
                    "rounds_gbps": [round(r["gbps"], 3) for r in per_round],
                    "p50_s": _pct(latencies, 0.5),
                    "p99_s": _pct(latencies, 0.99),
                    "client_cpu_s": statistics.median(r["client_cpu_s"] for r in per_round),
                    "server_cpu_s": statistics.median(r["server_cpu_s"] for r in per_round),
                }
            report.append(row)
    return report


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", required=True)
    parser.add_argument("--sizes", default="1MiB,4MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pool", default="128MiB", help="distinct bytes cycled per pass")
    parser.add_argument("--transport", choices=["tcp", "uds"], default="tcp")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-ab-") as scratch,
        baseline_tree(args.baseline_rev, Path(scratch)) as base,
    ):
        report = measure({"this": ROOT, "baseline": base}, args)
    print(
        "| block | path | put GB/s | get GB/s | put p50 / p99 µs | get p50 / p99 µs "
        "| client CPU put / get µs | server CPU put / get µs |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in report:
        p, g = row["put"], row["get"]
        print(
            f"| {row['block_bytes'] >> 20} MiB | {row['path']} | {p['gbps']:.2f} | {g['gbps']:.2f} "
            f"| {p['p50_s'] * 1e6:.0f} / {p['p99_s'] * 1e6:.0f} "
            f"| {g['p50_s'] * 1e6:.0f} / {g['p99_s'] * 1e6:.0f} "
            f"| {p['client_cpu_s'] * 1e6:.0f} / {g['client_cpu_s'] * 1e6:.0f} "
            f"| {p['server_cpu_s'] * 1e6:.0f} / {g['server_cpu_s'] * 1e6:.0f} |"
        )
    by = {(r["path"], r["block_bytes"]): r for r in report}
    for size in sorted({r["block_bytes"] for r in report}):
        this, base, red = (by[(n, size)] for n in ("this", "baseline", "redis"))
        print(
            f"{size >> 20} MiB: this / redis put {this['put']['gbps'] / red['put']['gbps']:.2f}x "
            f"get {this['get']['gbps'] / red['get']['gbps']:.2f}x; this / baseline put "
            f"{this['put']['gbps'] / base['put']['gbps']:.2f}x "
            f"get {this['get']['gbps'] / base['get']['gbps']:.2f}x"
        )
    if args.json:
        for row in report:  # the figures, not every latency
            for phase in ("put", "get"):
                row[phase] = {k: v for k, v in row[phase].items() if k != "latency_s"}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
