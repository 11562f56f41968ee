"""Same-run A/B of the three zero-copy put paths (issue 25): streamed one-exchange,
unstreamed one-exchange, and reserve + commit, taking turns on one daemon and client.

    PYTHONPATH=. python benchmarks/zerocopy_put_paths.py [--size 4MiB] [--rounds 4]

Prints each path's put p50 (µs) per round and the median over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import kvtier
from kvtier.bench.daemon import daemon
from kvtier.sizes import parse_size

PATHS = ("streamed", "one-exchange", "reserve-commit")


def p50_us(put: object, calls: int) -> float:
    latencies = []
    for i in range(calls):
        started = time.perf_counter()
        put(i)  # type: ignore[operator]
        latencies.append((time.perf_counter() - started) * 1e6)
    return statistics.median(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="4MiB")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    size = parse_size(args.size)
    calls = max(8, min(60, (240 << 20) // size))
    data = [os.urandom(size) for _ in range(calls)]
    results: dict[str, list[float]] = {path: [] for path in PATHS}
    with (
        tempfile.TemporaryDirectory() as tmp,
        daemon(Path(tmp), "uds", 1 << 30) as target,
        kvtier.Client(target) as client,
    ):
        client.put_from("bench", "attach", b"x")
        time.sleep(1)  # the mapping's prefault is done
        arena = client._shared_arena()
        assert arena is not None and arena.write_area is not None
        area = arena.write_area
        for r in range(args.rounds):
            for path in PATHS:
                area.streams = path == "streamed"
                area.one_exchange = path != "reserve-commit"
                keys = [f"{r}-{path}-{i}" for i in range(calls)]
                results[path].append(
                    p50_us(lambda i, keys=keys: client.put_from("bench", keys[i], data[i]), calls)
                )
                for key in keys:
                    client.delete("bench", key)
    for path, rounds in results.items():
        print(
            f"{path:>15}: p50 per round {[round(x) for x in rounds]} µs, "
            f"median {statistics.median(rounds):.0f} µs"
        )


if __name__ == "__main__":
    main()
