"""How long the event loop stalls while a store fills its NVMe index in the background.

    python benchmarks/nvme_recovery_lag.py --tier /var/tmp/kvs/nvme [--threads 1]

In one process, as the daemon runs it: a `Store` on an existing tier (for instance the one
benchmarks/nvme_startup.py --keep leaves) started with `recover_in_background`, and a
1 ms timer on its loop until the index is complete. Reports, over the timer's wakeups,
the loop thread's own CPU time between two of them (what the store's code costs the loop,
whatever else the machine runs) and the wall-clock lateness (that plus waiting for the GIL
and for a CPU), and every cyclic-GC collection's duration.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import kvtier.tiers.nvme as tier_module
from kvtier.config import Config
from kvtier.engine.store import Store


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * q))]


async def _measure(config: Config) -> None:
    store = Store(config)
    started = time.perf_counter()
    await store.start(recover_in_background=True)
    ready_s = time.perf_counter() - started
    cpu_s: list[float] = []
    late_s: list[float] = []
    while store.nvme_recovering:
        wall, cpu = time.perf_counter(), time.thread_time()
        await asyncio.sleep(0.001)
        cpu_s.append(time.thread_time() - cpu)
        late_s.append(time.perf_counter() - wall - 0.001)
    indexed_s = time.perf_counter() - started
    assert store.recovery is not None
    print(f"ready {ready_s:.3f} s, indexed {store.recovery.indexed} records in {indexed_s:.2f} s")
    print(
        f"loop thread CPU between wakeups: max {max(cpu_s) * 1e3:.1f} ms, "
        f"p99 {_pct(cpu_s, 0.99) * 1e3:.1f} ms; lateness: max {max(late_s) * 1e3:.1f} ms, "
        f"p99 {_pct(late_s, 0.99) * 1e3:.1f} ms ({len(cpu_s)} wakeups)"
    )
    await store.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tier", type=Path, required=True, help="an NVMe tier's directory")
    parser.add_argument("--threads", type=int, help="scan threads (default: the tier's choice)")
    args = parser.parse_args()
    if args.threads:
        tier_module._RECOVERY_THREADS = args.threads
    collections: list[tuple[int, float]] = []
    began = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - began[0]))

    gc.callbacks.append(on_gc)
    with tempfile.TemporaryDirectory() as scratch:
        config = Config.model_validate(
            {
                "server": {"listen": f"unix://{scratch}/s.sock"},
                "dram": {"capacity_bytes": 64 << 20, "prefault": False},
                "nvme": {"path": str(args.tier), "capacity_bytes": 1 << 40},
            }
        )
        asyncio.run(_measure(config))
    full = [s for generation, s in collections if generation == 2]
    print(
        f"GC: {len(collections)} collections, longest {max(s for _, s in collections) * 1e3:.1f}"
        f" ms; {len(full)} full, longest {max(full, default=0.0) * 1e3:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
