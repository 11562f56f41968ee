"""The packed policies (kvtier/index/packed_policy.py) against policy.py's: the same replay
figures, and what a block costs in memory, garbage-collector objects and time.

    python benchmarks/packed_policy.py [--trace T] [--blocks 1000000] [--skip-replay]
        [--json out.json]

1. Replay: `kvtier replay T --dram-capacity 5000 --admission write_back` per policy, with
   policy.py's policies, with packed tier orders only (kvtier/sim/packed.py: policy.py's
   sketch, estimate and ghosts), and with everything packed: the report fields that
   differ from the first run (none expected) and each run's seconds.
2. Per policy, one tier of `--blocks` blocks in chains of 64 (4 KiB, parent = the block
   before): bytes per block held (tracemalloc, after inserting all, hitting half of them
   at random and evicting a tenth; block ids and, for policy.py, each block's BlockInfo
   made beforehand, as the catalog and the store's chain table hold them), objects the
   collector tracks per block, one full `gc.collect()` with the tier alive, and µs per
   insert / hit / victim (untraced, a second run). The value policy runs as DRAM's (its
   saving does not depend on position, so a chain's blocks tie and an insert raises no
   ancestor) and, at a tenth of the blocks, as NVMe's (a later block is worth more: each
   insert raises its whole chain, the costly case).
3. The same for what is remembered of blocks by key: ghosts and the reuse estimate at
   `--blocks` keys, and the use-count sketch (fixed size).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import kvtier.sim.replay as replay_module
from kvtier.index.packed_policies import PackedGhosts, PackedReuse
from kvtier.index.packed_policy import (
    NO_SLOT,
    DigestSketch,
    PackedLru,
    PackedS3Fifo,
    PackedValue,
    SlotPolicy,
)
from kvtier.index.planner import PrefillCost, TierCost
from kvtier.index.policy import (
    BlockInfo,
    FrequencySketch,
    Ghosts,
    LruPolicy,
    ReuseEstimator,
    S3FifoPolicy,
    TierPolicy,
    ValueModel,
    ValuePolicy,
)
from kvtier.index.slots import key_digest
from kvtier.profiles import MODELS
from kvtier.sim.packed import KeyedPolicies
from kvtier.sim.replay import ReplayConfig, read_trace, replay

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"
FIELDS = (
    "prefill_seconds_saved",
    "block_hit_ratio",
    "nvme_bytes_written",
    "lost_reuse",
    "promotions",
    "fetch_regret_seconds",
)
CHAIN = 64
SIZE = 4096
PROFILE = MODELS["llama3-8b"]
MODEL = ValueModel(
    16,
    PROFILE.kv_bytes_per_token,
    PrefillCost(PROFILE.a_s_per_token, PROFILE.c_s_per_token2),
    {"dram": TierCost(50e9, 10e-6), "nvme": TierCost(7e9, 100e-6)},
)


def replays(trace: Path) -> list[dict[str, Any]]:
    requests = read_trace(trace)
    rows = []
    for policy in ("lru", "s3fifo", "kvtier"):
        config = ReplayConfig(5000, 20000, policy=policy, admission="write_back")
        runs: dict[str, tuple[dict[str, Any], float]] = {}
        for mode in ("policy.py", "packed tiers", "packed all"):
            factory = (
                replay_module.Policies
                if mode == "policy.py"
                else functools.partial(KeyedPolicies, packed_counts=mode == "packed all")
            )
            start = time.process_time()
            with mock.patch.object(replay_module, "Policies", factory):
                report, _ = replay(config, requests)
            runs[mode] = report, time.process_time() - start
        base = runs["policy.py"][0]
        for mode, (report, seconds) in runs.items():
            rows.append(
                {
                    "policy": policy,
                    "mode": mode,
                    "prefill_seconds_saved": report["prefill_seconds_saved"],
                    "relative": report["prefill_seconds_saved"] / base["prefill_seconds_saved"] - 1,
                    "fields_differing": [k for k in FIELDS if report[k] != base[k]],
                    "whole_report_equal": report == base,
                    "seconds": seconds,
                }
            )
    return rows


# ---- one tier at N blocks ---------------------------------------------------------------


def _old_tier(kind: str, tier: str, sketch: FrequencySketch) -> TierPolicy:
    if kind == "lru":
        return LruPolicy()
    if kind == "s3fifo":
        return S3FifoPolicy(1 << 50)
    return ValuePolicy(tier, "nvme" if tier == "dram" else None, MODEL, sketch)


def _new_tier(kind: str, tier: str, digests: list[int], sketch: DigestSketch) -> SlotPolicy:
    if kind == "lru":
        return PackedLru()
    if kind == "s3fifo":
        return PackedS3Fifo(1 << 50, digests.__getitem__)
    return PackedValue(
        tier,
        "nvme" if tier == "dram" else None,
        MODEL,
        lambda slot: sketch.count(digests[slot]),
    )


def _workload(blocks: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    hits = rng.sample(range(blocks), blocks // 2)
    pins = [rng.randrange(blocks) for _ in range(64)]
    return hits, pins


def _drive(
    insert: Callable[[int], None],
    hit: Callable[[int], None],
    victim: Callable[[], object],
    blocks: int,
    hits: list[int],
) -> dict[str, float]:
    start = time.process_time()
    for i in range(blocks):
        insert(i)
    inserted = time.process_time()
    for i in hits:
        hit(i)
    hit_done = time.process_time()
    for _ in range(blocks // 10):
        victim()
    end = time.process_time()
    return {
        "insert_us": (inserted - start) / blocks * 1e6,
        "hit_us": (hit_done - inserted) / len(hits) * 1e6,
        "victim_us": (end - hit_done) / (blocks // 10) * 1e6,
    }


def _run(
    kind: str,
    impl: str,
    tier: str,
    blocks: int,
    ids: list[tuple[str, bytes]],
    infos: list[BlockInfo],
    digests: list[int],
    sketches: tuple[FrequencySketch, DigestSketch],
    hits: list[int],
    pins: list[int],
) -> tuple[object, dict[str, float]]:
    """Insert every block, hit half, evict a tenth (a few pinned); the tier and timings."""
    if impl == "policy.py":
        old = _old_tier(kind, tier, sketches[0])
        pinned = {ids[i] for i in pins}
        return old, _drive(
            lambda i: old.insert(ids[i], infos[i]),
            lambda i: old.hit(ids[i]),
            lambda: old.victim(lambda k: k not in pinned),
            blocks,
            hits,
        )
    new = _new_tier(kind, tier, digests, sketches[1])
    pinned_slots = set(pins)
    return new, _drive(
        lambda i: new.insert(i, SIZE, i % CHAIN, i - 1 if i % CHAIN else NO_SLOT),
        new.hit,
        lambda: new.victim(lambda s: s not in pinned_slots),
        blocks,
        hits,
    )


def _gc_s() -> float:
    """CPU seconds of one full collection (best of three)."""
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        gc.collect()
        best = min(best, time.process_time() - start)
    return best


def measure_tier(kind: str, impl: str, tier: str, blocks: int) -> dict[str, Any]:
    """Memory (traced run) and time (untraced run) of one tier's order at `blocks`."""
    hits, pins = _workload(blocks, 1)
    ids = [("bench|ns", i.to_bytes(8, "little")) for i in range(blocks)]
    old_sketch, new_sketch = FrequencySketch(), DigestSketch()
    digests = [key_digest(b) for b in ids]
    for i in range(0, blocks, 3):  # some blocks used more than once
        old_sketch.add(ids[i])
        new_sketch.add(digests[i])
    infos = (
        [
            BlockInfo(SIZE, i % CHAIN, ids[i - 1] if i % CHAIN else None, CHAIN - 1 - i % CHAIN)
            for i in range(blocks)
        ]
        if impl == "policy.py"
        else []
    )
    sketches = old_sketch, new_sketch
    out: dict[str, Any] = {"policy": kind, "impl": impl, "tier": tier, "blocks": blocks}
    for traced in (True, False):
        gc.collect()
        if traced:
            tracemalloc.start()
        objects_before = len(gc.get_objects())
        before = tracemalloc.get_traced_memory()[0] if traced else 0
        held, figures = _run(kind, impl, tier, blocks, ids, infos, digests, sketches, hits, pins)
        if traced:
            gc.collect()
            out["bytes_per_block"] = (tracemalloc.get_traced_memory()[0] - before) / blocks
            tracemalloc.stop()
            out["gc_objects_per_block"] = (len(gc.get_objects()) - objects_before) / blocks
            del held
        else:
            out.update(figures)
            out["full_gc_s"] = _gc_s()
            del held
            out["full_gc_s"] -= _gc_s()  # what the tier adds to one full collection
    return out


def measure_remembered(impl: str, keys: int) -> dict[str, Any]:
    """Ghosts and the reuse estimate holding `keys` keys, and the sketch."""
    ids = [("bench|ns", i.to_bytes(8, "little")) for i in range(keys)]
    digests = [key_digest(b) for b in ids]
    info = BlockInfo(SIZE, 3, None, 2)
    out: dict[str, Any] = {"impl": impl, "keys": keys}
    for name in ("ghosts", "reuse", "sketch"):
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        objects_before = len(gc.get_objects())
        start = time.process_time()
        held: object
        if impl == "policy.py":
            if name == "ghosts":
                ghosts = Ghosts(keys)
                for b in ids:
                    ghosts.add(b)
                held = ghosts
            elif name == "reuse":
                reuse = ReuseEstimator(keys)
                for b in ids:
                    reuse.observe(b, 1, info)
                held = reuse
            else:
                sketch = FrequencySketch()
                for b in ids:
                    sketch.add(b)
                held = sketch
        elif name == "ghosts":
            packed_ghosts = PackedGhosts(keys)
            for d in digests:
                packed_ghosts.add(d)
            held = packed_ghosts
        elif name == "reuse":
            packed_reuse = PackedReuse(keys)
            for d in digests:
                packed_reuse.observe(d, 1, 2)
            held = packed_reuse
        else:
            packed_sketch = DigestSketch()
            for d in digests:
                packed_sketch.add(d)
            held = packed_sketch
        seconds = time.process_time() - start  # traced: compare within this table only
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        out[name] = {
            "bytes_per_key": grown / keys if name != "sketch" else None,
            "bytes": grown,
            "gc_objects_per_key": (len(gc.get_objects()) - objects_before) / keys,
            "traced_us_per_op": seconds / keys * 1e6,
        }
        del held
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--json", type=Path, help="write every figure here too")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    if not args.skip_replay:
        results["replay"] = replays(args.trace)
        print("replay (--dram-capacity 5000 --admission write_back): prefill seconds saved")
        for row in results["replay"]:
            print(
                f"  {row['policy']:<7} {row['mode']:<13} {row['prefill_seconds_saved']:12.6f} "
                f"({row['relative']:+.2e})  report equal: {row['whole_report_equal']}  "
                f"{row['seconds']:5.1f} s",
                flush=True,
            )
    results["tiers"] = []
    print(f"one tier, {args.blocks} blocks (value policy as NVMe's at a tenth):")
    print(
        f"  {'policy':<7} {'impl':<10} {'tier':<5} {'blocks':>8} {'B/block':>8} "
        f"{'objs/block':>10} {'full gc':>8} {'insert':>8} {'hit':>8} {'victim':>8}"
    )
    for kind, tier, blocks in (
        ("lru", "dram", args.blocks),
        ("s3fifo", "dram", args.blocks),
        ("kvtier", "dram", args.blocks),
        ("kvtier", "nvme", args.blocks // 10),
    ):
        for impl in ("policy.py", "packed"):
            row = measure_tier(kind, impl, tier, blocks)
            results["tiers"].append(row)
            print(
                f"  {kind:<7} {impl:<10} {tier:<5} {blocks:>8} {row['bytes_per_block']:>8.1f} "
                f"{row['gc_objects_per_block']:>10.3f} {row['full_gc_s'] * 1e3:>6.0f}ms "
                f"{row['insert_us']:>6.2f}us {row['hit_us']:>6.2f}us {row['victim_us']:>6.2f}us",
                flush=True,
            )
    results["remembered"] = [measure_remembered(i, args.blocks) for i in ("policy.py", "packed")]
    print(f"remembered by key, {args.blocks} keys (bytes per key; the sketch: bytes in all):")
    for row in results["remembered"]:
        print(
            f"  {row['impl']:<10} ghosts {row['ghosts']['bytes_per_key']:6.1f} "
            f"({row['ghosts']['gc_objects_per_key']:.3f} objs/key)  reuse "
            f"{row['reuse']['bytes_per_key']:6.1f} ({row['reuse']['gc_objects_per_key']:.3f})  "
            f"sketch {row['sketch']['bytes'] / 1024:7.0f} KiB",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
