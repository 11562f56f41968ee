"""Put/get throughput of blocks through `kvtier.Client`, against memcpy in the same run.

    python -m kvtier.bench.daemon [--block-size 4MiB] [--pool 256MiB] [--rounds 5]
                                  [--transport uds|tcp|both] [--target ADDR] [--json]

Starts its own daemon (DRAM arena large enough for one round, NVMe in a temp dir) unless
--target is given. Every round puts the pool of distinct buffers (larger than the L3
cache, so neither side measures the cache), gets them back (verified), then deletes them.
The reference is a single-thread memcpy of the same buffers into a second pool, timed in
the same process between rounds. Reports the median over rounds and the ratio to memcpy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import kvtier
from kvtier.sizes import format_size, parse_size


@dataclass(frozen=True, slots=True)
class Figures:
    transport: str
    block_bytes: int
    pool_bytes: int
    rounds: int
    put_gbps_median: float
    get_gbps_median: float
    memcpy_gbps_median: float
    put_vs_memcpy: float
    get_vs_memcpy: float
    put_gbps_all: list[float]
    get_gbps_all: list[float]
    memcpy_gbps_all: list[float]


def memcpy_gbps(src: list[bytes], dst: list[bytearray]) -> float:
    started = time.perf_counter()
    for s, d in zip(src, dst, strict=True):
        memoryview(d)[:] = s
    elapsed = time.perf_counter() - started
    return sum(len(s) for s in src) / elapsed / 1e9


def start_daemon(workdir: Path, listen: str, dram: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier",
            "serve",
            "--listen",
            listen,
            "--dram-capacity",
            dram,
            "--nvme-path",
            str(workdir / "nvme"),
            "--nvme-capacity",
            "8GiB",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    match = re.search(r"serving on (\S+)", proc.stdout.readline())
    if not match:
        proc.kill()
        raise SystemExit("the daemon did not start")
    return proc, match.group(1)


def run(target: str, transport: str, block_bytes: int, pool_bytes: int, rounds: int) -> Figures:
    count = max(1, pool_bytes // block_bytes)
    pool = [os.urandom(block_bytes) for _ in range(count)]
    sink = [bytearray(block_bytes) for _ in range(count)]
    memcpy_gbps(pool, sink)  # fault the sink pages in before timing anything
    puts, gets, copies = [], [], []
    with kvtier.Client(target) as client:
        client.wait_ready()
        for _ in range(rounds):
            tag = uuid.uuid4().hex
            keys = [f"{tag}-{i}".encode() for i in range(count)]
            started = time.perf_counter()
            for key, data in zip(keys, pool, strict=True):
                client.put("bench/blocks", key, data)
            puts.append(count * block_bytes / (time.perf_counter() - started) / 1e9)
            started = time.perf_counter()
            for key, data in zip(keys, pool, strict=True):
                if client.get("bench/blocks", key) != data:
                    raise SystemExit("a block came back different")
            gets.append(count * block_bytes / (time.perf_counter() - started) / 1e9)
            copies.append(memcpy_gbps(pool, sink))
            for key in keys:
                client.delete("bench/blocks", key)
    put_m, get_m, copy_m = (statistics.median(x) for x in (puts, gets, copies))
    return Figures(
        transport,
        block_bytes,
        count * block_bytes,
        rounds,
        round(put_m, 3),
        round(get_m, 3),
        round(copy_m, 3),
        round(put_m / copy_m, 4),
        round(get_m / copy_m, 4),
        [round(x, 3) for x in puts],
        [round(x, 3) for x in gets],
        [round(x, 3) for x in copies],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.bench.daemon",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--block-size", default="4MiB")
    parser.add_argument("--pool", default="256MiB", help="distinct bytes cycled per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--transport", choices=["uds", "tcp", "both"], default="both")
    parser.add_argument("--target", help="use a running daemon instead of starting one")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    block, pool = parse_size(args.block_size), parse_size(args.pool)
    dram = format_size(max(pool * 2, 64 << 20))
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        workdir = Path(tmp)
        transports = ["uds", "tcp"] if args.transport == "both" else [args.transport]
        for transport in transports:
            if args.target:
                results.append(run(args.target, "given", block, pool, args.rounds))
                break
            listen = f"unix://{workdir / 'bench.sock'}" if transport == "uds" else "127.0.0.1:0"
            proc, target = start_daemon(workdir, listen, dram)
            try:
                results.append(run(target, transport, block, pool, args.rounds))
            finally:
                proc.terminate()
                proc.wait(60)
                if proc.stdout:
                    proc.stdout.close()
    machine = {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "kvtier": kvtier.__version__,
    }
    if args.json:
        print(json.dumps({"machine": machine, "results": [asdict(r) for r in results]}, indent=2))
        return 0
    print(f"kvtier {kvtier.__version__}, {os.cpu_count()} CPUs, Python {machine['python']}")
    for r in results:
        print(
            f"{r.transport}: {format_size(r.block_bytes)} blocks, pool {format_size(r.pool_bytes)}"
            f", median of {r.rounds}: put {r.put_gbps_median:.2f} GB/s "
            f"({r.put_vs_memcpy:.3f}x memcpy), get {r.get_gbps_median:.2f} GB/s "
            f"({r.get_vs_memcpy:.3f}x memcpy), memcpy {r.memcpy_gbps_median:.2f} GB/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
