"""Mooncake Store peer for `kvtier bench daemon --peers mooncake` (standalone: no kvtier
import, it runs under the Python that has `mooncake-transfer-engine-non-cuda`).

    python mooncake_peer.py store  SEGMENT_BYTES          # holds the data (another process)
    python mooncake_peer.py client SIZES POOL_BYTES ROUNDS # put_from/get_into, prints JSON

Run both inside a private network namespace with loopback up and
MC_TCP_BIND_ADDRESS=127.0.0.1, beside a mooncake_master with its HTTP metadata server on
127.0.0.1:8080 and RPC on 127.0.0.1:50051 (some Mooncake listeners bind every interface).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

METADATA = "http://127.0.0.1:8080/metadata"
MASTER = "127.0.0.1:50051"


def store(segment_bytes: int) -> None:
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    if s.setup("127.0.0.1", METADATA, segment_bytes, 64 << 20, "tcp", "", MASTER) != 0:
        raise SystemExit("mooncake store setup failed")
    print("ready", flush=True)
    time.sleep(3600)


def remove_all(s: object, keys: list[str]) -> None:
    """Remove a round's keys before the next round puts its own. The master refuses to
    remove an object whose lease (`--default_kv_lease_ttl`, renewed by each get) has not
    run out, and a refused remove leaves it taking segment space: the next rounds' puts
    then evict blocks before they are read back. So each refused key is tried again."""
    deadline_s = time.monotonic() + 30
    left = keys
    while left := [key for key in left if s.remove(key) != 0]:  # type: ignore[attr-defined]
        if time.monotonic() > deadline_s:
            raise SystemExit(f"mooncake kept {len(left)} objects it was asked to remove")
        time.sleep(0.1)


def client(sizes: list[int], pool_bytes: int, rounds: int) -> None:
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    if s.setup("127.0.0.1", METADATA, 0, 64 << 20, "tcp", "", MASTER) != 0:
        raise SystemExit("mooncake client setup failed")
    results = []
    for size in sizes:
        count = max(64, pool_bytes // size)
        src, dst = bytearray(os.urandom(count * size)), bytearray(count * size)
        src_c = (ctypes.c_char * len(src)).from_buffer(src)
        dst_c = (ctypes.c_char * len(dst)).from_buffer(dst)
        src_p, dst_p = ctypes.addressof(src_c), ctypes.addressof(dst_c)
        s.register_buffer(src_p, len(src))
        s.register_buffer(dst_p, len(dst))
        put_gbps, get_gbps, put_lat, get_lat = [], [], [], []
        for r in range(rounds):
            keys = [f"r{r}-{size}-{i}" for i in range(count)]
            started = time.perf_counter()
            for i, key in enumerate(keys):
                t0 = time.perf_counter()
                if s.put_from(key, src_p + i * size, size) != 0:
                    raise SystemExit("mooncake put_from failed")
                put_lat.append(time.perf_counter() - t0)
            put_gbps.append(count * size / (time.perf_counter() - started) / 1e9)
            started = time.perf_counter()
            for i, key in enumerate(keys):
                t0 = time.perf_counter()
                if s.get_into(key, dst_p + i * size, size) != size:
                    raise SystemExit("mooncake get_into failed")
                get_lat.append(time.perf_counter() - t0)
            get_gbps.append(count * size / (time.perf_counter() - started) / 1e9)
            if dst != src:
                raise SystemExit("mooncake returned different bytes")
            remove_all(s, keys)
        s.unregister_buffer(src_p)
        s.unregister_buffer(dst_p)
        results.append(
            {
                "block_bytes": size,
                "put_gbps": put_gbps,
                "get_gbps": get_gbps,
                "put_latency_s": put_lat,
                "get_latency_s": get_lat,
            }
        )
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "store":
        store(int(sys.argv[2]))
    else:
        client([int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4]))
