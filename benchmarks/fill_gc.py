"""What a full garbage collection walks after filling a Store in process (issue 22's fill
stall): N 4 KiB blocks put through the store's own API into a small DRAM arena on the
segment layout (so nearly all are demoted), timing every generation-2 collection during
the fill (gc.callbacks), then the objects the collector tracks, by type, and one full
collection. A collection holds the GIL, so the event loop stalls for as long.

    PYTHONPATH=. python benchmarks/fill_gc.py [--blocks 100000] [--directory /var/tmp/x]

Run it from each checkout to compare (PYTHONPATH picks whose kvtier).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvtier.config import Config
from kvtier.engine.store import Store

NS = "default|bench/fill"


async def fill(root: Path, blocks: int) -> None:
    config = Config.model_validate(
        {
            "server": {"listen": f"unix://{root}/s.sock"},
            "dram": {"capacity_bytes": 32 << 20, "prefault": False},
            "nvme": {"path": str(root / "nvme"), "capacity_bytes": 64 << 30, "layout": "segments"},
        }
    )
    store = Store(config)
    await store.start()
    data = os.urandom(4096)
    longest_s, count, started = 0.0, 0, 0.0

    def timed(phase: str, info: dict[str, int]) -> None:
        nonlocal longest_s, count, started
        if info["generation"] != 2:
            return
        if phase == "start":
            started = time.perf_counter()
        else:
            count += 1
            longest_s = max(longest_s, time.perf_counter() - started)

    gc.callbacks.append(timed)
    began = time.perf_counter()
    try:
        for i in range(blocks):
            writer = await store.put_begin((NS, b"k%d" % i), len(data), False)
            try:
                writer.write(data)
                await store.put_commit(writer, 0)
            finally:
                store.put_abort(writer)
        await store.tasks.drain()
    finally:
        gc.callbacks.remove(timed)
    fill_s = time.perf_counter() - began
    tracked = gc.get_objects()
    kinds = collections.Counter(type(o).__name__ for o in tracked)
    del tracked
    t0 = time.perf_counter()
    gc.collect()
    full_s = time.perf_counter() - t0
    longest_ms, full_ms = longest_s * 1e3, full_s * 1e3
    print(
        f"{blocks} blocks in {fill_s:.1f} s; {count} gen-2 collections, longest {longest_ms:.1f} ms"
    )
    print(
        f"tracked objects after the fill: {sum(kinds.values())}; a full collection {full_ms:.1f} ms"
    )
    for name, n in kinds.most_common(6):
        print(f"    {n:8d} {name}")
    await store.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--directory", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.directory, prefix="fill-gc-"))
    try:
        asyncio.run(fill(root, args.blocks))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
