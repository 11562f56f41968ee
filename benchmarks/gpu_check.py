"""GPU figures for the GPU issue, each against its baseline measured in the same run.

    python benchmarks/gpu_check.py [--size 256MiB] [--arena 16GiB] [--nvme-dir DIR]
        [--json FILE] [--gpu-tests-rc N]

scripts/gpu_check.sh runs it after the `gpu` tests (and passes their exit status).

Rows (kvtier | baseline; target):
  h2d, d2h     Mover copies from/to the pinned DRAM arena | torch pinned-memory copies
               (torch.empty(pin_memory=True), copy_(non_blocking=True)); >= 0.8x
  d2d via IPC  Mover copy out of a tensor another process shared by CUDA IPC | a plain
               device-to-device copy of local tensors; >= 0.8x
  nvme->gpu    StagedUpload of NVMe records into GPU memory | the same records read into
               pinned memory alone (same reads, same order); >= 0.8x
  arena pin    first touch + cudaHostRegister of the arena | torch.empty(pin_memory=True)
               of the same size (cudaHostAlloc); reported (lower is better)
  overlap      a bf16 matmul loop while the movers copy both ways | the loop alone;
               slowdown <= 10 %
  engine e2e   examples/transformers_prefix_cache.py --device cuda against a real daemon
               serving the GPU (CUDA IPC both ways), on a Llama built offline: passed
               (bit-exact KV, same tokens), and its time to first token from kvtier's
               cache | recomputing the prompt (reported; < 1 is kvtier faster)

Writes the figures as JSON (default docs/bench/<date>-gpu-check.json) with the keys
device, h2d_ratio, d2h_ratio, d2d_ipc_ratio, nvme_gpu_ratio, matmul_slowdown (a
fraction), engine_e2e {engine, passed, ttft_ratio}, arena_pin_s, gpu_tests_passed,
targets_met and the rows; and the table, in Markdown for BENCHMARKS.md, beside it
(.md). A row that fails is kept, with its error, and the rest still run: a GPU host is
lent for minutes. Installs nothing (GPU hosts may have no network): it needs torch with
CUDA, cupy (the daemon's CUDA IPC), transformers, xxhash and kvtier's own dependencies
(scripts/gpu_check.sh lists them and installs the carried wheels). Prints the table last.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _daemon  # benchmarks/_daemon.py
import torch
import torch.multiprocessing as mp
import xxhash

from kvtier.movers.cuda import Mover, StagedUpload, TorchDevice
from kvtier.movers.io import IoPool
from kvtier.movers.pinned import pin, unregister
from kvtier.sizes import human_size, parse_size
from kvtier.tiers.dram import DramTier
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for

REPEATS = 7
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "transformers_prefix_cache.py"
DRIVER = ROOT / "tests" / "integration" / "vllm_driver.py"
# The engine end to end: a Llama-shaped model (head_dim 128, GQA) whose prefill of the
# prompt costs something on an H200, and a prefix of 30 blocks of 128 tokens.
E2E_MODEL = ("--layers", "16", "--hidden", "2048", "--heads", "16", "--kv-heads", "4")
E2E_PROMPT = ("--prefix-tokens", "3840", "--suffix-tokens", "128", "--block-tokens", "128")


def _median_s(run: Callable[[], None], repeats: int = REPEATS) -> float:
    run()  # warm-up: first-use costs (context, streams, page tables) are not bandwidth
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def copies(size: int) -> list[dict[str, Any]]:
    arena = DramTier(2 * size, prefault=False)
    pin(arena.address, arena.capacity_bytes, threads=8)
    rows = []
    try:
        host = torch.frombuffer(memoryview(arena._map), dtype=torch.uint8)
        src, back = host[:size], host[size : 2 * size]
        src.random_(0, 256)
        mover = Mover(TorchDevice(0))
        dev = torch.empty(size, dtype=torch.uint8, device="cuda")
        ref_host = torch.empty(size, dtype=torch.uint8, pin_memory=True)

        def mover_copy(direction: str, dst: Any, s: Any) -> Callable[[], None]:
            return lambda: mover.wait(mover.submit(direction, [(dst, s)]))  # type: ignore[arg-type]

        def torch_copy(dst: Any, s: Any) -> Callable[[], None]:
            def run() -> None:
                dst.copy_(s, non_blocking=True)
                torch.cuda.synchronize()

            return run

        for name, ours, theirs in (
            ("h2d", mover_copy("h2d", dev, src), torch_copy(dev, ref_host)),
            ("d2h", mover_copy("d2h", back, dev), torch_copy(ref_host, dev)),
        ):
            ours_s, theirs_s = _median_s(ours), _median_s(theirs)
            rows.append(_row(name, size / ours_s, size / theirs_s, ">= 0.8x", 0.8))
        mover.wait(mover.submit("h2d", [(dev, src)]))
        mover.wait(mover.submit("d2h", [(back, dev)]))
        assert torch.equal(src, back), "bytes changed on the way"
        del host, src, back
    finally:
        unregister(arena.address)
        arena.close()
    return rows


def _share(queue: Any, done: Any, size: int) -> None:
    tensor = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    queue.put(tensor)  # torch.multiprocessing sends a CUDA IPC handle, not the bytes
    done.wait()


def ipc(size: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_share, args=(queue, done, size))
    child.start()
    shared: dict[str, Any] = {}  # emptied before the child may exit: it owns the memory
    try:
        shared["theirs"] = queue.get(timeout=120)  # opened through CUDA IPC here
        mover = Mover(TorchDevice(0))
        local_src = torch.empty_like(shared["theirs"]).copy_(shared["theirs"])
        dst = torch.empty_like(local_src)

        def through_ipc() -> None:
            mover.wait(mover.submit("d2d", [(dst, shared["theirs"])]))

        def plain() -> None:
            dst.copy_(local_src)
            torch.cuda.synchronize()

        ipc_s, plain_s = _median_s(through_ipc), _median_s(plain)
        mover.wait(mover.submit("d2d", [(dst, shared["theirs"])]))
        assert torch.equal(dst, local_src)
        return _row("d2d via IPC", size / ipc_s, size / plain_s, ">= 0.8x", 0.8)
    finally:
        shared.clear()
        torch.cuda.synchronize()
        done.set()
        child.join(60)


def nvme_to_gpu(nvme_dir: Path, block_bytes: int, blocks: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=nvme_dir) as tmp:
        tier = NvmeTier(Path(tmp), blocks * block_bytes * 2, direct_io=True, sync_writes=False)
        tier.open()
        headers = []
        payload = bytearray(torch.randint(0, 256, (block_bytes,), dtype=torch.uint8).numpy())
        digest = xxhash.xxh3_64_intdigest(payload)
        for i in range(blocks):
            key = f"b{i}".encode()
            header = RecordHeader(
                "default|gpu", key, i + 1, block_bytes, digest,
                header_size_for("default|gpu", key),
            )  # fmt: skip
            tier.write(header, [memoryview(payload)])
            headers.append(header)
        staging = [torch.empty(block_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(3)]
        dest = torch.empty((blocks, block_bytes), dtype=torch.uint8, device="cuda")
        io = IoPool(4)

        def read(i: int, buf: Any) -> Any:
            tier.read_into(headers[i], memoryview(buf.numpy()))
            return buf

        async def read_alone() -> None:
            for i in range(blocks):
                await io.run(read, i, staging[i % len(staging)])

        upload = StagedUpload(Mover(TorchDevice(0)), staging, io.run)
        try:
            alone_s = _median_s(lambda: asyncio.run(read_alone()), 3)
            piped_s = _median_s(lambda: asyncio.run(upload.run(read, list(dest))), 3)
            assert bytes(dest[-1].cpu().numpy()) == bytes(payload)
        finally:
            io.close()
            tier.close()
    total = blocks * block_bytes
    return _row("nvme->gpu pipeline", total / piped_s, total / alone_s, ">= 0.8x", 0.8)


def arena_pin(size: int) -> dict[str, Any]:
    arena = DramTier(size, prefault=False)
    try:
        report = pin(arena.address, size, threads=16)
        ours_s = report.touch_s + report.register_s
        unregister(arena.address)
    finally:
        arena.close()
    started = time.perf_counter()
    buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    theirs_s = time.perf_counter() - started
    del buf
    row = _row("arena pin (s)", ours_s, theirs_s, "reported", None)
    row["detail"] = f"first touch {report.touch_s:.2f} s + register {report.register_s:.2f} s"
    return row


def overlap(size: int) -> dict[str, Any]:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)

    def matmuls() -> None:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()

    alone_s = _median_s(matmuls)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    mover = Mover(TorchDevice(0))
    stop = threading.Event()

    def keep_copying() -> None:
        while not stop.is_set():
            up = mover.submit("h2d", [(dev, host)])
            mover.wait(mover.submit("d2h", [(host, dev)], after=[up]))
            mover.poll()

    copier = threading.Thread(target=keep_copying)
    copier.start()
    try:
        time.sleep(0.2)
        busy_s = _median_s(matmuls)
    finally:
        stop.set()
        copier.join()
    slowdown = busy_s / alone_s - 1
    return {
        "metric": "matmul slowdown while copying",
        "kvtier": slowdown,
        "baseline": 0.0,
        "ratio": None,
        "target": "<= 10 %",
        "ok": slowdown <= 0.10,
    }


def engine_e2e(scratch: Path) -> dict[str, Any]:
    """The transformers example on this GPU, CUDA IPC both ways, against a real daemon
    serving it (`gpu.device = 0`): its outcome (engine, passed, ttft_s, ttft_ratio)."""
    model = scratch / "llama"
    subprocess.run(
        [sys.executable, str(DRIVER), "build-model", str(model), *E2E_MODEL],
        check=True,
        capture_output=True,
        timeout=300,
    )
    outcome_file = scratch / "e2e.json"
    proc, target = _daemon.start(scratch / "daemon", {"KVTIER_GPU__DEVICE": "0"}, "4GiB")
    try:
        command = [sys.executable, str(EXAMPLE), "--model", str(model), "--target", target]
        command += ["--device", "cuda", *E2E_PROMPT, "--json", str(outcome_file)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    finally:
        _daemon.stop(proc)
    print(done.stdout, end="")
    if not outcome_file.exists():
        tail = done.stderr[-2000:]
        raise RuntimeError(f"the example wrote no outcome (exit {done.returncode}): {tail}")
    outcome: dict[str, Any] = json.loads(outcome_file.read_text())
    outcome["passed"] = bool(outcome["passed"]) and done.returncode == 0
    return outcome


def _e2e_row(outcome: dict[str, Any]) -> dict[str, Any]:
    ttft = outcome.get("ttft_s") or {}
    return {
        "metric": "engine e2e TTFT (s)",
        "kvtier": ttft.get("kvtier"),
        "baseline": ttft.get("recompute"),
        "ratio": outcome.get("ttft_ratio"),
        "target": "passed",
        "ok": bool(outcome.get("passed")),
        "detail": f"transformers, {outcome.get('cached_tokens')} of "
        f"{outcome.get('prompt_tokens')} prompt tokens from kvtier",
    }


def _failed(metric: str, err: BaseException) -> dict[str, Any]:
    traceback.print_exception(err)
    row = _row(metric, 0.0, 0.0, "-", None)
    row.update(kvtier=None, baseline=None, ok=False, error=f"{type(err).__name__}: {err}")
    return row


def _row(name: str, ours: float, theirs: float, target: str, least: float | None) -> dict[str, Any]:
    ratio = ours / theirs if theirs else None
    return {
        "metric": name,
        "kvtier": ours,
        "baseline": theirs,
        "ratio": ratio,
        "target": target,
        "ok": None if least is None or ratio is None else ratio >= least,
    }


def _fmt(value: float | None, metric: str) -> str:
    if value is None:
        return "-"
    if metric.endswith("(s)"):
        return f"{value:.2f} s"
    if "slowdown" in metric:
        return f"{value:+.1%}"
    return f"{value / 1e9:.1f} GB/s"


def summary(
    rows: list[dict[str, Any]], device: str, e2e: dict[str, Any], tests_rc: int | None
) -> dict[str, Any]:
    """The issue's keys, from the rows (None where a row failed)."""
    by = {r["metric"]: r for r in rows}

    def ratio(metric: str) -> float | None:
        return by.get(metric, {}).get("ratio")

    pin = by.get("arena pin (s)", {})
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "h2d_ratio": ratio("h2d"),
        "d2h_ratio": ratio("d2h"),
        "d2d_ipc_ratio": ratio("d2d via IPC"),
        "nvme_gpu_ratio": ratio("nvme->gpu pipeline"),
        "matmul_slowdown": by.get("matmul slowdown while copying", {}).get("kvtier"),
        "arena_pin_s": {"kvtier": pin.get("kvtier"), "cudaHostAlloc": pin.get("baseline")},
        "engine_e2e": {
            "engine": e2e.get("engine", "transformers"),
            "passed": bool(e2e.get("passed")),
            "ttft_ratio": e2e.get("ttft_ratio"),
        },
        "gpu_tests_passed": None if tests_rc is None else tests_rc == 0,
    }
    ratios = [out[k] for k in ("h2d_ratio", "d2h_ratio", "d2d_ipc_ratio", "nvme_gpu_ratio")]
    slowdown = out["matmul_slowdown"]
    out["targets_met"] = (
        all(r is not None and r >= 0.8 for r in ratios)
        and slowdown is not None
        and slowdown <= 0.10
        and out["engine_e2e"]["passed"]
        and out["gpu_tests_passed"] is not False
    )
    out["rows"] = rows
    return out


def table(rows: list[dict[str, Any]], device: str, size: int) -> str:
    """The rows as a Markdown table (for BENCHMARKS.md)."""
    lines = [
        f"{device}; copies of {human_size(size)}, median of {REPEATS}",
        "",
        "| metric | kvtier | baseline | ratio | target | ok |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        ok = {True: "yes", False: "**no**", None: "-"}[r["ok"]]
        kv, base = _fmt(r["kvtier"], r["metric"]), _fmt(r["baseline"], r["metric"])
        note = f" ({r['error']})" if r.get("error") else ""
        lines.append(f"| {r['metric']} | {kv} | {base} | {ratio} | {r['target']} | {ok}{note} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256MiB", help="bytes per copy")
    ap.add_argument("--arena", default="16GiB", help="arena size for the pinning row")
    ap.add_argument("--nvme-dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--block", default="16MiB", help="NVMe record size for the pipeline row")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--json", type=Path, help="default: docs/bench/<date>-gpu-check.json")
    ap.add_argument("--gpu-tests-rc", type=int, help="the gpu tests' exit status, recorded")
    ap.add_argument("--skip-e2e", action="store_true", help="no engine end to end row")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script measures a GPU")
    size = parse_size(args.size)
    device = torch.cuda.get_device_name(0)
    rows: list[dict[str, Any]] = []
    block = parse_size(args.block)
    steps: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = [
        ("h2d / d2h", lambda: copies(size)),
        ("d2d via IPC", lambda: [ipc(size)]),
        ("nvme->gpu pipeline", lambda: [nvme_to_gpu(args.nvme_dir, block, args.blocks)]),
        ("arena pin (s)", lambda: [arena_pin(parse_size(args.arena))]),
        ("matmul slowdown while copying", lambda: [overlap(size)]),
    ]
    for name, step in steps:
        started_s = time.perf_counter()
        try:
            rows.extend(step())
        except Exception as err:  # one failed row must not lose the others' figures
            rows.append(_failed(name, err))
        print(f"{name}: {time.perf_counter() - started_s:.1f} s", flush=True)
    e2e: dict[str, Any] = {"engine": "transformers", "passed": False, "ttft_ratio": None}
    if not args.skip_e2e:
        try:
            with tempfile.TemporaryDirectory(prefix="kvtier-e2e-") as scratch:
                e2e = engine_e2e(Path(scratch))
            rows.append(_e2e_row(e2e))
        except Exception as err:
            rows.append(_failed("engine e2e TTFT (s)", err))
    result = summary(rows, device, e2e, args.gpu_tests_rc)
    out = args.json or ROOT / "docs" / "bench" / f"{result['date']}-gpu-check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    markdown = table(rows, device, size)
    out.with_suffix(".md").write_text(markdown)
    print(f"\n{markdown}")
    met = "yes" if result["targets_met"] else "NO"
    print(f"targets met: {met}; wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
