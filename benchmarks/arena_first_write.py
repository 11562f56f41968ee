"""The first write into a fresh DRAM arena: `MAP_POPULATE` against the arena's prefault.

    PYTHONPATH=. python benchmarks/arena_first_write.py [--arena 256MiB] [--block 256KiB]

Each round maps a fresh memfd arena both ways, taking turns, and times copying a block
into every extent once (the first pass over the arena, as a fresh daemon's first fill
does): p50 per copy, and how long the mapping took.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

from kvtier.sizes import parse_size
from kvtier.tiers.dram import DramTier


def first_pass_us(view: memoryview, block: memoryview) -> float:
    size = block.nbytes
    times_s = []
    for start in range(0, view.nbytes - size + 1, size):
        began_s = time.perf_counter()
        view[start : start + size] = block
        times_s.append(time.perf_counter() - began_s)
    return statistics.median(times_s) * 1e6


def map_populate(arena_bytes: int, block: memoryview) -> tuple[float, float]:
    fd = os.memfd_create("kvtier-bench")
    try:
        os.ftruncate(fd, arena_bytes)
        began_s = time.perf_counter()
        mapping = mmap.mmap(fd, arena_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        map_s = time.perf_counter() - began_s
        view = memoryview(mapping)
        try:
            return map_s, first_pass_us(view, block)
        finally:
            view.release()
            mapping.close()
    finally:
        os.close(fd)


def dram_tier(arena_bytes: int, block: memoryview) -> tuple[float, float]:
    tier = DramTier(arena_bytes, prefault=True)
    try:
        return tier.startup_s, first_pass_us(tier.whole, block)
    finally:
        tier.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arena", default="256MiB")
    parser.add_argument("--block", default="256KiB")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    arena_bytes, block_bytes = parse_size(args.arena), parse_size(args.block)
    block = memoryview(bytearray(os.urandom(block_bytes)))
    ways = {"MAP_POPULATE": map_populate, "DramTier prefault": dram_tier}
    for round_no in range(args.rounds):
        for name, way in ways.items() if round_no % 2 == 0 else reversed(ways.items()):
            map_s, copy_us = way(arena_bytes, block)
            print(
                f"round {round_no} {name:18s} map {map_s * 1e3:6.0f} ms, "
                f"first-pass copy p50 {copy_us:6.1f} us"
            )


if __name__ == "__main__":
    main()
