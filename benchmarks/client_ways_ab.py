"""Same-run A/B of the sync client's measured ways (kvtier/client/ways.py): two clients of
one real daemon, one as shipped (per op it polls the session socket for replies or
sleeps, per size class a large put streams or not, whichever took less) and one as
before on this 2-CPU host (`spin_s=0`: asleep in recv; puts never streamed), taking
turns round by round (who goes first alternates), one call in flight.

    python benchmarks/client_ways_ab.py [--rounds 6] [--calls 1500]
        [--ops put:4KiB,put:256KiB,get:4KiB,get:256KiB,plan:256] [--hogs 0] [--json out.json]

Ops: `put:SIZE` (`put_from`, one block, overwriting a pool of 512 keys), `get:SIZE`
(`get_into` of one of 32 blocks under a lease: `direct_reads=False`, so every get is an
exchange), `plan:N` (a Plan of an N-block chain, 16 tokens a block). Prints each op's
p50 and mean per side (medians over rounds; the p50's range) and the ratio this /
before; the client process's CPU per call is printed too, since polling spends it.
`--hogs N` runs N processes that only burn CPU meanwhile (a loaded host: polling and
streaming then compete with the daemon and them for the cores).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvtier
from kvtier.bench.daemon import daemon
from kvtier.sizes import parse_size


def one_op(client: kvtier.Client, side: str, op: str, arg: int, i: int, pool: Any) -> None:
    if op == "put":
        key = f"{side}/{arg}/p{i % 512}".encode()
        client.put_from("ns", key, pool[arg][i % len(pool[arg])], overwrite=True)
    elif op == "get":
        client.get_into("ns", f"{side}/{arg}/g{i % 32}".encode(), pool["sink", arg])
    else:
        client.plan("ns", pool["chain", arg], 16)


def burn(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--ops", default="put:4KiB,put:256KiB,get:4KiB,get:256KiB,plan:256")
    parser.add_argument("--hogs", type=int, default=0, help="CPU-burning processes meanwhile")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ops = []
    for spec in args.ops.split(","):
        op, _, value = spec.partition(":")
        if op not in {"put", "get", "plan"}:
            raise SystemExit(f"unknown op {op!r}: use put:SIZE, get:SIZE or plan:BLOCKS")
        ops.append((op, int(value) if op == "plan" else parse_size(value)))
    pool: dict[Any, Any] = {}
    for op, arg in ops:
        if op == "plan":
            pool["chain", arg] = [f"chain{j}".encode() for j in range(arg)]
        else:
            pool.setdefault(arg, [os.urandom(arg) for _ in range(32)])
            pool["sink", arg] = bytearray(arg)
    p50s: dict[str, dict[str, list[float]]] = {}
    means: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, list[float]]] = {}
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=burn, args=(stop,)) for _ in range(args.hogs)]
    with (
        tempfile.TemporaryDirectory(dir="/var/tmp", prefix="kvtier-ways-ab-") as scratch,
        daemon(Path(scratch), "uds", 2 << 30) as target,
    ):
        clients = {
            "this": kvtier.Client(target, direct_reads=False),
            "before": kvtier.Client(target, direct_reads=False, spin_s=0),
        }
        before = clients["before"]._shared_arena()
        if before is None or before.write_area is None:
            raise SystemExit("no shared arena: the daemon refused the session")
        before.write_area.streams = False
        for side, client in clients.items():
            for op, arg in ops:
                if op == "get":
                    for i, data in enumerate(pool[arg]):
                        client.put_from("ns", f"{side}/{arg}/g{i}".encode(), data)
        for rnd in range(args.rounds):
            order = list(clients.items())
            if rnd == 0:
                for hog in hogs:
                    hog.start()
            for side, client in order if rnd % 2 == 0 else order[::-1]:
                for op, arg in ops:
                    name = f"{op}:{arg}"
                    times = []
                    cpu0 = time.process_time()
                    for i in range(args.calls):
                        began = time.perf_counter()
                        one_op(client, side, op, arg, i, pool)
                        times.append(time.perf_counter() - began)
                    used = (time.process_time() - cpu0) / args.calls
                    p50s.setdefault(name, {}).setdefault(side, []).append(
                        statistics.median(times) * 1e6
                    )
                    cpu.setdefault(name, {}).setdefault(side, []).append(used * 1e6)
                    means.setdefault(name, {}).setdefault(side, []).append(
                        statistics.fmean(times) * 1e6
                    )
            print(f"round {rnd} done", file=sys.stderr, flush=True)
        stop.set()
        for hog in hogs:
            hog.join()
        for client in clients.values():
            client.close()
    print(
        f"{os.cpu_count()} CPUs, {args.hogs} hogs, {args.rounds} rounds x {args.calls} calls,"
        " medians of rounds"
    )
    columns = ("this p50 us", "before p50 us", "ratio", "mean us", "client CPU us/call")
    print(
        f"{'op':14s} {columns[0]:>20s} {columns[1]:>20s} {columns[2]:>6s} {columns[3]:>14s}"
        f" {columns[4]:>20s}"
    )
    for name, sides in p50s.items():
        this, before = sides["this"], sides["before"]
        ratio = statistics.median(this) / statistics.median(before)
        print(
            f"{name:14s} {statistics.median(this):8.0f} ({min(this):.0f}-{max(this):.0f})"
            f" {statistics.median(before):8.0f} ({min(before):.0f}-{max(before):.0f})"
            f" {ratio:6.2f} {statistics.median(means[name]['this']):6.0f} /"
            f" {statistics.median(means[name]['before']):<6.0f}"
            f" {statistics.median(cpu[name]['this']):10.0f} /"
            f" {statistics.median(cpu[name]['before']):.0f}"
        )
    if args.json:
        out = {"hogs": args.hogs, "p50_us": p50s, "mean_us": means, "client_cpu_us": cpu}
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
