"""Loading a prefix layer by layer: when the first layer is usable, grouped get vs one call.

A real daemon with `gpu.emulate` (the GPU path on its CPU stand-in; a shared-memory file
is the engine's KV memory) holds chains of `--layers` x `--blocks-per-layer` blocks on
NVMe only (stored, then the daemon restarted). Each round reads two fresh chains into the
engine's memory, in alternating order: one with a single `get_into_cuda` (the engine can
use nothing until every layer is in), one with `start_get_into_cuda(group_sizes=...)`
(every layer's copies start at once; the engine waits for layer i before running it).
Reported, medians over rounds: the time until layer 0 is usable and until every layer is,
for both, and their ratios. What it shows is the daemon's side (leases, NVMe reads, the
session round trips); on a GPU the copies themselves are faster still.

    python benchmarks/cuda_layers.py [--layers 32] [--blocks-per-layer 2]
        [--block-bytes 128KiB] [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _daemon  # benchmarks/_daemon.py

import kvtier
from kvtier.sizes import parse_size

NS = "llama3-8b/layers"
EMULATE = {"KVTIER_GPU__EMULATE": "true"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks-per-layer", type=int, default=2)
    ap.add_argument("--block-bytes", default="128KiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    block = parse_size(args.block_bytes)
    per_chain = args.layers * args.blocks_per_layer
    chain_bytes = per_chain * block
    groups = [args.blocks_per_layer] * args.layers
    slices = [(i * block, block) for i in range(per_chain)]
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-layers-", dir="/dev/shm"))
    memory = workdir / "engine-kv.bin"
    memory.write_bytes(os.urandom(chain_bytes))
    handle = str(memory).encode()
    chains = [
        [f"r{r}-{mode}-{i}".encode() for i in range(per_chain)]
        for r in range(args.rounds)
        for mode in ("one", "grouped")
    ]
    proc, target = _daemon.start(workdir, EMULATE, "4GiB")
    try:
        with kvtier.Client(target) as engine:
            buf = engine.register_cuda_handle(0, handle, 0, chain_bytes)
            for keys in chains:
                assert all(engine.put_from_cuda(NS, keys, buf, slices))
        _daemon.stop(proc)
        proc, target = _daemon.start(workdir, EMULATE, "4GiB")  # every block on NVMe only now
        first: dict[str, list[float]] = {"one": [], "grouped": []}
        whole: dict[str, list[float]] = {"one": [], "grouped": []}
        with kvtier.Client(target) as engine:
            buf = engine.register_cuda_handle(0, handle, 0, chain_bytes)
            for r in range(args.rounds):
                order = ("one", "grouped") if r % 2 == 0 else ("grouped", "one")
                for mode in order:
                    keys = chains[2 * r + (mode == "grouped")]
                    started = time.perf_counter()
                    if mode == "one":
                        assert all(engine.get_into_cuda(NS, keys, buf, slices))
                        first[mode].append(time.perf_counter() - started)
                    else:
                        pending = engine.start_get_into_cuda(NS, keys, buf, slices, groups)
                        for layer in range(args.layers):
                            assert all(pending.wait(layer))
                            if layer == 0:
                                first[mode].append(time.perf_counter() - started)
                    whole[mode].append(time.perf_counter() - started)
    finally:
        _daemon.stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)
    med = {
        k: {m: statistics.median(v[m]) for m in v} for k, v in (("first", first), ("all", whole))
    }
    result: dict[str, Any] = {
        "layers": args.layers,
        "blocks_per_layer": args.blocks_per_layer,
        "block_bytes": block,
        "rounds": args.rounds,
        "first_layer_s": med["first"],
        "all_layers_s": med["all"],
        "first_layer_ratio": med["first"]["grouped"] / med["first"]["one"],
        "all_layers_ratio": med["all"]["grouped"] / med["all"]["one"],
    }
    print(
        f"{args.layers} layers x {args.blocks_per_layer} x {args.block_bytes}, from NVMe, "
        f"median of {args.rounds}:\n"
        f"  first layer usable: grouped {med['first']['grouped'] * 1e3:.1f} ms, "
        f"one call {med['first']['one'] * 1e3:.1f} ms ({result['first_layer_ratio']:.2f}x)\n"
        f"  every layer in:     grouped {med['all']['grouped'] * 1e3:.1f} ms, "
        f"one call {med['all']['one'] * 1e3:.1f} ms ({result['all_layers_ratio']:.2f}x)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
