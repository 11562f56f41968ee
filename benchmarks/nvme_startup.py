"""How long `kvtier serve` takes to become ready, and to have its NVMe index filled, on a
tier of --records records: exec -> READY=1 (sd_notify) and exec -> the index complete
(Stats: the NVMe tier no longer `recovering`; a daemon that recovers before it listens is
complete at READY). While it recovers, a client gets one small DRAM block in a loop (the
slowest of those gets), and Stats report the daemon's longest event-loop stall
(kvtier/server/looplag.py) meanwhile.

    python benchmarks/nvme_startup.py --directory /var/tmp/kvs \\
        --version before=/work/main --version after=. [--records 100000] [--rounds 3]

Each --version is LABEL=a checkout whose `kvtier` the daemon runs (PYTHONPATH); the
client and the records come from this checkout. The records (4 KiB payloads, written once
through this checkout's tier, reused when present) are read warm: every version starts
once before the timed rounds. Calibration is off (it is the same fixed cost for all).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import xxhash

import kvtier
from kvtier.buffers import aligned_buffer
from kvtier.sizes import parse_size
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for

NS = "bench"
NS_ID = f"default|{NS}"


def _populate(root: Path, records: int, payload_bytes: int) -> None:
    marker = root / f".bench-{records}x{payload_bytes}"
    if marker.exists():
        return
    shutil.rmtree(root, ignore_errors=True)
    payload = aligned_buffer(max(4096, -(-payload_bytes // 4096) * 4096))
    payload[:payload_bytes] = os.urandom(payload_bytes)
    digest = xxhash.xxh3_64_intdigest(memoryview(payload)[:payload_bytes])
    tier = NvmeTier(root, 1 << 50, direct_io=False, sync_writes=False)
    tier.open()
    try:
        for i in range(records):
            key = f"k{i}".encode()
            header = RecordHeader(NS_ID, key, 1, payload_bytes, digest, header_size_for(NS_ID, key))
            tier.write(header, [memoryview(payload)])
    finally:
        tier.close()
    os.sync()
    marker.touch()


def _recovering(client: kvtier.Client) -> tuple[bool, int, float]:
    """Whether the index is still filling, NVMe blocks, the daemon's longest event-loop
    stall since the previous call (0 where it does not say)."""
    stats = client.stats()
    nvme = stats.tiers["nvme"]
    stall_s = float(getattr(stats, "event_loop_stall_recent_max_s", 0.0))
    return bool(getattr(nvme, "recovering", False)), nvme.blocks, stall_s


def _one_start(
    checkout: Path, root: Path, work: Path, records: int
) -> tuple[float, float, float, float]:
    """(exec -> READY, exec -> index complete, slowest small get while recovering, the
    daemon's longest loop stall while recovering), s."""
    notify_path = work / "notify.sock"
    notify_path.unlink(missing_ok=True)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(300)
    sock = work / "kvtier.sock"
    env = {
        **os.environ,
        "PYTHONPATH": str(checkout),
        "NOTIFY_SOCKET": str(notify_path),
        "KVTIER_PLANNER__CALIBRATION_S": "0",
    }
    args = [sys.executable, "-m", "kvtier", "serve", "--listen", f"unix://{sock}",
            "--dram-capacity", "256MiB", "--nvme-path", str(root),
            "--nvme-capacity", "64GiB"]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.Popen(  # not run from a checkout: `-m` would import the cwd's kvtier
        args, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=(work / "log").open("a")
    )
    try:
        while b"READY=1" not in notify.recv(4096):
            pass
        ready_s = time.perf_counter() - started
        slowest_s = 0.0
        done = threading.Event()
        with kvtier.Client(f"unix://{sock}") as client:
            client.put(NS, b"dram-probe", b"x" * 4096, overwrite=True)

            def probe() -> None:
                nonlocal slowest_s
                with kvtier.Client(f"unix://{sock}") as c:
                    c.get(NS, b"dram-probe")  # connected before the timing starts
                    while not done.is_set():
                        t = time.perf_counter()
                        assert c.get(NS, b"dram-probe") == b"x" * 4096
                        slowest_s = max(slowest_s, time.perf_counter() - t)
                        time.sleep(0.005)

            prober = threading.Thread(target=probe)
            prober.start()
            _recovering(client)  # resets the stall record: what follows is recovery's
            stall_s = 0.0
            while True:
                recovering, blocks, stalled_s = _recovering(client)
                stall_s = max(stall_s, stalled_s)
                if not recovering:
                    break
                time.sleep(0.01)
            indexed_s = time.perf_counter() - started
            done.set()
            prober.join()
            if blocks < records:
                raise SystemExit(f"{checkout}: {blocks} NVMe blocks indexed, want {records}")
        return ready_s, indexed_s, slowest_s, stall_s
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        notify.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--version", action="append", required=True, help="LABEL=checkout")
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--payload", default="4KiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="leave the records directory")
    args = parser.parse_args()
    versions = dict(v.split("=", 1) for v in args.version)
    root = args.directory / "nvme"
    work = args.directory / "work"
    work.mkdir(parents=True, exist_ok=True)
    try:
        _populate(root, args.records, parse_size(args.payload))
        for checkout in versions.values():  # warm the page cache and the imports
            _one_start(Path(checkout).resolve(), root, work, args.records)
        results: dict[str, list[tuple[float, float, float, float]]] = {
            label: [] for label in versions
        }
        for round_index in range(args.rounds):
            labels = list(versions) if round_index % 2 == 0 else list(reversed(versions))
            for label in labels:
                got = _one_start(Path(versions[label]).resolve(), root, work, args.records)
                results[label].append(got)
                print(f"round {round_index} {label}: " + " / ".join(f"{x:.3f} s" for x in got))
        print(f"{args.records} records of {args.payload}, warm, {args.rounds} rounds (median):")
        for label, rows in results.items():
            ready, indexed, slowest, stall = (
                statistics.median(col) for col in zip(*rows, strict=True)
            )
            print(
                f"  {label}: exec -> READY {ready:.2f} s, exec -> indexed {indexed:.2f} s, "
                f"slowest DRAM get while recovering {slowest * 1e3:.1f} ms, longest loop "
                f"stall then {stall * 1e3:.1f} ms"
            )
    finally:
        if not args.keep:
            shutil.rmtree(args.directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
