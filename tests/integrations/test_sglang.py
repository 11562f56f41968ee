"""kvtier as SGLang's HiCache L3 storage, driven through real SGLang code.

The driver (sglang_driver.py, in .venv-sglang: sglang 0.5.23 on torch 2.13.0+cpu) loads
the backend through SGLang's own storage factory by module path, as `--hicache-storage-
backend dynamic` does, registers a host pool whose methods are SGLang's (see the driver's
docstring for the one stand-in), and stores and loads pages through a real daemon.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]
DRIVER = Path(__file__).with_name("sglang_driver.py")
ROOT = Path(__file__).resolve().parents[2]


def drive(python: Path, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [str(python), str(DRIVER), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, f"driver failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = proc.stderr
    return result


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_sglang_pages_round_trip_bit_exact_through_the_daemon(
    sglang_python: Path, start_daemon: StartDaemon, layout: str
) -> None:
    daemon = start_daemon(dram="64MiB", nvme="256MiB")
    r = drive(sglang_python, "--target", daemon.target, "--layout", layout)
    assert (r["sglang_version"], r["torch_version"]) == ("0.5.23", "2.13.0+cpu")
    assert r["is_hicache_storage"] and r["class"] == "kvtier.integrations.sglang.KVTierStorage"
    assert r["namespace"].endswith(f"/bfloat16-b4-sglang-mha-{layout}-tp0of1")
    assert r["exists_before"] == 0
    assert r["set"] == [True] * 6
    assert r["exists_after"] == 6 and r["exists_with_unknown_tail"] == 6 and r["exists_one"]
    # Loaded into another pool at other pages: the same bytes, nothing else written.
    assert r["get"] == [True] * 6
    assert r["same_bytes"] and r["untouched_elsewhere"]
    assert r["get_with_hole"] == [True, False, True]
    # SGLang's older interface (interface_v1 0): a flat tensor per page.
    assert r["flat_set"] and r["flat_get_same"] == [True, True] and r["flat_get_miss"]
    # get_stats: SGLang's StorageMetrics, the calls since the last read, then empty.
    assert r["stats_type_ok"]
    assert r["stats_backup_pgs"] == [6] and r["stats_backup_gib_s"][0] > 0
    assert r["stats_prefetch_pgs"] == [6, 2]
    assert r["stats_after_read"] == []
    # Shards: each TP rank of an MHA model has its own namespace; MLA ranks share one,
    # and only SGLang's writer rank (tp 0) stores into it.
    assert r["tp1_namespace"].endswith("-tp1of2") and r["tp0_of_2_namespace"].endswith("-tp0of2")
    assert r["mla_namespaces_equal"]
    assert r["mla_other_set"] == [True, True] and r["mla_after_other"] == 0
    assert r["mla_writer_set"] == [True, True] and r["mla_after_writer"] == 2
    assert "needs a host KV pool with a KV buffer" in r["anchor_refused"]
    stats = daemon.client().stats()
    assert stats.checksum_failures == 0 and stats.puts >= 6 + 2 + 2


@pytest.mark.timeout(600)
def test_sglang_runs_without_l3_when_the_daemon_is_down(sglang_python: Path, workdir: Path) -> None:
    r = drive(sglang_python, "--target", f"unix://{workdir}/absent.sock", "--down")
    assert r["exists"] == 0 and r["set"] == [False, False] and r["get"] == [False, False]
    # Retried only after retry_s: the later calls did not wait on the socket again.
    assert r["elapsed_s"] < 5
    warnings = [line for line in r["stderr"].splitlines() if "kvtier: could not" in line]
    assert len(warnings) == 1, r["stderr"][-2000:]
