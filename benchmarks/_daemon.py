"""A real daemon for a benchmark: started on a UNIX socket in its own directory."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The chain plan_ab.py and plan_churn.py plan, as their worker processes' source (the
# worker sets `transport` first; its own code follows, indented under the `with`): a real
# daemon, a client, 256 blocks of 16 tokens with the first 192 put, the prefill fit warmed.
PLAN_CHAIN_WORKER = r"""
import statistics, sys, tempfile, time
from pathlib import Path
import kvtier
from kvtier.bench.daemon import daemon

ns = "llama3-8b/bench"
with (
    tempfile.TemporaryDirectory(prefix="kvtier-plan-") as tmp,
    daemon(Path(tmp), transport, 64 << 20) as target,
    kvtier.Client(target) as client,
):
    client.wait_ready()
    chain = kvtier.chain_keys(ns, [[i] for i in range(256)])
    for i in range(192):
        client.put(ns, chain[i], b"x" * 4096)
    for j in range(20):
        client.report_prefill(ns, 0, 1000 + 100 * j, 0.05 + 0.01 * j)
"""


def in_process_store(scratch: Path, dram_bytes: int, nvme_bytes: int) -> dict[str, Any]:
    """The settings of an in-process `Store` for a benchmark (`Config.model_validate` them
    with the `kvtier` under test): its socket and a segment-layout NVMe tier in `scratch`,
    a prefaulted DRAM arena of `dram_bytes`."""
    return {
        "server": {"listen": f"unix://{scratch}/s.sock"},
        "dram": {"capacity_bytes": dram_bytes, "prefault": True},
        "nvme": {"path": str(scratch / "nvme"), "capacity_bytes": nvme_bytes, "layout": "segments"},
    }


def start(
    workdir: Path, env: dict[str, str], nvme_capacity: str = "2GiB"
) -> tuple[subprocess.Popen[str], str]:
    """`kvtier serve` with a 1 GiB arena and its NVMe tier in `workdir` (kept across
    restarts); returns the process and its target once it serves."""
    workdir.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier", "serve", "--listen", f"unix://{workdir}/s.sock",
         "--dram-capacity", "1GiB", "--nvme-path", str(workdir / "nvme"),
         "--nvme-capacity", nvme_capacity],
        stdout=subprocess.PIPE,
        stderr=(workdir / "log").open("a"),
        text=True,
        env={**os.environ, **env},
    )  # fmt: skip
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    match = re.search(r"serving on (\S+)", banner)
    if not match:
        raise SystemExit(f"the daemon in {workdir} did not start: {(workdir / 'log').read_text()}")
    if "recovering its index" in banner:  # measure with the NVMe index complete
        proc.stdout.readline()
    return proc, match.group(1)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.wait(timeout=60)


@contextlib.contextmanager
def baseline_tree(rev: str, scratch: Path) -> Iterator[Path]:
    """A temporary `git worktree` of `rev` under `scratch`: run a subprocess with
    PYTHONPATH set to it and it (and any daemon it starts) imports that revision's code,
    its C extensions included (built in place: without them it would silently run their
    Python twins, and every comparison with it would be of the wrong code)."""
    root = Path(__file__).resolve().parent.parent
    tree = scratch / "baseline"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), rev],
        cwd=root,
        check=True,
        capture_output=True,
    )
    try:
        built = subprocess.run(
            [sys.executable, "-c", "import setuptools; setuptools.setup()", "build_ext", "-i"],
            cwd=tree,
            capture_output=True,
            text=True,
        )
        if built.returncode:
            raise SystemExit(f"could not build {rev}'s C extensions:\n{built.stderr[-2000:]}")
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root, check=False)


def run_in(tree: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """`argv` run in `tree` with PYTHONPATH set to it (that revision's `kvtier`); its
    output captured, an error raised if it fails."""
    return subprocess.run(
        argv,
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )


def callgrind_instructions(tree: Path, argv: list[str]) -> int:
    """The instructions callgrind counts over `run_in(tree, argv)` (deterministic where
    timings on a shared machine are not)."""
    done = run_in(tree, ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv])
    for line in done.stderr.splitlines():
        if "Collected" in line:
            return int(line.split()[-1])
    raise SystemExit(f"valgrind printed no instruction count:\n{done.stderr[-2000:]}")
