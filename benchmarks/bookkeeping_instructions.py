"""Instructions a block of the residency's per-block bookkeeping, by part, in process: a
put's cataloguing (`Residency.add_new`: the catalog, the sketch, DRAM's order, the
directory, the events) and a demotion's (`dram_victims`, `written_many`,
`finish_dram_evictions`, 16 records a batch, as the stream benchmark's arena makes them);
against another revision.

    PYTHONPATH=. python benchmarks/bookkeeping_instructions.py [--baseline-rev REV]
        [--policy kvtier|lru|s3fifo]

The residency is a `Store`'s (configured as `put_path_cpu.py`'s, not started: no I/O, no
event loop), so its hooks are the daemon's. Each count is valgrind's callgrind over a
fresh process, the difference of two runs (4 096 and 1 024 blocks) so that start-up
cancels out: a figure that does not move with the machine's load, where timing these
few µs does. The put path's other work (the request, the reservation, the copy and
hash, the demoter's write) is `put_path_cpu.py --instructions`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

NS = "default|bookkeeping"
BLOCK_BYTES = 64 << 10
BATCH = 16
PARTS = ("add", "demote")


def one_run(blocks: int, part: str, policy: str) -> None:
    """The work measured, in this process (with whatever `kvtier` it imports): `blocks`
    puts catalogued, then (`part` "demote") all of them demoted in batches."""
    from _daemon import in_process_store

    from kvtier.config import Config
    from kvtier.engine.store import Store
    from kvtier.keys import tenant_of
    from kvtier.types import Extent, TierName

    scratch = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="kvtier-bookkeeping-"))
    try:
        settings = in_process_store(scratch, 1 << 30, 1 << 40)
        settings["policy"] = {"name": policy}
        settings["dram"]["prefault"] = False  # no bytes are written here
        store = Store(Config.model_validate(settings))
        residency = store.residency
        keys = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(blocks)]
        for i, key in enumerate(keys):
            extent = Extent((i * BLOCK_BYTES) % (1 << 30), BLOCK_BYTES)
            residency.add_new((NS, key), BLOCK_BYTES, i + 1, i + 1, extent)
        if len(residency.catalog) != blocks:
            raise SystemExit(f"{len(residency.catalog)} of {blocks} blocks catalogued")
        if part == "demote":
            tenant = tenant_of(NS)
            record_bytes = BLOCK_BYTES + 4096
            for _ in range(blocks // BATCH):
                victims = residency.dram_victims(tenant, BATCH * BLOCK_BYTES, BATCH)
                if len(victims) != BATCH:  # a count of nothing done would look like a gain
                    raise SystemExit(f"a batch found {len(victims)} of {BATCH} victims")
                residency.written_many(victims, [record_bytes] * len(victims), [0] * len(victims))
                residency.finish_dram_evictions(victims)
            demoted = residency.catalog.count(TierName.NVME)
            if demoted != blocks - blocks % BATCH or residency.catalog.count(TierName.DRAM) != (
                blocks % BATCH
            ):
                raise SystemExit(f"{demoted} of {blocks} blocks demoted")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def collected(tree: Path, blocks: int, part: str, policy: str) -> int:
    """callgrind's instruction count of one fresh process of `tree`'s code."""
    from _daemon import callgrind_instructions

    script = str(Path(__file__).resolve())
    argv = [sys.executable, script, "--child", str(blocks), "--part", part, "--policy", policy]
    return callgrind_instructions(tree, argv)


def per_block(tree: Path, part: str, policy: str) -> int:
    return (collected(tree, 4096, part, policy) - collected(tree, 1024, part, policy)) // 3072


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", default=None)
    parser.add_argument("--policy", default="kvtier", choices=["kvtier", "lru", "s3fifo"])
    parser.add_argument("--part", default="add", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        one_run(args.child, args.part, args.policy)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    from _daemon import baseline_tree

    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as scratch:
        trees = (
            contextlib.nullcontext(None)
            if args.baseline_rev is None
            else baseline_tree(args.baseline_rev, Path(scratch))
        )
        with trees as base:
            sides = {"this": here, **({"baseline": base} if base is not None else {})}
            counts: dict[str, dict[str, int]] = {side: {} for side in sides}
            for side, tree in sides.items():
                counts[side]["add"] = per_block(tree, "add", args.policy)
                # The demotion's own: the run that adds and demotes, less the adds.
                both = per_block(tree, "demote", args.policy)
                counts[side]["demote"] = both - counts[side]["add"]
                print(f"{side}: {counts[side]}", flush=True)
    print(f"instructions a block, policy {args.policy} (callgrind; 4096 less 1024 blocks):")
    for part in PARTS:
        row = "  ".join(f"{side} {got[part]:>8}" for side, got in counts.items())
        ratio = ""
        if "baseline" in counts:
            ratio = f"  this/baseline {counts['this'][part] / counts['baseline'][part]:.3f}x"
        print(f"  {part:7s} {row}{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
