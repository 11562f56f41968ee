"""The put path's CPU a block, in process: a store's zero-copy one-exchange puts (what a
session's StagedPut runs) of 64 KiB blocks through a small arena that demotes to the
segment layout as they arrive, the event loop's CPU a block; against another revision.

    PYTHONPATH=. python benchmarks/put_path_cpu.py [--baseline-rev REV] [--rounds 5]
        [--blocks 16384] [--block-bytes 64KiB] [--dram 16MiB] [--batch 16] [--instructions]

No daemon and no client: `Store.zero_copy.put_staged` is called with items a session's
staging range holds (16 blocks a call: a 1 MiB `put_many`), so the figure is the store's
own work a block (put, commit, the residency, the directory, the demoter's claims and
completions), the same work the daemon's loop does for a streamed put minus the
session's framing. Each round runs this checkout and the baseline (a `git worktree` of
REV), alternating which goes first, each in a fresh process; the figures are the loop
thread's CPU a block over the puts (`time.thread_time`; the flush at the end is not
counted) and the wall time a block. The medians of the rounds and their ratio are
printed. `--instructions` also counts each side's instructions a block under
valgrind's callgrind (the difference of two runs, 3072 and 1024 blocks, so start-up
cancels out): a count that does not move with the machine's load, ~50x slower.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

NS = "default|put-path-cpu"


async def one_run(blocks: int, block_bytes: int, dram_bytes: int, batch: int) -> dict[str, float]:
    """The measurement itself, in this process (with whatever `kvtier` it imports)."""
    from _daemon import in_process_store

    from kvtier.config import Config
    from kvtier.engine.store import Store

    tmp = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="kvtier-putcpu-"))
    try:
        config = Config.model_validate(in_process_store(tmp, dram_bytes, 4 << 30))
        store = Store(config)
        await store.start()
        zero_copy = store.zero_copy
        area = zero_copy.write_area(1)
        offset, _ = area.stage(batch * block_bytes)
        value = os.urandom(block_bytes)
        with area.view(offset, batch * block_bytes) as view:
            for i in range(batch):
                view[i * block_bytes : (i + 1) * block_bytes] = value
        keys = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(blocks)]
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        for start in range(0, blocks, batch):
            items = [
                ((NS, keys[start + i]), block_bytes, offset + i * block_bytes, 0)
                for i in range(min(batch, blocks - start))
            ]
            outcomes = await zero_copy.put_staged(1, items, False)
            # The daemon's loop turns between a session's requests, so a demotion batch's
            # completion runs between two puts, not only when one waits for room.
            await asyncio.sleep(0)
            if not all(o.stored for o in outcomes):
                raise SystemExit(f"a put failed: {outcomes}")
        cpu_s, wall_s = time.thread_time() - cpu0, time.perf_counter() - wall0
        await store.flush()
        await store.close()
        return {"loop_cpu_us": cpu_s / blocks * 1e6, "wall_us": wall_s / blocks * 1e6}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def child_argv(args: argparse.Namespace, blocks: int) -> list[str]:
    """The command of one fresh process of this script's measurement."""
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--blocks",
        str(blocks),
        "--block-bytes",
        str(args.block_bytes),
        "--dram",
        str(args.dram),
        "--batch",
        str(args.batch),
    ]


def instructions_per_block(tree: Path, args: argparse.Namespace) -> int:
    from _daemon import callgrind_instructions

    def collected(blocks: int) -> int:
        return callgrind_instructions(tree, child_argv(args, blocks))

    return (collected(3072) - collected(1024)) // 2048


def main() -> int:
    from kvtier.sizes import parse_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=16384)
    parser.add_argument("--block-bytes", type=parse_size, default=64 << 10)
    parser.add_argument("--dram", type=parse_size, default=16 << 20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--instructions", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = asyncio.run(one_run(args.blocks, args.block_bytes, args.dram, args.batch))
        print(json.dumps(result))
        return 0
    from _daemon import baseline_tree, run_in

    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as scratch:
        sides = {"this": here}
        trees = (
            contextlib.nullcontext(None)
            if args.baseline_rev is None
            else baseline_tree(args.baseline_rev, Path(scratch))
        )
        with trees as base:
            if base is not None:
                sides["baseline"] = base
            rows: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
            for round_ in range(args.rounds):
                order = list(sides.items())
                if round_ % 2:
                    order.reverse()
                for side, tree in order:
                    got = json.loads(run_in(tree, child_argv(args, args.blocks)).stdout)
                    rows[side].append(got)
                    print(f"round {round_} {side}: {got}", flush=True)
            counts = {}
            if args.instructions:
                for side, tree in sides.items():
                    counts[side] = instructions_per_block(tree, args)
                    print(f"{side}: {counts[side]} instructions a block", flush=True)
    print(
        f"{args.blocks} x {args.block_bytes} B blocks, {args.batch} a call, "
        f"arena {args.dram} B, median of {args.rounds} rounds"
    )
    medians = {
        side: {k: statistics.median(r[k] for r in got) for k in ("loop_cpu_us", "wall_us")}
        for side, got in rows.items()
    }
    for side, m in medians.items():
        extra = f", {counts[side]} instructions" if side in counts else ""
        print(
            f"  {side:8s} loop CPU {m['loop_cpu_us']:.1f} us/block, wall {m['wall_us']:.1f}{extra}"
        )
    if "baseline" in medians:
        this, base = medians["this"], medians["baseline"]
        print(
            f"  this/baseline: loop CPU {this['loop_cpu_us'] / base['loop_cpu_us']:.3f}x, "
            f"wall {this['wall_us'] / base['wall_us']:.3f}x"
            + (f", instructions {counts['this'] / counts['baseline']:.3f}x" if counts else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
