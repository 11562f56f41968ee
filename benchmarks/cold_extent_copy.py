"""What the daemon's half of a zero-copy put costs at best: copying a block out of a
client's write area into an arena extent and hashing the copy, as `PutWriter.copy_in`
does (pieces of `COPY_PIECE_BYTES`, each hashed right after it is copied), into a
destination that is warm (the same extent every time) or cold (extents taken in turn
round an arena, as a daemon whose DRAM holds many blocks hands them out), against a
plain copy of the same bytes to each. No daemon, no client: the floor under the
daemon's copy, whatever its Python costs.

    PYTHONPATH=. python benchmarks/cold_extent_copy.py [--size 4MiB] [--arena 256MiB]
        [--rounds 5] [--calls 100]

Each round times every way once, in turn (who goes first rotates); the medians of the
rounds' p50s are printed, and the copy-and-hash into a cold extent as a multiple of a
plain warm copy (the copy the client's side makes into its own, reused, write area).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections.abc import Callable

from kvtier.engine.blocks import PutWriter
from kvtier.sizes import parse_size
from kvtier.types import Extent


def copy_hashed(dest: memoryview, source: memoryview) -> int:
    """`PutWriter.copy_in` itself, into `dest`: each piece copied, then hashed from the
    copy."""
    size = source.nbytes
    writer = PutWriter(("ns", b"k"), size, False, Extent(0, size), dest)
    writer.copy_in(source)
    return writer.digest()


def plain_copy(dest: memoryview, source: memoryview) -> int:
    dest[:] = source
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=4 << 20)
    parser.add_argument("--arena", type=parse_size, default=256 << 20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    size, slots = args.size, args.arena // args.size
    if slots < 2:
        raise SystemExit("--arena must hold at least two blocks of --size")
    source_buf = bytearray(os.urandom(size))
    source = memoryview(source_buf)
    arena = mmap.mmap(-1, slots * size)
    arena.write(b"\x01" * (slots * size))  # every page present and dirty, as the daemon's
    whole = memoryview(arena)
    turn = [0]

    def cold() -> memoryview:
        turn[0] = (turn[0] + 1) % slots
        return whole[turn[0] * size : (turn[0] + 1) * size]

    ways: dict[str, tuple[Callable[[memoryview, memoryview], int], Callable[[], memoryview]]] = {
        "copy, warm extent": (plain_copy, lambda: whole[:size]),
        "copy, cold extent": (plain_copy, cold),
        "copy+hash, warm extent": (copy_hashed, lambda: whole[:size]),
        "copy+hash, cold extent": (copy_hashed, cold),
    }
    p50s: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run, place = ways[name]
            taken = []
            for _ in range(args.calls):
                dest = place()
                started = time.perf_counter()
                run(dest, source)
                taken.append(time.perf_counter() - started)
                dest.release()
            p50s[name].append(statistics.median(taken))
    print(f"{size} B blocks, arena {slots * size} B, median of {args.rounds} rounds' p50s")
    medians = {name: statistics.median(v) for name, v in p50s.items()}
    for name, seconds in medians.items():
        print(f"  {name:24} {seconds * 1e6:8.0f} us  {size / seconds / 1e9:6.2f} GB/s")
    base = medians["copy, warm extent"]
    print(
        "  copy+hash into a cold extent / a warm copy: "
        f"{medians['copy+hash, cold extent'] / base:.2f}x "
        f"(a put at 0.7x of a copy has 1.43x for both sides together)"
    )
    source.release()
    whole.release()
    arena.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
