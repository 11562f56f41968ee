"""What a remote-tier hit costs through the daemon, against a local DRAM hit, same run.

Two real daemons share a Redis server on a UNIX socket (this machine's loopback; a
cluster adds its network). Node A stores chains of blocks; node B, once it sees them in
the remote tier, reads each chain with `get_many` (one Acquire: the daemon fetches the
blocks from Redis concurrently, verifies them and lands them in its arena, the client
copies them out) — then reads it again, now from its own DRAM. Baseline in the same run:
the same number of plain Redis GETs of values of the same size, one after another, with
redis-py (what the store itself gives a client, before any checking).

    python benchmarks/remote_fetch.py [--blocks 32] [--block-bytes 1MiB] [--rounds 5]
        [--io-threads 4] [--json FILE]

Needs redis-server and the `remote` extra (redis-py, hiredis).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import _daemon  # benchmarks/_daemon.py

import kvtier
from kvtier.sizes import parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--block-bytes", default="1MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--io-threads", type=int, default=4, help="remote.io_threads of node B")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("needs redis-server")
    size = parse_size(args.block_bytes)
    root = Path(tempfile.mkdtemp(prefix="kvt-rf-"))
    sock = root / "redis.sock"
    redis = subprocess.Popen(
        [server, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        while not sock.exists():
            time.sleep(0.05)
        env = {
            "KVTIER_REMOTE__BACKEND": "redis",
            "KVTIER_REMOTE__URL": f"unix://{sock}",
            "KVTIER_REMOTE__IO_THREADS": str(args.io_threads),
        }
        proc_a, target_a = _daemon.start(root / "a", env)
        procs.append(proc_a)
        proc_b, target_b = _daemon.start(root / "b", env)
        procs.append(proc_b)
        ns = "llama3-8b/remote-fetch"
        remote_s, local_s, plain_s = [], [], []
        import redis as redis_py

        raw = redis_py.Redis(unix_socket_path=str(sock))
        with kvtier.Client(target_a) as a, kvtier.Client(target_b) as b:
            for r in range(args.rounds):
                keys = [f"r{r}-{i}".encode() for i in range(args.blocks)]
                blocks = [os.urandom(size) for _ in keys]
                a.put_many(ns, list(zip(keys, blocks, strict=True)))
                while b.lookup(ns, keys).tiers != ["remote"] * len(keys):
                    time.sleep(0.02)
                out = [bytearray(size) for _ in keys]
                for into in (remote_s, local_s):
                    started = time.perf_counter()
                    got = b.get_many(ns, keys, out)
                    into.append(time.perf_counter() - started)
                    assert got == [size] * len(keys) and out == blocks
                for i, block in enumerate(blocks):
                    raw.set(f"plain/{r}/{i}", block)
                started = time.perf_counter()
                for i in range(len(blocks)):
                    assert raw.get(f"plain/{r}/{i}") is not None
                plain_s.append(time.perf_counter() - started)
            stats = b.stats()
        raw.close()
    finally:
        for proc in procs:
            _daemon.stop(proc)
            if proc.stdout is not None:
                proc.stdout.close()
        redis.kill()
        redis.wait(10)
        shutil.rmtree(root, ignore_errors=True)
    total = args.blocks * size
    report: dict[str, Any] = {
        "blocks": args.blocks,
        "block_bytes": size,
        "rounds": args.rounds,
        "remote_median_s": statistics.median(remote_s),
        "dram_median_s": statistics.median(local_s),
        "remote_gbps": total / statistics.median(remote_s) / 1e9,
        "dram_gbps": total / statistics.median(local_s) / 1e9,
        "redis_get_median_s": statistics.median(plain_s),
        "redis_get_gbps": total / statistics.median(plain_s) / 1e9,
        "remote_vs_redis_get": statistics.median(plain_s) / statistics.median(remote_s),
        "remote_per_block_ms": statistics.median(remote_s) / args.blocks * 1e3,
        "dram_per_block_ms": statistics.median(local_s) / args.blocks * 1e3,
        "remote_fetches": stats["remote_fetches"],
        "checksum_failures": stats["checksum_failures"],
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
