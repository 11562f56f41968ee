"""DigestTable's rehash, numpy (kvtier/index/slots.py) against the Python loop it replaced
(copied below as it was on main at a9fb6f0), on the same table, rounds interleaved.

    python benchmarks/digest_rehash.py --keys 1000000 --rounds 5

The reuse memory holds up to 1 Mi keys, and the event loop waits for a rehash: this is
the longest stall of ours that the 1 M fill had (issue 22). Since backward-shift removal
and `DigestTable(bound)`, the reuse memory never rehashes; other tables still grow so.
"""

from __future__ import annotations

import argparse
import statistics
import time
from array import array

from kvtier.index.slots import _EMPTY, _MIN_INDEX, DigestTable


def python_rehash(table: DigestTable) -> None:
    """main's `_rehash`, verbatim but for `self`."""
    size = _MIN_INDEX
    while size < 2 * (table._len + 1):
        size <<= 1
    index = array("i", [_EMPTY]) * size
    mask = size - 1
    digests, nxt = table._digest, table._next
    node = nxt[0]
    while node:
        i = digests[node] & mask
        while index[i]:
            i = (i + 1) & mask
        index[i] = node
        node = nxt[node]
    table._index, table._mask, table._deleted = index, mask, 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    table = DigestTable()
    for i in range(1, args.keys + 1):
        table.put(i * 0x9E3779B97F4A7C15 & ((1 << 64) - 1))
    times: dict[str, list[float]] = {"python": [], "numpy": []}
    for _ in range(args.rounds):
        for name, rehash in (("python", python_rehash), ("numpy", DigestTable._rehash)):
            began = time.perf_counter()
            rehash(table)
            times[name].append(time.perf_counter() - began)
            assert table.get(0x9E3779B97F4A7C15) == 0  # still finds its keys
    py, nu = (statistics.median(times[k]) for k in ("python", "numpy"))
    print(f"{args.keys} keys, median of {args.rounds}: python {py * 1e3:.1f} ms, numpy "
          f"{nu * 1e3:.1f} ms ({nu / py:.3f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
