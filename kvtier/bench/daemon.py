"""`kvtier bench daemon`: block put/get through the daemon, with same-run references.

    kvtier bench daemon [--sizes 256KiB,1MiB,4MiB,16MiB] [--pool 256MiB] [--rounds 3]
                        [--batch 64] [--transport uds|tcp] [--peers redis] [--json]

Starts its own daemon (DRAM arena large enough for one pool, NVMe in a temp dir). For each
block size it cycles a pool of distinct buffers larger than the L3 cache (so nothing is
measured from cache) through:

  zero-copy   put_from / get_into, one block per call (shared arena; gets read the
              tenant's directory first: direct reads, no round trip)
  zc-acquire  get_into of the same blocks by a client with direct_reads=False: every get
              acquires a lease (the path before direct reads), interleaved with zero-copy
  zc-batch    put_many / get_many, --batch blocks per call
  grpc        put / get, the gRPC byte-stream path (what a remote client uses)
  memcpy      single-thread copy of the same buffers into a second pool (the reference)
  redis       SET / GET through redis-py (+hiredis when installed) against a redis-server
              started on loopback without persistence; skipped with a message if absent
  mooncake    Mooncake Store (CPU/TCP build) put_from / get_into between a client and a
              store process over loopback, in a private network namespace (needs root,
              unshare, and --mooncake-python); skipped with a message if absent

Reports throughput (median over rounds), p50/p99 latency per call, and each path's ratio
to memcpy measured in the same run. Every get is checked against what was put.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvtier
from kvtier.sizes import format_size, parse_size

NS = "bench/blocks"


@dataclass(slots=True)
class PathFigures:
    """One path at one block size: throughput per round and latency per call."""

    path: str
    block_bytes: int
    put_gbps: list[float] = field(default_factory=list)
    get_gbps: list[float] = field(default_factory=list)
    put_latency_s: list[float] = field(default_factory=list)
    get_latency_s: list[float] = field(default_factory=list)

    def summary(self, memcpy_gbps: float) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float | None:
            if not xs:
                return None
            ordered = sorted(xs)
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6, 1)

        put = statistics.median(self.put_gbps) if self.put_gbps else None
        get = statistics.median(self.get_gbps) if self.get_gbps else None
        return {
            "path": self.path,
            "block_bytes": self.block_bytes,
            "put_gbps": round(put, 3) if put else None,
            "get_gbps": round(get, 3) if get else None,
            "put_vs_memcpy": round(put / memcpy_gbps, 3) if put else None,
            "get_vs_memcpy": round(get / memcpy_gbps, 3) if get else None,
            "put_p50_us": pct(self.put_latency_s, 0.5),
            "put_p99_us": pct(self.put_latency_s, 0.99),
            "get_p50_us": pct(self.get_latency_s, 0.5),
            "get_p99_us": pct(self.get_latency_s, 0.99),
            "rounds_put_gbps": [round(x, 3) for x in self.put_gbps],
            "rounds_get_gbps": [round(x, 3) for x in self.get_gbps],
        }


def _timed_pass(
    op: Callable[[int], object], calls: int, total_bytes: int, latencies: list[float]
) -> float:
    """Run op(0..calls-1), recording each call's latency; returns GB/s over the pass."""
    started = time.perf_counter()
    for i in range(calls):
        t0 = time.perf_counter()
        op(i)
        latencies.append(time.perf_counter() - t0)
    return total_bytes / (time.perf_counter() - started) / 1e9


def _fresh_keys(count: int) -> list[str]:
    tag = uuid.uuid4().hex
    return [f"{tag}-{i}" for i in range(count)]


def bench_size(
    client: kvtier.Client,
    size: int,
    pool_bytes: int,
    rounds: int,
    batch: int,
    redis_client: Any | None,
    acquire_client: kvtier.Client | None = None,
) -> tuple[float, list[PathFigures]]:
    count = max(batch, pool_bytes // size)
    pool = [os.urandom(size) for _ in range(count)]
    sinks = [bytearray(size) for _ in range(count)]
    total = count * size
    groups = [range(i, min(i + batch, count)) for i in range(0, count, batch)]
    memcpy, zc, zcb = (
        PathFigures("memcpy", size),
        PathFigures("zero-copy", size),
        PathFigures("zc-batch", size),
    )
    rpc, red = PathFigures("grpc", size), PathFigures("redis", size)
    zca = PathFigures("zc-acquire", size)
    zeros = bytes(size)

    def copy(i: int) -> None:
        memoryview(sinks[i])[:] = pool[i]

    def verify(got: list[bytearray]) -> None:
        if got != pool:
            raise SystemExit("a block came back different: the benchmark is void")

    _timed_pass(copy, count, total, [])  # faults the sinks in before anything is timed

    def run_round() -> None:
        memcpy.get_gbps.append(_timed_pass(copy, count, total, memcpy.get_latency_s))

        keys = _fresh_keys(count)
        zc.put_gbps.append(
            _timed_pass(
                lambda i: client.put_from(NS, keys[i], pool[i]), count, total, zc.put_latency_s
            )
        )

        def direct_gets() -> None:
            zc.get_gbps.append(
                _timed_pass(
                    lambda i: client.get_into(NS, keys[i], sinks[i]), count, total, zc.get_latency_s
                )
            )
            verify(sinks)

        def acquire_gets() -> None:
            assert acquire_client is not None
            for sink in sinks:
                memoryview(sink)[:] = zeros  # what the check sees is this pass's copy
            zca.get_gbps.append(
                _timed_pass(
                    lambda i: acquire_client.get_into(NS, keys[i], sinks[i]),
                    count,
                    total,
                    zca.get_latency_s,
                )
            )
            verify(sinks)

        # A/B interleaved: which of the two goes first alternates by round.
        passes = [direct_gets] + ([acquire_gets] if acquire_client is not None else [])
        for get_pass in passes if len(zc.get_gbps) % 2 == 0 else passes[::-1]:
            get_pass()
        for key in keys:
            client.delete(NS, key)

        keys = _fresh_keys(count)

        def put_group(g: int) -> None:
            client.put_many(NS, [(keys[i], pool[i]) for i in groups[g]])

        def get_group(g: int) -> None:
            client.get_many(NS, [keys[i] for i in groups[g]], [sinks[i] for i in groups[g]])

        sinks[:] = [bytearray(size) for _ in range(count)]
        zcb.put_gbps.append(_timed_pass(put_group, len(groups), total, zcb.put_latency_s))
        zcb.get_gbps.append(_timed_pass(get_group, len(groups), total, zcb.get_latency_s))
        verify(sinks)
        for key in keys:
            client.delete(NS, key)

        keys = _fresh_keys(count)

        # Each copy returned by a byte path is compared and dropped at once, so the
        # allocator reuses warm pages: the fastest set-up for those paths (and for Redis).
        def grpc_get(i: int) -> None:
            if client.get(NS, keys[i]) != pool[i]:
                raise SystemExit("a block came back different over gRPC")

        rpc.put_gbps.append(
            _timed_pass(lambda i: client.put(NS, keys[i], pool[i]), count, total, rpc.put_latency_s)
        )
        rpc.get_gbps.append(_timed_pass(grpc_get, count, total, rpc.get_latency_s))
        for key in keys:
            client.delete(NS, key)

        if redis_client is not None:
            keys = _fresh_keys(count)

            def redis_get(i: int) -> None:
                if redis_client.get(keys[i]) != pool[i]:
                    raise SystemExit("a block came back different from Redis")

            red.put_gbps.append(
                _timed_pass(
                    lambda i: redis_client.set(keys[i], pool[i]), count, total, red.put_latency_s
                )
            )
            red.get_gbps.append(_timed_pass(redis_get, count, total, red.get_latency_s))
            redis_client.delete(*keys)

    for _ in range(rounds):
        run_round()
    paths = [zc, *([zca] if acquire_client is not None else []), zcb, rpc, memcpy]
    paths += [red] if redis_client is not None else []
    return statistics.median(memcpy.get_gbps), paths


@contextlib.contextmanager
def daemon(workdir: Path, transport: str, dram_bytes: int) -> Iterator[str]:
    """A real daemon of the kvtier this process imported, serving `transport`: its
    target. `python -m` puts the working directory first on the import path, so the
    daemon starts in the directory that holds this kvtier: run from another checkout (or
    with PYTHONPATH naming one, as the A/B scripts do), it is still the code measured."""
    workdir = workdir.resolve()
    listen = f"unix://{workdir / 'bench.sock'}" if transport == "uds" else "127.0.0.1:0"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier",
            "serve",
            "--listen",
            listen,
            "--dram-capacity",
            format_size(dram_bytes),
            "--nvme-path",
            str(workdir / "nvme"),
            "--nvme-capacity",
            "8GiB",
            "--log-level",
            "error",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        # The TCP run compares transports on loopback: plain TCP, as the peers use.
        env={**os.environ, "KVTIER_SERVER__TLS_INSECURE": "true"},
    )
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    match = re.search(r"serving on (\S+)", banner)
    try:
        if not match:
            raise SystemExit("the daemon did not start")
        if "recovering its index" in banner:  # measure with the NVMe index complete
            proc.stdout.readline()
        yield match.group(1)
    finally:
        proc.terminate()
        proc.wait(60)
        proc.stdout.close()


@contextlib.contextmanager
def redis_peer(workdir: Path) -> Iterator[Any | None]:
    """A loopback redis-server without persistence and a redis-py client, or None."""
    server = shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        server = None
    if server is None:
        print("redis: skipped (needs redis-server on PATH and the redis package)", file=sys.stderr)
        yield None
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [
            server,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.05)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)


def mooncake_python(explicit: str | None) -> Path | None:
    """A Python with Mooncake's store module: given, $KVTIER_BENCH_MOONCAKE_PYTHON, or the
    one beside `mooncake_master` on PATH."""
    if explicit or os.environ.get("KVTIER_BENCH_MOONCAKE_PYTHON"):
        return Path(explicit or os.environ["KVTIER_BENCH_MOONCAKE_PYTHON"])
    master = shutil.which("mooncake_master")
    return Path(master).with_name("python") if master else None


def mooncake_peer(
    python: Path | None, sizes: list[int], pool_bytes: int, rounds: int
) -> list[PathFigures]:
    """Mooncake Store put_from/get_into between two processes over loopback TCP, run in a
    private network namespace (its listeners bind every interface); [] when unavailable."""
    master = python.with_name("mooncake_master") if python else None
    if python is None or master is None or not master.exists() or not python.exists():
        print(
            "mooncake: skipped (install mooncake-transfer-engine-non-cuda in a venv and "
            "pass --mooncake-python)",
            file=sys.stderr,
        )
        return []
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print(
            "mooncake: skipped (needs root and unshare for a private network namespace)",
            file=sys.stderr,
        )
        return []
    script = Path(__file__).with_name("mooncake_peer.py")
    segment = max(pool_bytes, max(sizes) * 64) * 2
    q = shlex.quote
    shell = f"""
        set -e
        ip link set lo up
        export MC_TCP_BIND_ADDRESS=127.0.0.1
        {q(str(master))} --rpc_address=127.0.0.1 --rpc_port=50051 --metrics_host=127.0.0.1 \
            --enable_http_metadata_server=true --http_metadata_server_host=127.0.0.1 \
            --http_metadata_server_port=8080 --default_kv_lease_ttl=500 >/dev/null 2>&1 &
        sleep 2
        {q(str(python))} {q(str(script))} store {segment} >/dev/null 2>&1 &
        sleep 5
        {q(str(python))} {q(str(script))} client {",".join(map(str, sizes))} {pool_bytes} {rounds}
        kill %1 %2 || true
    """
    out = subprocess.run(
        ["unshare", "--net", "bash", "-c", shell],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    try:
        rows = json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        print(f"mooncake: failed; its stderr ends with: {out.stderr[-800:]}", file=sys.stderr)
        return []
    return [
        PathFigures(
            "mooncake",
            r["block_bytes"],
            r["put_gbps"],
            r["get_gbps"],
            r["put_latency_s"],
            r["get_latency_s"],
        )
        for r in rows
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvtier bench daemon",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default="256KiB,1MiB,4MiB,16MiB")
    parser.add_argument("--pool", default="256MiB", help="distinct bytes cycled per pass")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="blocks per put_many/get_many")
    parser.add_argument("--transport", choices=["uds", "tcp"], default="uds")
    parser.add_argument(
        "--peers", default="redis,mooncake", help="comma list of peers (redis, mooncake), or 'none'"
    )
    parser.add_argument("--mooncake-python", help="Python with Mooncake's store installed")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    pool = parse_size(args.pool)
    dram = max(pool, max(sizes) * args.batch) * 2
    peers = set(args.peers.split(",")) - {"none", ""}
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        workdir = Path(tmp)
        with (
            daemon(workdir, args.transport, dram) as target,
            kvtier.Client(target) as client,
            kvtier.Client(target, direct_reads=False) as acquire_client,
            redis_peer(workdir) if "redis" in peers else contextlib.nullcontext() as red,
        ):
            client.wait_ready()
            memcpy_by_size: dict[int, float] = {}
            for size in sizes:
                memcpy_gbps, paths = bench_size(
                    client, size, pool, args.rounds, args.batch, red, acquire_client
                )
                memcpy_by_size[size] = memcpy_gbps
                results.extend(p.summary(memcpy_gbps) for p in paths)
                print(f"done {format_size(size)}", file=sys.stderr)
    if "mooncake" in peers:
        python = mooncake_python(args.mooncake_python)
        for figures in mooncake_peer(python, sizes, pool, args.rounds):
            results.append(figures.summary(memcpy_by_size[figures.block_bytes]))
        results.sort(key=lambda r: (r["block_bytes"], r["path"] == "mooncake"))
    machine = {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "kvtier": kvtier.__version__,
        "transport": args.transport,
        "pool_bytes": pool,
        "rounds": args.rounds,
        "batch": args.batch,
    }
    if args.json:
        print(json.dumps({"machine": machine, "results": results}, indent=2))
        return 0
    print(
        f"kvtier {kvtier.__version__}, {os.cpu_count()} CPUs, {args.transport}, "
        f"pool {format_size(pool)}, median of {args.rounds} rounds"
    )
    print(
        f"{'block':>7} {'path':>10} {'put GB/s':>9} {'get GB/s':>9} {'put/memcpy':>10} "
        f"{'get/memcpy':>10} {'put/redis':>9} {'get/redis':>9} "
        f"{'put p50/p99 us':>16} {'get p50/p99 us':>16}"
    )
    # The issue's targets are ratios to peers measured in this same run.
    redis_of = {r["block_bytes"]: r for r in results if r["path"] == "redis"}

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    def vs_redis(r: dict[str, Any], field: str) -> float | None:
        peer = redis_of.get(r["block_bytes"], {}).get(field)
        return r[field] / peer if r[field] and peer else None

    for r in results:
        print(
            f"{format_size(r['block_bytes']):>7} {r['path']:>10} {fmt(r['put_gbps'], '.2f'):>9} "
            f"{fmt(r['get_gbps'], '.2f'):>9} {fmt(r['put_vs_memcpy'], '.3f'):>10} "
            f"{fmt(r['get_vs_memcpy'], '.3f'):>10} {fmt(vs_redis(r, 'put_gbps'), '.2f'):>9} "
            f"{fmt(vs_redis(r, 'get_gbps'), '.2f'):>9} "
            f"{fmt(r['put_p50_us'], '.0f') + '/' + fmt(r['put_p99_us'], '.0f'):>16} "
            f"{fmt(r['get_p50_us'], '.0f') + '/' + fmt(r['get_p99_us'], '.0f'):>16}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
