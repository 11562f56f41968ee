"""The Mooncake peer of `kvtier bench daemon` gives figures for every round it runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.daemon import mooncake_peer


def test_rounds_that_outgrow_the_store_are_all_read_back() -> None:
    """Three rounds of 8 MiB against a 16 MiB segment: each round's objects must be gone
    before the next one puts (a remove the master refuses, while a get's lease runs,
    used to leave them there, and the third round's puts evicted blocks unread)."""
    python = Path(sys.executable)
    loads = subprocess.run([python, "-c", "import mooncake.store"], capture_output=True)
    reason = None
    if not python.with_name("mooncake_master").exists() or loads.returncode != 0:
        reason = "Mooncake Store is not installed or does not load (pip install 'kvtier[mooncake]')"
    elif os.geteuid() != 0 or shutil.which("unshare") is None:
        reason = "the Mooncake peer needs root and unshare (a private network namespace)"
    if reason is not None:
        if os.environ.get("KVTIER_REQUIRE_REMOTE") == "1":
            pytest.fail(f"{reason} (KVTIER_REQUIRE_REMOTE=1)")
        pytest.skip(reason)
    block_bytes, pool_bytes = 128 << 10, 8 << 20
    rows = mooncake_peer(python, [block_bytes], pool_bytes, 3)
    # The peer exits without figures if any get returned other bytes or none.
    assert [(r.path, r.block_bytes, len(r.put_gbps), len(r.get_gbps)) for r in rows] == [
        ("mooncake", block_bytes, 3, 3)
    ]
    assert len(rows[0].get_latency_s) == 3 * pool_bytes // block_bytes
