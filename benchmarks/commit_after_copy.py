"""What a put's commit (the checks, the catalog, the policy's orders, the directory) costs
in process right after a large copy has gone through the caches, against right after a
small one: a store's `put_begin` / `copy_in` / `put_commit` of fresh blocks, with or
without a copy of `--flush` bytes between the block's copy and its commit.

    PYTHONPATH=. python benchmarks/commit_after_copy.py [--block-bytes 256KiB]
        [--flush 8MiB] [--blocks 1500] [--rounds 3]

Each round runs both ways in fresh stores (who goes first alternates); DRAM holds every
block (no eviction), NVMe is the segment layout (nothing written to it). Printed: the
commit's p50 each way, medians of the rounds, and their ratio. No daemon: the figure is
the store's own bookkeeping, and how much of it is waiting for memory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _daemon import in_process_store

from kvtier.sizes import parse_size

NS = "default|commit-after-copy"


async def commit_p50_s(block_bytes: int, blocks: int, flush_bytes: int) -> float:
    from kvtier.config import Config
    from kvtier.engine.store import Store

    tmp = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="kvtier-commit-"))
    try:
        config = Config.model_validate(in_process_store(tmp, (blocks + 64) * block_bytes, 1 << 30))
        store = Store(config)
        await store.start()
        source = memoryview(bytearray(os.urandom(block_bytes)))
        junk_from = bytes(os.urandom(max(flush_bytes, 1)))
        junk_to = bytearray(len(junk_from))
        taken_s = []
        for i in range(blocks):
            writer = await store.put_begin((NS, i.to_bytes(8, "little")), block_bytes, False)
            writer.copy_in(source)
            if flush_bytes:
                junk_to[:] = junk_from
            started = time.perf_counter()
            await store.put_commit(writer, 0)
            taken_s.append(time.perf_counter() - started)
            store.put_abort(writer)
        await store.close()
        return statistics.median(taken_s[blocks // 10 :])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-bytes", type=parse_size, default=256 << 10)
    parser.add_argument("--flush", type=parse_size, default=8 << 20)
    parser.add_argument("--blocks", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ways = {"after the block's copy only": 0, f"after a {args.flush} B copy too": args.flush}
    p50s: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            p50s[name].append(asyncio.run(commit_p50_s(args.block_bytes, args.blocks, ways[name])))
    print(f"{args.block_bytes} B blocks, {args.blocks} commits a run, median of {args.rounds}")
    medians = {name: statistics.median(v) for name, v in p50s.items()}
    for name, seconds in medians.items():
        print(
            f"  commit p50 {name:32} {seconds * 1e6:7.1f} us  (rounds: "
            + ", ".join(f"{s * 1e6:.0f}" for s in p50s[name])
            + ")"
        )
    cold, warm = medians[names[1]], medians[names[0]]
    print(f"  ratio: {cold / warm:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
