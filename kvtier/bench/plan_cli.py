"""`kvtier plan --what-if`: the planner from the command line, without a daemon.

    kvtier plan --what-if --model llama3-8b --prompt-tokens 32768 --tokens-per-block 512 \\
        --cached nvme=56 --bandwidth nvme=7e9 --latency nvme=100e-6 --overlap layerwise --json

`--cached TIER=NBLOCKS` is repeatable and lists the chain's head first (`--cached dram=8
--cached nvme=48`: blocks 0-7 in DRAM, 8-55 on NVMe). Bandwidths are bytes per second
(`7e9`, or `7GB/s`, `25Gbit/s`). Explicit `--kv-bytes-per-token`, `--prefill-a`,
`--prefill-c` override the model profile.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from kvtier.index.planner import OVERLAPS, Plan, PlanRequest, PrefillCost, TierCost, plan
from kvtier.profiles import MODELS
from kvtier.sizes import parse_size

_RATE_RE = re.compile(r"^\s*([\d.eE+-]+)\s*([A-Za-z]*?)(bit)?(/s)?\s*$")


def parse_rate(text: str) -> float:
    """Bytes per second from '7e9', '7GB/s', '3.2GiB/s' or '25Gbit/s'."""
    match = _RATE_RE.match(text)
    if not match:
        raise ValueError(f"cannot read bandwidth {text!r}: write bytes/s, e.g. 7e9 or 7GB/s")
    number, unit, bits = match.group(1), match.group(2), match.group(3)
    try:
        value = float(number) * (parse_size(f"1{unit}") if unit else 1)
    except ValueError:
        raise ValueError(f"cannot read bandwidth {text!r}: unknown unit {unit!r}") from None
    return value / 8 if bits else value


def _pairs(items: list[str], what: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{what} takes TIER=VALUE, got {item!r}")
        out.append((name, value))
    return out


def plan_dict(result: Plan) -> dict[str, Any]:
    """The plan as the documented JSON (what `--json` prints)."""
    return {
        "overlap": result.overlap,
        "total_s": result.total_s,
        "recompute_all_s": result.recompute_all_s,
        "fetch_all_s": result.fetch_all_s,
        "engine_blocks": result.engine_blocks,
        "recompute_front_blocks": result.recompute_front_blocks,
        "fetch_start": result.fetch_start,
        "fetch_blocks": result.fetch_blocks,
        "reason": result.reason,
        "blocks": [
            {
                "index": b.index,
                "action": b.action,
                "tier": b.tier,
                "fetch_s": b.fetch_s,
                "recompute_s": b.recompute_s,
            }
            for b in result.blocks
        ],
    }


def build_request(args: argparse.Namespace) -> PlanRequest:
    profile = MODELS[args.model] if args.model else None
    kv = args.kv_bytes_per_token or (profile.kv_bytes_per_token if profile else None)
    a = (
        args.prefill_a
        if args.prefill_a is not None
        else (profile.a_s_per_token if profile else None)
    )
    c = (
        args.prefill_c
        if args.prefill_c is not None
        else (profile.c_s_per_token2 if profile else None)
    )
    if kv is None or a is None or c is None:
        raise ValueError("give --model, or --kv-bytes-per-token, --prefill-a and --prefill-c")
    tiers: list[str | None] = []
    for tier, count in _pairs(args.cached, "--cached"):
        tiers += [tier] * int(count)
    bandwidths = {t: parse_rate(v) for t, v in _pairs(args.bandwidth, "--bandwidth")}
    latencies = {t: float(v) for t, v in _pairs(args.latency, "--latency")}
    missing = sorted({t for t in tiers if t is not None} - set(bandwidths))
    if missing:
        raise ValueError(f"give --bandwidth for tier(s) {', '.join(map(str, missing))}")
    return PlanRequest(
        prompt_tokens=args.prompt_tokens,
        tokens_per_block=args.tokens_per_block,
        kv_bytes_per_token=int(kv),
        cached_tiers=tiers,
        tier_costs={t: TierCost(bw, latencies.get(t, 0.0)) for t, bw in bandwidths.items()},
        prefill=PrefillCost(a, c, args.prefill_step),
        engine_cached_blocks=args.engine_cached_blocks,
        overlap=args.overlap,
        layers=args.layers or (profile.layers if profile else 32),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--what-if",
        action="store_true",
        required=True,
        help="plan from the given figures, without a daemon",
    )
    p.add_argument("--model", choices=sorted(MODELS), help="KV size and prefill profile")
    p.add_argument("--kv-bytes-per-token", type=int)
    p.add_argument("--prefill-a", type=float, help="seconds per token (linear part)")
    p.add_argument("--prefill-c", type=float, help="seconds per token per position")
    p.add_argument("--prefill-step", type=float, default=0.0, help="fixed seconds per prefill")
    p.add_argument("--tokens-per-block", type=int, required=True)
    p.add_argument("--prompt-tokens", type=int, required=True)
    p.add_argument("--engine-cached-blocks", type=int, default=0)
    p.add_argument("--cached", action="append", default=[], metavar="TIER=NBLOCKS")
    p.add_argument("--bandwidth", action="append", default=[], metavar="TIER=BYTES_PER_S")
    p.add_argument("--latency", action="append", default=[], metavar="TIER=SECONDS")
    p.add_argument("--overlap", choices=OVERLAPS, default="none")
    p.add_argument("--layers", type=int, help="for the layer-wise pipeline fill")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    result = plan(build_request(args))
    if args.json:
        print(json.dumps(plan_dict(result), indent=2))
        return 0
    print(f"plan ({result.overlap}): {result.total_s * 1e3:.1f} ms — {result.reason}")
    print(
        f"  recompute-all {result.recompute_all_s * 1e3:.1f} ms, "
        f"fetch-all {result.fetch_all_s * 1e3:.1f} ms"
    )
    print(
        f"  blocks: {result.engine_blocks} held by the engine, "
        f"{result.recompute_front_blocks} recomputed first, {result.fetch_blocks} fetched "
        f"from block {result.fetch_start}, "
        f"{len(result.blocks) - result.fetch_end} recomputed after"
    )
    return 0
