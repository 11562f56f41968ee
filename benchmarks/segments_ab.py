"""Same-run A/B of the NVMe segment layout (kvtier/tiers/segments.py) against the file
layout (kvtier/tiers/nvme.py) and fio, on one directory.

    python benchmarks/segments_ab.py --directory /var/tmp/kvseg [--stream 512MiB] \\
        [--bs 64KiB] [--iodepth 8] [--rounds 3] [--records 100000] [--skip-files-recovery]

stream: --stream bytes of --bs blocks written through each tier's `write` from --iodepth
threads (what the daemon's I/O pool does), O_DIRECT, not synced, and fio's sequential
write of the same size (bs, iodepth, direct=1, libaio) in the same directory; rounds
interleaved (segments, files, fio, then again), medians, ratios to fio.

recovery: --records records of 4 KiB written once into each layout, then `open()` of a
fresh tier (page cache warm) timed per round, interleaved: the footers against one header
per file (--cold: the page cache dropped before each open; needs root).

    python benchmarks/segments_ab.py --directory /var/tmp/kvseg --records 1000000 \
        --daemon-restart /work/main --daemon-restart . [--rounds 3]

daemon restart: `kvtier serve` of each given checkout in turn (rounds interleaved) on the
segments tier the recovery mode wrote, timed from its start until its Stats say the NVMe
index is complete (every record served), with the longest event-loop stall the daemon's
probe saw and its RssAnon then (both from the same Stats call; the tier is only read:
the same records every round).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

from kvtier.buffers import aligned_buffer
from kvtier.sizes import parse_size
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.record import RecordHeader, header_size_for
from kvtier.tiers.segments import SegmentTier

NS_ID = "bench|kv"
MB = 1e6


def _header(index: int, generation: int, payload: bytes) -> RecordHeader:
    key = index.to_bytes(8, "little")
    return RecordHeader(
        NS_ID,
        key,
        generation,
        len(payload),
        xxhash.xxh3_64_intdigest(payload),
        header_size_for(NS_ID, key),
    )


def _stream(tier: NvmeTier, total_bytes: int, bs: int, iodepth: int) -> float:
    """MB/s of records written through `tier.write` from `iodepth` threads."""
    count = total_bytes // bs
    payload = os.urandom(bs)
    first = tier.first_generation or 1
    headers = [_header(i, first + i, payload) for i in range(count)]
    next_index = iter(range(count))
    lock = threading.Lock()

    def worker() -> None:
        buf = aligned_buffer(bs)
        buf[:bs] = payload
        view = memoryview(buf)
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            tier.write(headers[i], [view])

    threads = [threading.Thread(target=worker) for _ in range(iodepth)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return sum(h.record_bytes for h in headers) / elapsed / MB


def _fio(directory: Path, total_bytes: int, bs: int, iodepth: int) -> float:
    out = subprocess.run(
        [
            "fio",
            "--name=seq",
            f"--directory={directory}",
            "--rw=write",
            f"--bs={bs}",
            f"--iodepth={iodepth}",
            "--ioengine=libaio",
            "--direct=1",
            f"--size={total_bytes}",
            "--output-format=json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return float(job["write"]["bw_bytes"]) / MB


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def stream(args: argparse.Namespace) -> None:
    total, bs = parse_size(args.stream), parse_size(args.bs)
    results: dict[str, list[float]] = {"segments": [], "files": [], "fio": []}
    runs: dict[str, Callable[[Path], float]] = {
        "segments": lambda d: _tier_stream(SegmentTier, d, total, bs, args.iodepth),
        "files": lambda d: _tier_stream(NvmeTier, d, total, bs, args.iodepth),
        "fio": lambda d: _fio(d, total, bs, args.iodepth),
    }
    for round_ in range(args.rounds):
        for name, run in runs.items():
            mbs = run(_fresh(args.directory / f"stream-{name}"))
            results[name].append(mbs)
            print(f"round {round_ + 1} {name:<9} {mbs:8.1f} MB/s", flush=True)
    fio = statistics.median(results["fio"])
    for name, values in results.items():
        med = statistics.median(values)
        print(f"stream {name:<9} median {med:8.1f} MB/s  {med / fio:5.2f}x fio")


def _tier_stream(cls: type[NvmeTier], directory: Path, total: int, bs: int, iodepth: int) -> float:
    tier = cls(directory, 4 * total + (1 << 30), direct_io=True, sync_writes=False)
    tier.open()
    try:
        return _stream(tier, total, bs, iodepth)
    finally:
        tier.close()


def _populate(cls: type[NvmeTier], root: Path, records: int) -> None:
    done = root / "done"
    if done.exists() and done.read_text() == str(records):
        return
    _fresh(root)
    # Buffered: the records are the same bytes, written faster (only the open is timed).
    tier = cls(root, records * 16384 + (1 << 30), direct_io=False, sync_writes=False)
    tier.open()
    payload = os.urandom(4096)
    buf = aligned_buffer(4096)
    buf[:4096] = payload
    first = tier.first_generation or 1
    for i in range(records):
        tier.write(_header(i, first + i, payload), [memoryview(buf)])
    tier.close()
    done.write_text(str(records))


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _open_s(cls: type[NvmeTier], root: Path, records: int, cold: bool) -> float:
    if cold and not _drop_caches():
        raise SystemExit("--cold needs root (writes /proc/sys/vm/drop_caches)")
    tier = cls(root, records * 16384 + (1 << 30), direct_io=True, sync_writes=False)
    started = time.perf_counter()
    report = tier.open()
    elapsed = time.perf_counter() - started
    tier.close()
    assert len(report.records) == records, (cls.__name__, len(report.records))
    return elapsed


def recovery(args: argparse.Namespace) -> None:
    layouts: list[type[NvmeTier]] = [SegmentTier]
    if not args.skip_files_recovery:
        layouts.append(NvmeTier)
    for cls in layouts:
        started = time.perf_counter()
        _populate(cls, args.directory / f"recover-{cls.layout}", args.records)
        print(
            f"{cls.layout}: {args.records} records written in "
            f"{time.perf_counter() - started:.1f} s",
            flush=True,
        )
    times: dict[str, list[float]] = {cls.layout: [] for cls in layouts}
    for round_ in range(args.rounds):
        for cls in layouts:
            s = _open_s(cls, args.directory / f"recover-{cls.layout}", args.records, args.cold)
            times[cls.layout].append(s)
            print(f"round {round_ + 1} open {cls.layout:<9} {s:7.2f} s", flush=True)
    for name, values in times.items():
        print(
            f"recovery {name:<9} {args.records} records: median {statistics.median(values):.2f} s"
        )


def _daemon_restart(tree: Path, root: Path, records: int, run_dir: Path) -> dict[str, float]:
    import kvtier

    sock = run_dir / "s.sock"
    config = run_dir / "kvtier.toml"
    config.write_text(
        f'[server]\nlisten = "unix://{sock}"\n[dram]\ncapacity_bytes = "32MiB"\n'
        f'[nvme]\npath = "{root}"\ncapacity_bytes = {records * 16384 + (1 << 30)}\n'
        f'layout = "segments"\n[log]\nlevel = "warning"\n'
    )
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    with (run_dir / "daemon.log").open("ab") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "serve", "--config", str(config)],
            stdout=log,
            stderr=log,
            env=env,
            # `-m kvtier` imports from the working directory before PYTHONPATH: run it in
            # the tree, or every checkout would time this one's code.
            cwd=tree.resolve(),
        )
    try:
        while not sock.exists():
            time.sleep(0.01)
        with kvtier.Client(f"unix://{sock}", timeout_s=60) as client:
            while True:
                try:
                    stats = client.stats()
                except kvtier.KVTierError:
                    time.sleep(0.01)
                    continue
                nvme = stats.tiers["nvme"]
                if not nvme.recovering and nvme.blocks >= records:
                    break
                time.sleep(0.02)
            served_s = time.perf_counter() - started
        status = Path(f"/proc/{proc.pid}/status").read_text()
        rss = int(next(x for x in status.splitlines() if x.startswith("RssAnon:")).split()[1])
        return {
            "served_s": served_s,
            "stall_max_ms": stats.event_loop_stall_max_s * 1e3,
            "rss_anon_mib": rss / 1024,
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def daemon_restart(args: argparse.Namespace) -> None:
    root = args.directory / "recover-segments"
    _populate(SegmentTier, root, args.records)
    run_dir = _fresh(args.directory / "daemon-run")
    trees = [Path(t) for t in args.daemon_restart]
    results: dict[str, list[dict[str, float]]] = {str(t): [] for t in trees}
    for round_ in range(args.rounds):
        for tree in trees:
            got = _daemon_restart(tree, root, args.records, run_dir)
            results[str(tree)].append(got)
            print(f"round {round_ + 1} {tree}: {json.dumps(got)}", flush=True)
    for tree, rows in results.items():
        medians = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}
        print(f"daemon restart {tree} {args.records} records: medians {json.dumps(medians)}")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--directory", type=Path, required=True)
    p.add_argument("--stream", default="512MiB")
    p.add_argument("--bs", default="64KiB")
    p.add_argument("--iodepth", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--skip-stream", action="store_true")
    p.add_argument("--skip-recovery", action="store_true")
    p.add_argument("--skip-files-recovery", action="store_true")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each open")
    p.add_argument(
        "--daemon-restart",
        action="append",
        default=[],
        metavar="CHECKOUT",
        help="time a daemon of this checkout's code restarting on the records (repeatable)",
    )
    args = p.parse_args()
    if args.daemon_restart:
        daemon_restart(args)
        return 0
    if not args.skip_stream:
        stream(args)
    if not args.skip_recovery:
        recovery(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
