"""`kvtier bench planner`: the planner against naive policies and the oracle, over a grid.

    kvtier bench planner [--json] [--error 0.3] [--samples 16]

Regimes: Llama-3-8B and Llama-3-70B-TP8 profiles; tiers DRAM over PCIe 5, one NVMe drive,
four NVMe drives, 25 GbE, 100 GbE, and a mixed chain (head in DRAM, tail on one NVMe);
prompts 2k-128k tokens in 512-token blocks; 25-100 % of the prompt cached; overlap none,
layer-wise and bidirectional. For each: recompute-all, fetch-all, the planner (true
parameters) and the brute-force oracle. Then the planner is fed estimates off by up to
±error (every tier's bandwidth and latency and the prefill a, c drawn independently), and
its choice is scored under the true parameters. Also times a 256-block plan.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtier.index.planner import (
    OVERLAPS,
    Family,
    Overlap,
    PlanRequest,
    PrefillCost,
    TierCost,
    cost_of,
    oracle_total,
    plan,
)
from kvtier.profiles import MODELS

TIERS: dict[str, TierCost] = {
    "dram-pcie5": TierCost(50e9, 10e-6),
    "nvme-x1": TierCost(7e9, 100e-6),
    "nvme-x4": TierCost(28e9, 100e-6),
    "25gbe": TierCost(25e9 / 8, 50e-6),
    "100gbe": TierCost(100e9 / 8, 30e-6),
}
PROMPTS = (2048, 8192, 32768, 131072)
CACHED = (0.25, 0.5, 0.75, 1.0)
BLOCK_TOKENS = 512


def regimes() -> list[tuple[str, str, PlanRequest]]:
    out = []
    for model_name in ("llama3-8b", "llama3-70b-tp8"):
        model = MODELS[model_name]
        prefill = PrefillCost(model.a_s_per_token, model.c_s_per_token2)
        for tier_name in (*TIERS, "dram+nvme-x1"):
            for prompt, cached, overlap in itertools.product(PROMPTS, CACHED, OVERLAPS):
                blocks = max(1, int(prompt * cached) // BLOCK_TOKENS)
                if tier_name == "dram+nvme-x1":
                    tiers = ["dram-pcie5"] * (blocks // 2) + ["nvme-x1"] * (blocks - blocks // 2)
                else:
                    tiers = [tier_name] * blocks
                req = PlanRequest(
                    prompt_tokens=prompt,
                    tokens_per_block=BLOCK_TOKENS,
                    kv_bytes_per_token=model.kv_bytes_per_token,
                    cached_tiers=tiers,
                    tier_costs=TIERS,
                    prefill=prefill,
                    overlap=overlap,
                    layers=model.layers,
                )
                out.append((model_name, tier_name, req))
    return out


def perturbed(req: PlanRequest, rng: random.Random, error: float) -> PlanRequest:
    def f() -> float:
        return 1 + rng.uniform(-error, error)

    tiers = {
        name: TierCost(t.bandwidth_bytes_per_s * f(), t.latency_s * f())
        for name, t in req.tier_costs.items()
    }
    pre = req.prefill
    return replace(
        req,
        tier_costs=tiers,
        prefill=PrefillCost(pre.a_s_per_token * f(), pre.c_s_per_token2 * f(), pre.step_s),
    )


def evaluate(error: float, samples: int, seed: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    rows = []
    worst_vs_naive = 0.0
    worst_vs_oracle = 0.0
    losses: list[float] = []
    worse_than_worst_naive = 0
    for model, tier, req in regimes():
        result = plan(req)
        oracle = oracle_total(req)
        naive_best = min(result.recompute_all_s, result.fetch_all_s)
        naive_worst = max(result.recompute_all_s, result.fetch_all_s)
        worst_vs_naive = max(worst_vs_naive, result.total_s / naive_best)
        worst_vs_oracle = max(worst_vs_oracle, result.total_s / oracle)
        sample_losses = []
        for _ in range(samples):
            guess = plan(perturbed(req, rng, error))
            actual = cost_of(req, guess.fetch_start, guess.fetch_end)
            sample_losses.append(actual / oracle - 1)
            if actual > naive_worst * (1 + 1e-9):
                worse_than_worst_naive += 1
        losses.extend(sample_losses)
        rows.append(
            {
                "model": model,
                "tier": tier,
                "prompt_tokens": req.prompt_tokens,
                "cached_blocks": len(req.cached_tiers),
                "overlap": req.overlap,
                "recompute_all_s": result.recompute_all_s,
                "fetch_all_s": result.fetch_all_s,
                "planner_s": result.total_s,
                "oracle_s": oracle,
                "fetched_blocks": result.fetch_blocks,
                "recomputed_front_blocks": result.recompute_front_blocks,
                "gain_vs_fetch_all": result.fetch_all_s / result.total_s,
                "median_loss_with_error": statistics.median(sample_losses),
                "max_loss_with_error": max(sample_losses),
            }
        )
    return {
        "regimes": len(rows),
        "max_planner_vs_best_naive": worst_vs_naive,
        "max_planner_vs_oracle": worst_vs_oracle,
        "error": error,
        "samples_per_regime": samples,
        "median_loss_vs_oracle_with_error": statistics.median(losses),
        "p99_loss_vs_oracle_with_error": sorted(losses)[int(0.99 * len(losses))],
        "max_loss_vs_oracle_with_error": max(losses),
        "choices_worse_than_worse_naive": worse_than_worst_naive,
        "rows": rows,
    }


def time_plans(repeat: int = 300, family: Family = "any") -> dict[str, float]:
    """p50 seconds of planning a 256-block chain (mixed DRAM/NVMe), per overlap mode."""
    model = MODELS["llama3-8b"]
    out: dict[str, float] = {}
    for overlap in OVERLAPS:
        req = PlanRequest(
            prompt_tokens=256 * 16,
            tokens_per_block=16,
            kv_bytes_per_token=model.kv_bytes_per_token,
            cached_tiers=["dram-pcie5"] * 128 + ["nvme-x1"] * 128,
            tier_costs=TIERS,
            prefill=PrefillCost(model.a_s_per_token, model.c_s_per_token2),
            overlap=overlap,
            family=family,
            run_latency_s=200e-6 if family == "prefix" else 0.0,
        )
        xs = []
        for _ in range(repeat):
            started = time.perf_counter()
            plan(req)
            xs.append(time.perf_counter() - started)
        out[overlap] = statistics.median(xs)
    return out


def time_plan_rpc(repeat: int = 300) -> dict[str, dict[str, float]]:
    """p50 seconds of a Plan for a 256-block chain (half of it cached) from a client on the
    same node: through `Client.plan` (the attached session's socket) and as a plain gRPC
    call over the UDS (what a client without the zero-copy session pays)."""
    import tempfile
    from pathlib import Path

    import kvtier
    from kvtier.bench.daemon import daemon
    from kvtier.client._common import plan_request

    out: dict[str, dict[str, float]] = {"session": {}, "grpc": {}}
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp,
        daemon(Path(tmp), "uds", 64 << 20) as target,
        kvtier.Client(target) as client,
    ):
        client.wait_ready()
        chain = kvtier.chain_keys("llama3-8b/bench", [[i] for i in range(256)])
        for i in range(0, 256, 2):
            client.put("llama3-8b/bench", chain[i], b"x" * 4096)
        for overlap in OVERLAPS:
            request = plan_request("llama3-8b/bench", chain, 16, 0, overlap, None, None)

            def via_session(o: Overlap = overlap) -> object:
                return client.plan("llama3-8b/bench", chain, 16, overlap=o)

            def via_grpc(r: Any = request) -> object:
                return client._stub.Plan(r, timeout=10)

            calls: dict[str, Callable[[], object]] = {"session": via_session, "grpc": via_grpc}
            for path, call in calls.items():
                xs = []
                for _ in range(repeat):
                    started = time.perf_counter()
                    call()
                    xs.append(time.perf_counter() - started)
                out[path][overlap] = statistics.median(xs)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvtier bench planner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--error", type=float, default=0.3, help="estimate error, e.g. 0.3")
    parser.add_argument("--samples", type=int, default=16, help="perturbed plans per regime")
    parser.add_argument("--rpc", action="store_true", help="also time the Plan RPC over UDS")
    parser.add_argument(
        "--real-tiers",
        type=int,
        default=0,
        metavar="N",
        help="also fetch N runs of blocks (sizes x queue depths) from a daemon's DRAM tier "
        "and N from its NVMe tier, comparing each with the fetch time its plan predicted",
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the --real-tiers daemon keeps its NVMe tier"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = evaluate(args.error, args.samples)
    report["plan_p50_s_256_blocks"] = time_plans()
    # What the vLLM connector asks for (family "prefix", priced with a run latency).
    report["plan_p50_s_256_blocks_prefix"] = time_plans(family="prefix")
    if args.rpc:
        report["plan_rpc_p50_s_256_blocks"] = time_plan_rpc()
    if args.real_tiers:
        from kvtier.bench.real_tiers import check_real_tiers

        report["real_tiers"] = check_real_tiers(args.real_tiers, args.dir)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['regimes']} regimes")
    print(f"planner / min(recompute-all, fetch-all): max {report['max_planner_vs_best_naive']:.4f}")
    print(f"planner / oracle (true parameters):      max {report['max_planner_vs_oracle']:.6f}")
    print(
        f"with ±{args.error:.0%} estimate error ({args.samples} draws per regime): loss vs "
        f"oracle median {report['median_loss_vs_oracle_with_error']:.2%}, p99 "
        f"{report['p99_loss_vs_oracle_with_error']:.2%}, max "
        f"{report['max_loss_vs_oracle_with_error']:.2%}; choices worse than the worse naive "
        f"policy: {report['choices_worse_than_worse_naive']}"
    )
    for overlap, seconds in report["plan_p50_s_256_blocks"].items():
        prefix_s = report["plan_p50_s_256_blocks_prefix"][overlap]
        print(
            f"256-block plan, {overlap}: p50 {seconds * 1e6:.0f} µs "
            f"(family prefix: {prefix_s * 1e6:.0f} µs)"
        )
    for tier, figures in (
        (t, report["real_tiers"][t]) for t in ("dram", "nvme") if "real_tiers" in report
    ):
        print(
            f"{tier} tier, {report['real_tiers']['runs_per_tier']} fetched runs: |predicted - "
            f"measured| / measured p50 {figures['median_abs_error']:.1%}, p90 "
            f"{figures['p90_abs_error']:.1%} (second half p50 "
            f"{figures['median_abs_error_second_half']:.1%}, p90 "
            f"{figures['p90_abs_error_second_half']:.1%}; noise floor p50 "
            f"{figures['hindsight_cell_median_p50_abs_error']:.1%}, p90 "
            f"{figures['hindsight_cell_median_p90_abs_error']:.1%})"
        )
        for cell, by in figures["by_size_and_depth"].items():
            print(
                f"  {cell}: median predicted {by['median_predicted_s'] * 1e3:.2f} ms, "
                f"measured {by['median_measured_s'] * 1e3:.2f} ms, p90 error "
                f"{by['p90_abs_error']:.1%}"
            )
        held = figures.get("held_out")
        if held is not None:
            print(
                f"  held out ({report['real_tiers']['held_out_runs_per_tier']} runs of sizes "
                f"and depths not above): p50 {held['median_abs_error']:.1%}, p90 "
                f"{held['p90_abs_error']:.1%} (noise floor p50 "
                f"{held['hindsight_cell_median_p50_abs_error']:.1%}, p90 "
                f"{held['hindsight_cell_median_p90_abs_error']:.1%})"
            )
    for path, by_overlap in report.get("plan_rpc_p50_s_256_blocks", {}).items():
        for overlap, seconds in by_overlap.items():
            print(f"256-block Plan from a client ({path}), {overlap}: p50 {seconds * 1e6:.0f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
