#!/usr/bin/env python3
"""Time to first token of real vLLM (CPU) with and without kvtier, through the planner.

    python benchmarks/vllm_ttft.py [--prompts 4] [--prompt-tokens 3072] [--json OUT]

Needs `make vllm-env`. Builds a small Llama offline (8 layers, hidden 512), then, each
scenario in a fresh vLLM process (its own warm-up first, so one-time costs and the
daemon's prefill estimate are settled before anything is timed), TTFT of every prompt
(a one-token generation, vLLM's prefix cache reset before each):

- cold: no connector;
- kvtier-DRAM: the prompts' blocks (stored by an earlier engine) in the daemon's DRAM;
- kvtier-NVMe: the daemon restarted (a clean stop writes DRAM out): blocks only on NVMe;
- NVMe throttled (every NVMe read delayed `--throttle-s`, as a saturated or remote drive):
  with the planner deciding ("plan") and, for comparison, loading every cached block
  ("always", what a hit-only connector does).

Prints medians and ratios to cold (same run), and what the planner chose.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kvtier

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
KVTIER = ROOT / ".venv" / "bin" / "kvtier"
DRIVER = ROOT / "tests" / "integration" / "vllm_driver.py"


class Daemon:
    def __init__(self, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.sock = workdir / "kvtier.sock"
        self.target = f"unix://{self.sock}"
        self.nvme = workdir / "nvme"
        self.log = workdir / "daemon.log"
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        cmd = [str(KVTIER), "serve", "--listen", self.target, "--dram-capacity", "512MiB"]
        cmd += ["--nvme-path", str(self.nvme), "--nvme-capacity", "4GiB"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=log, env={**os.environ, **self.env}
            )
        deadline = time.monotonic() + 60
        while not self.sock.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"daemon did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        time.sleep(0.5)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)
            self.proc = None

    def stats(self) -> kvtier.Stats:
        with kvtier.Client(self.target) as client:
            return client.stats()


def run(
    model: Path, prompts: Path, out: Path, warmup: int, target: str = "", fetch: str = "plan"
) -> list[dict[str, Any]]:
    cmd = [str(VLLM_PYTHON), str(DRIVER), "generate", "--model", str(model)]
    cmd += ["--prompts", str(prompts), "--out", str(out), "--max-tokens", "1"]
    cmd += ["--warmup", str(warmup), "--fetch", fetch]
    if target:
        cmd += ["--target", target]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"vLLM failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    results: list[dict[str, Any]] = json.loads(out.read_text())["results"]
    return results


def summary(results: list[dict[str, Any]], cold_s: float | None) -> dict[str, Any]:
    ttft = [r["elapsed_s"] for r in results]
    median = statistics.median(ttft)
    return {
        "ttft_median_s": median,
        "ttft_s": ttft,
        "tokens_from_kvtier": [r["num_cached_tokens"] for r in results],
        "vs_cold": median / cold_s if cold_s else 1.0,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=3072)
    parser.add_argument(
        "--throttle-s",
        type=float,
        nargs="+",
        default=[0.25, 1.0, 4.0],
        help="delays per NVMe read",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="throwaway prompts per engine (>= 9: the "
        "daemon uses its own prefill estimate after 8 reports, the first is not reported)",
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.exists():
        raise SystemExit("real vLLM is not installed: run `make vllm-env` first")

    work = Path(tempfile.mkdtemp(prefix="kvtier-ttft-"))
    model = work / "model"
    shape = ["--layers", str(args.layers), "--hidden", str(args.hidden)]
    subprocess.run(
        [str(VLLM_PYTHON), str(DRIVER), "build-model", str(model), *shape],
        check=True,
        capture_output=True,
    )
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    prompts = [
        [rng.randrange(4, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)
    ]
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))

    rows: dict[str, dict[str, Any]] = {}
    print("cold ...", file=sys.stderr)
    cold = summary(run(model, prompts_file, work / "cold.json", args.warmup), None)
    rows["cold (no connector)"] = cold
    daemon = Daemon(work).start()
    try:
        print("storing ...", file=sys.stderr)
        run(model, prompts_file, work / "store.json", args.warmup, daemon.target)
        print("kvtier-DRAM ...", file=sys.stderr)
        rows["kvtier, blocks in DRAM"] = summary(
            run(model, prompts_file, work / "dram.json", args.warmup, daemon.target),
            cold["ttft_median_s"],
        )
        daemon.stop()  # writes DRAM out: the blocks are on NVMe only after the restart
        daemon.start()
        print("kvtier-NVMe ...", file=sys.stderr)
        rows["kvtier, blocks on NVMe"] = summary(
            run(model, prompts_file, work / "nvme.json", args.warmup, daemon.target),
            cold["ttft_median_s"],
        )
        for throttle_s in args.throttle_s:
            for fetch in ("plan", "always"):
                daemon.stop()
                # Promoted blocks went to DRAM: a clean stop writes them out again.
                daemon.env = {"KVTIER_FAILPOINTS": f"nvme.read=delay:{throttle_s}"}
                daemon.start()
                print(f"NVMe +{throttle_s} s/read, fetch={fetch} ...", file=sys.stderr)
                label = f"kvtier, NVMe +{throttle_s * 1e3:.0f} ms/read, " + (
                    "planner decides" if fetch == "plan" else "always fetch (hit-only baseline)"
                )
                rows[label] = summary(
                    run(
                        model,
                        prompts_file,
                        work / f"nvme-{throttle_s}-{fetch}.json",
                        args.warmup,
                        daemon.target,
                        fetch,
                    ),
                    cold["ttft_median_s"],
                )
                stats = daemon.stats()
                rows[label]["daemon"] = {
                    k: stats[k]
                    for k in ("planned_fetch_blocks", "planned_recompute_blocks", "promotions")
                }
    finally:
        daemon.stop()

    kv_bytes_per_token = args.layers * 2 * 2 * (args.hidden // 4) * 2
    print(
        f"\nvLLM {args.prompts} prompts x {args.prompt_tokens} tokens, tiny Llama "
        f"{args.layers} layers hidden {args.hidden} bf16 ({kv_bytes_per_token} KV bytes/token), "
        f"CPU backend, 1 thread; each engine ran {args.warmup} throwaway prompts first"
    )
    print(f"{'scenario':58} {'TTFT median':>12} {'vs cold':>8}  tokens from kvtier")
    for name, row in rows.items():
        print(
            f"{name:58} {row['ttft_median_s'] * 1e3:10.0f} ms {row['vs_cold']:8.2f}  "
            f"{row['tokens_from_kvtier']}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
