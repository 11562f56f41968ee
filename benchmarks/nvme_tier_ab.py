"""Same-run A/B of the NVMe tier's data path: this checkout's `kvtier/tiers/nvme.py`
against the one at a git revision, alternated in one process on one directory.

Each round, for each version (the order alternates): write --blocks records, then write
a new generation of each and remove the superseded one (what a running tier does, files
recycled), then read every record back verified. Reports per-record medians and the
median of the per-round speedups (baseline / this checkout).

    python benchmarks/nvme_tier_ab.py --baseline-rev ff7f29d --directory /mnt/ramext4 \\
        [--bs 1MiB] [--blocks 200] [--rounds 8]

Put the directory on a fast device (or a RAM-backed ext4, see nvme_record_io.py) to see
the CPU side; on a slow or noisy drive the drive's time hides it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import xxhash

import kvtier.tiers.nvme as current
from kvtier.buffers import aligned_buffer
from kvtier.sizes import parse_size

NS_ID = "bench|kv"


def _baseline(rev: str, scratch: Path) -> ModuleType:
    source = subprocess.run(
        ["git", "show", f"{rev}:kvtier/tiers/nvme.py"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    ).stdout
    path = scratch / "nvme_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("kvtier.tiers.nvme_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _round(module: ModuleType, root: Path, bs: int, blocks: int) -> tuple[float, float]:
    """(seconds per write + remove of the superseded record, seconds per verified read)"""
    payload = aligned_buffer(bs)
    payload[:] = os.urandom(bs)
    digest = xxhash.xxh3_64_intdigest(payload)
    dest = memoryview(aligned_buffer(bs))
    shutil.rmtree(root, ignore_errors=True)
    tier = module.NvmeTier(root, 1 << 50, direct_io=True, sync_writes=False)
    tier.open()

    def header(i: int, generation: int) -> object:
        key = i.to_bytes(8, "little") * 4
        size = module.header_size_for(NS_ID, key)
        return module.RecordHeader(NS_ID, key, generation, bs, digest, size)

    try:
        for i in range(blocks):
            tier.write(header(i, 1), [memoryview(payload)])
        started = time.perf_counter()
        for i in range(blocks):
            tier.write(header(i, 2), [memoryview(payload)])
            tier.remove(header(i, 1))
        write_s = (time.perf_counter() - started) / blocks
        started = time.perf_counter()
        for i in range(blocks):
            tier.read_into(header(i, 2), dest)
        read_s = (time.perf_counter() - started) / blocks
    finally:
        tier.close()
        shutil.rmtree(root, ignore_errors=True)
    return write_s, read_s


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline-rev", required=True)
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--bs", default="1MiB")
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    bs = parse_size(args.bs)
    with tempfile.TemporaryDirectory() as scratch:
        versions = {"baseline": _baseline(args.baseline_rev, Path(scratch)), "this": current}
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in versions}
        for round_index in range(args.rounds):
            names = list(versions) if round_index % 2 == 0 else list(reversed(versions))
            for name in names:
                root = args.directory / f"kvtier-tier-ab-{name}"
                results[name].append(_round(versions[name], root, bs, args.blocks))
    print(f"{args.bs} records, {args.blocks} per round, {args.rounds} rounds:")
    for index, what in enumerate(("write + remove", "read")):
        base = [r[index] for r in results["baseline"]]
        this = [r[index] for r in results["this"]]
        speedups = sorted(b / t for b, t in zip(base, this, strict=True))
        print(
            f"  {what:15} {statistics.median(base) * 1e6:6.0f} -> "
            f"{statistics.median(this) * 1e6:6.0f} µs per record, paired speedup "
            f"{statistics.median(speedups):.2f}x (rounds {speedups[0]:.2f}-{speedups[-1]:.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
