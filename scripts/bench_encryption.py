#!/usr/bin/env python3
"""What nvme.encryption_key_file costs: the NVMe tier's own write/read paths, plaintext
against AES-256-GCM, at several record sizes, in the same run.

    python scripts/bench_encryption.py --directory /mnt/nvme0 [--sizes 256KiB,1MiB,4MiB]
        [--total 64MiB] [--rounds 7] [--direct 1] [--json]

For each round, size and mode (the order of the modes alternates between rounds, so both
see the same drift of a noisy machine), one thread writes `--total` bytes of records
through `NvmeTier.write` (the demotion path), reads them all back with `read_into` (the
promotion path, into an arena-like buffer) and with `read` (the gRPC get path). Each
round first removes the previous round's records, as a full cache evicts before it
writes, so writes reuse record files as in a running daemon. The first round warms up
and is not counted. Reported: the median MB/s of the payload bytes over the counted
rounds, the ratio encrypted / plaintext, and CPU ms per MiB (process time), which is what
encryption adds when the drive is not the limit.
Everything is created under --directory and removed at the end.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.sizes import format_size, parse_size
from kvtier.tiers.allocator import round_up
from kvtier.tiers.crypto import RecordCipher, Seal
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for

NS_ID = "bench|encryption"
MODES = ("plain", "aes-gcm")
OPS = ("write", "read_into", "read")


def run_round(
    tier: NvmeTier, payloads: list[tuple[memoryview, int]], size_bytes: int, generation: int
) -> tuple[dict[str, tuple[float, float]], list[RecordHeader]]:
    """{op: (seconds, CPU seconds)} for one record per payload, and the records' headers."""
    headers = [
        RecordHeader(
            NS_ID,
            f"r{i}".encode(),
            generation + i,
            size_bytes,
            xxh3,
            header_size_for(NS_ID, f"r{i}".encode()),
        )
        for i, (_, xxh3) in enumerate(payloads)
    ]
    dest = aligned_buffer(round_up(size_bytes, 4096))
    out: dict[str, tuple[float, float]] = {}
    for op in OPS:
        wall_s, cpu_s = time.perf_counter(), time.process_time()
        for header, (payload, _) in zip(headers, payloads, strict=True):
            if op == "write":
                tier.write(header, [payload])
            elif op == "read_into":
                tier.read_into(header, memoryview(dest))
            else:
                buf, _ = tier.read(header)
                buf.close()
        out[op] = (time.perf_counter() - wall_s, time.process_time() - cpu_s)
    if bytes(dest[:size_bytes]) != bytes(payloads[-1][0][:size_bytes]):
        raise SystemExit("read back other bytes than were written")
    return out, headers


def fresh_payloads(
    pool: mmap.mmap, size_bytes: int, total_bytes: int
) -> list[tuple[memoryview, int]]:
    """(aligned payload, its xxh3) of records adding up to `total_bytes`, with bytes never
    written before: a drive or virtual disk that deduplicates or compresses would flatter
    plaintext records that repeat (ciphertext never does)."""
    step = round_up(size_bytes, 4096)
    views = [memoryview(pool)[i * step : i * step + step] for i in range(total_bytes // step or 1)]
    pool[: len(views) * step] = os.urandom(len(views) * step)
    for view in views:
        view[size_bytes:] = bytes(step - size_bytes)
    return [(view, xxhash.xxh3_64_intdigest(view[:size_bytes])) for view in views]


def crypto_only(
    cipher: RecordCipher, pool: mmap.mmap, size_bytes: int, total_bytes: int
) -> dict[str, float]:
    """MB/s of RecordCipher.encrypt and .decrypt alone over `total_bytes` of records."""
    dest = aligned_buffer(size_bytes)
    count = max(1, total_bytes // size_bytes)
    seal = cipher.new_seal()
    src = memoryview(pool)[:size_bytes]
    started_s = time.perf_counter()
    for _ in range(count):
        tag = cipher.encrypt(seal, b"aad", [src], memoryview(dest))
    sealed_s = time.perf_counter() - started_s
    seal = Seal(seal.key_id, seal.salt, seal.nonce, tag)
    out = aligned_buffer(size_bytes)
    started_s = time.perf_counter()
    for _ in range(count):
        cipher.decrypt(seal, b"aad", memoryview(dest), memoryview(out))
    opened_s = time.perf_counter() - started_s
    moved = count * size_bytes / 1e6
    return {"seal": moved / sealed_s, "open": moved / opened_s}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--sizes", default="256KiB,1MiB,4MiB")
    parser.add_argument("--total", default="64MiB", help="bytes written per size, mode, round")
    parser.add_argument("--rounds", type=int, default=7, help="counted rounds (plus a warm-up)")
    parser.add_argument("--direct", type=int, choices=[0, 1], default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    total_bytes = parse_size(args.total)
    root = args.directory / f"kvtier-bench-encryption-{uuid.uuid4().hex[:8]}"
    cipher = RecordCipher(os.urandom(32))
    tiers: dict[tuple[str, int], NvmeTier] = {}
    # (mode, size, op) -> per-round (MB/s, CPU ms per MiB)
    results: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    memory: dict[tuple[int, str], list[float]] = {}  # (size, op) -> per-round MB/s
    generation = 1
    try:
        root.mkdir()
        for mode in MODES:
            for size in sizes:
                tier = NvmeTier(
                    root / f"{mode}-{size}",
                    1 << 40,
                    direct_io=bool(args.direct),
                    sync_writes=False,
                    cipher=cipher if mode == "aes-gcm" else None,
                )
                tier.open()
                tiers[mode, size] = tier
        pool = aligned_buffer(total_bytes + max(sizes))
        previous: dict[tuple[str, int], list[RecordHeader]] = {}
        for round_index in range(args.rounds + 1):
            modes = MODES if round_index % 2 == 0 else MODES[::-1]
            for size in sizes:
                for mode in modes:
                    payloads = fresh_payloads(pool, size, total_bytes)
                    count = len(payloads)
                    tier = tiers[mode, size]
                    for old in previous.get((mode, size), []):
                        tier.remove(old)  # evict, then write: new records reuse their files
                    timings, headers = run_round(tier, payloads, size, generation)
                    generation += count
                    previous[mode, size] = headers
                    if round_index == 0:
                        continue  # warm-up: file allocation, page tables, CPU frequency
                    for op, (wall_s, cpu_s) in timings.items():
                        moved = count * size
                        results.setdefault((mode, size, op), []).append(
                            (moved / wall_s / 1e6, cpu_s * 1e3 / (moved / (1 << 20)))
                        )
                if round_index:
                    for op, mb_s in crypto_only(cipher, pool, size, total_bytes).items():
                        memory.setdefault((size, op), []).append(mb_s)
            print(f"round {round_index}/{args.rounds} done", file=sys.stderr)
    finally:
        for tier in tiers.values():
            tier.close()
        shutil.rmtree(root, ignore_errors=True)
    rows: list[dict[str, Any]] = []
    for size in sizes:
        for op in OPS:
            row: dict[str, Any] = {"size": format_size(size), "op": op}
            for mode in MODES:
                runs = results[mode, size, op]
                row[f"{mode}_mb_s"] = statistics.median(r[0] for r in runs)
                row[f"{mode}_mb_s_range"] = [min(r[0] for r in runs), max(r[0] for r in runs)]
                row[f"{mode}_cpu_ms_per_mib"] = statistics.median(r[1] for r in runs)
            row["ratio"] = row["aes-gcm_mb_s"] / row["plain_mb_s"]
            rows.append(row)
    in_memory = {
        format_size(size): {op: statistics.median(memory[size, op]) for op in ("seal", "open")}
        for size in sizes
    }
    if args.json:
        doc = {"direct": args.direct, "rounds": args.rounds, "rows": rows, "memory": in_memory}
        print(json.dumps(doc, indent=2))
        return 0
    print(
        "| record | op | plaintext MB/s (min–max) | AES-GCM MB/s (min–max) | ratio "
        "| CPU ms/MiB plaintext → AES-GCM |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        plain, enc = row["plain_mb_s_range"], row["aes-gcm_mb_s_range"]
        print(
            f"| {row['size']} | {row['op']} | {row['plain_mb_s']:.0f} ({plain[0]:.0f}–"
            f"{plain[1]:.0f}) | {row['aes-gcm_mb_s']:.0f} ({enc[0]:.0f}–{enc[1]:.0f}) | "
            f"{row['ratio']:.2f} | {row['plain_cpu_ms_per_mib']:.2f} → "
            f"{row['aes-gcm_cpu_ms_per_mib']:.2f} |"
        )
    print()
    print("AES-256-GCM alone, in memory, same run (MB/s, median): ", end="")
    print(
        "; ".join(
            f"{size}: seal {ops['seal']:.0f}, open {ops['open']:.0f}"
            for size, ops in in_memory.items()
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
