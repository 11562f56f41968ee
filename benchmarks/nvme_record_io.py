"""What kvtier's NVMe record format costs per block against plain I/O of the same bytes.

On one directory (put it on the drive to measure, or on a RAM-backed filesystem to see
the CPU side alone), alternating in the same run: the tier's `write` (a record file:
header, O_DIRECT write, rename; files of removed records recycled) and `read_into` (open,
header + payload in one read, header and xxh3 checks) against `pwritev` / `preadv` of the
same block size at the same offsets in one preallocated file, one thread, O_DIRECT.
Reports per-block medians and the tier/raw bandwidth ratios.

    python benchmarks/nvme_record_io.py --directory DIR [--bs 1MiB] [--blocks 256]
        [--rounds 7] [--json FILE]

A RAM-backed ext4 for the CPU side (as root):
    truncate -s 3G /dev/shm/disk.img && mkfs.ext4 -q -F "$(losetup -f --show /dev/shm/disk.img)"
    mount /dev/loopN /mnt/ramext4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.sizes import parse_size
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for

NS_ID = "bench|kv"


def _header(index: int, generation: int, size: int, digest: int) -> RecordHeader:
    key = index.to_bytes(8, "little") * 4
    return RecordHeader(NS_ID, key, generation, size, digest, header_size_for(NS_ID, key))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--directory", type=Path, required=True)
    ap.add_argument("--bs", default="1MiB")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bs, n = parse_size(args.bs), args.blocks
    work = args.directory / f"kvtier-record-io-{os.getpid()}"
    work.mkdir(parents=True)
    payload = memoryview(aligned_buffer(bs))
    payload[:] = os.urandom(bs)
    digest = xxhash.xxh3_64_intdigest(payload)
    into = memoryview(aligned_buffer(bs))
    tier = NvmeTier(work / "tier", 1 << 62, direct_io=True, sync_writes=False)
    tier.open()
    raw_path = work / "raw"
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, n * bs)
    times: dict[str, list[float]] = {
        k: [] for k in ("tier_write", "raw_write", "tier_read", "raw_read")
    }
    generation = 0
    try:
        for r in range(args.rounds):
            generation += 1
            headers = [_header(i, generation, bs, digest) for i in range(n)]
            order = ("tier", "raw") if r % 2 == 0 else ("raw", "tier")
            for side in order:
                started = time.perf_counter()
                for i, h in enumerate(headers):
                    if side == "tier":
                        tier.write(h, [payload])
                    else:
                        os.pwritev(fd, [payload], i * bs)
                times[f"{side}_write"].append((time.perf_counter() - started) / n)
            for side in order:
                started = time.perf_counter()
                for i, h in enumerate(headers):
                    if side == "tier":
                        tier.read_into(h, into)
                    else:
                        os.preadv(fd, [into], i * bs)
                times[f"{side}_read"].append((time.perf_counter() - started) / n)
            for h in headers:
                tier.remove(h)  # its file goes to the recycling pool, as in a full tier
    finally:
        os.close(fd)
        tier.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "bs": bs,
        "blocks": n,
        "rounds": args.rounds,
        "per_block_us": {k: round(v * 1e6, 1) for k, v in med.items()},
        "write_ratio": med["raw_write"] / med["tier_write"],
        "read_ratio": med["raw_read"] / med["tier_read"],
    }
    print(
        f"{args.bs} blocks, {n} per round, median of {args.rounds} (tier / raw):\n"
        f"  write {med['tier_write'] * 1e6:.0f} / {med['raw_write'] * 1e6:.0f} µs per block "
        f"-> tier at {result['write_ratio']:.2f}x raw bandwidth\n"
        f"  read  {med['tier_read'] * 1e6:.0f} / {med['raw_read'] * 1e6:.0f} µs per block "
        f"-> tier at {result['read_ratio']:.2f}x raw bandwidth"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
