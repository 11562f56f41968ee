"""`kvtier bench nvme`: an fio-like benchmark of a drive for KV-cache traffic.

    kvtier bench nvme --directory /mnt/nvme0 --rw read --bs 4M --iodepth 8 --size 2G
    kvtier bench nvme --directory /mnt/nvme0 --model llama3-8b --tokens-per-block 16 \\
        --rw randread --pattern chain --mode tier --output-format json
    kvtier bench nvme --directory /mnt/nvme0 --rw write --bs 1M --vs-fio

Flags mean what fio's flags of the same name mean. `--mode raw` does plain aligned
I/O (what the drive gives); `--mode tier` goes through kvtier's NVMe tier code (record
headers, checksums verified on every read, one file per block), which is what kvtier gets
out of the drive. Raw mode keeps `--iodepth` requests in flight with Linux AIO
(`--ioengine libaio`, as fio's libaio engine), or with one thread per queue slot doing
synchronous I/O (`--ioengine psync`: the GIL is released in the syscalls); tier mode runs
the tier's own code on threads. Output: fio-style text, or JSON laid out like fio's
(`jobs[].read|write.{io_bytes,bw_bytes,iops,runtime,clat_ns.percentile}`) under the top key
"kvtier-bench version". Everything the run creates is removed at the end, Ctrl-C included.
Timing is fio's: files laid out and fsynced, buffers touched, then the clock runs from the
first I/O to the last completion. `--vs-fio --repeat N` alternates with fio, taking turns
going first, and gives the paired ratio a 95 % confidence interval.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

import kvtier
from kvtier.buffers import aligned_buffer
from kvtier.profiles import MODELS as PROFILES
from kvtier.sizes import human_size, parse_size
from kvtier.tiers.allocator import round_up
from kvtier.tiers.nvme import NvmeTier, supports_o_direct
from kvtier.tiers.record import RecordHeader, header_size_for

ALIGN_BYTES = 4096
# fio's default completion-latency percentiles, and its key format.
PERCENTILES = (
    1.0,
    5.0,
    10.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    70.0,
    80.0,
    90.0,
    95.0,
    99.0,
    99.5,
    99.9,
    99.95,
    99.99,
)
MODELS: dict[str, int] = {name: m.kv_bytes_per_token for name, m in PROFILES.items()}


class BenchError(Exception):
    """A refusal with a message that says what to change."""


def percentile_key(p: float) -> str:
    return f"{p:f}"


@dataclass(slots=True)
class Direction:
    """Completed I/Os of one direction (read or write) of a job."""

    clat_ns: list[int] = field(default_factory=list)
    io_bytes: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes)

    def record(self, started_ns: int, ended_ns: int, size: int, t0_ns: int) -> None:
        self.clat_ns.append(ended_ns - started_ns)
        self.io_bytes += size
        self.timeline.append(((ended_ns - t0_ns) / 1e9, size))

    def to_fio(self, runtime_s: float) -> dict[str, Any]:
        lat = sorted(self.clat_ns)
        n = len(lat)
        pct = {
            percentile_key(p): (lat[min(n - 1, math.ceil(p / 100 * n) - 1)] if n else 0)
            for p in PERCENTILES
        }
        clat = {
            "min": lat[0] if n else 0,
            "max": lat[-1] if n else 0,
            "mean": statistics.fmean(lat) if n else 0.0,
            "stddev": statistics.pstdev(lat) if n > 1 else 0.0,
            "N": n,
            "percentile": pct,
        }
        bw_bytes = int(self.io_bytes / runtime_s) if runtime_s > 0 and n else 0
        return {
            "io_bytes": self.io_bytes,
            "io_kbytes": self.io_bytes // 1024,
            "bw_bytes": bw_bytes,
            "bw": bw_bytes // 1024,
            "iops": n / runtime_s if runtime_s > 0 else 0.0,
            "runtime": round(runtime_s * 1000) if n else 0,
            "total_ios": n,
            "clat_ns": clat,
            "lat_ns": dict(clat),
        }


@dataclass(slots=True)
class Job:
    index: int
    args: argparse.Namespace
    path: Path  # file (raw) or directory (tier)
    read: Direction = field(default_factory=Direction)
    write: Direction = field(default_factory=Direction)
    runtime_s: float = 0.0
    error: str = ""


def _blocks(args: argparse.Namespace) -> int:
    return max(1, int(args.size) // int(args.bs))


def _offsets(args: argparse.Namespace, rng: random.Random) -> Iterator[int]:
    """Block indices in the order the job issues them (endless when time-based)."""
    count = _blocks(args)
    sequential = args.rw in ("read", "write")
    if args.pattern == "chain":
        # Prefix chains: the file holds chains of up to 64 blocks; each request reads a
        # random-length prefix of one chain, in order, as an engine loading a cached prompt.
        chain = min(64, count)
        while True:
            start = rng.randrange(0, max(1, count - chain + 1), chain) if count > chain else 0
            yield from range(start, start + rng.randint(1, chain))
    while True:
        order = range(count) if sequential else (rng.randrange(count) for _ in range(count))
        yield from order
        if not args.time_based:
            return


class Runner:
    """Runs the jobs of one invocation and owns everything they create on disk."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root: Path = Path(args.directory) / f"kvtier-bench-{uuid.uuid4().hex[:8]}"
        self.jobs: list[Job] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._done_bytes = 0
        self._t0_ns = 0
        self._last_ns = 0  # when the latest I/O completed
        self._deadline_ns: int | None = None  # --runtime's end, once the clock starts
        self._ready: threading.Barrier | None = None
        self._queues: dict[int, Iterator[tuple[str, int]]] = {}
        self._tiers: dict[int, NvmeTier] = {}
        self._generations: dict[int, dict[int, int]] = {}  # job -> block -> record generation
        self._next_generation = 2
        # One payload for every write: its checksum goes in every tier-mode record header.
        self._payload = aligned_buffer(round_up(args.bs, ALIGN_BYTES))
        self._payload[: args.bs] = os.urandom(args.bs)
        self._payload_view = memoryview(self._payload)[: round_up(args.bs, ALIGN_BYTES)]
        self._payload_xxh3 = xxhash.xxh3_64_intdigest(self._payload_view[: args.bs])

    # ---- lifecycle ---------------------------------------------------------------------
    def check(self) -> None:
        args = self.args
        if not args.directory.is_dir():
            raise BenchError(f"--directory {args.directory} is not a directory")
        if args.bs % ALIGN_BYTES and args.direct:
            raise BenchError(f"--bs must be a multiple of {ALIGN_BYTES} with --direct=1")
        overhead = header_size_for(NS_ID, _key(0)) if args.mode == "tier" else 0
        need = args.numjobs * _blocks(args) * (round_up(args.bs, ALIGN_BYTES) + overhead)
        free = shutil.disk_usage(args.directory).free
        if need > free * 0.95:
            raise BenchError(
                f"not enough free space in {args.directory}: the run needs "
                f"{human_size(need)} ({args.numjobs} job(s) of --size), only "
                f"{human_size(free)} is free; lower --size or --numjobs"
            )
        if args.direct and not supports_o_direct(args.directory):
            raise BenchError(
                f"the filesystem of {args.directory} does not support O_DIRECT; "
                "use --direct=0 (buffered I/O) or another directory"
            )

    @contextlib.contextmanager
    def workspace(self) -> Iterator[None]:
        self.root.mkdir()
        try:
            yield
        finally:
            for tier in self._tiers.values():
                tier.close()
            shutil.rmtree(self.root, ignore_errors=True)
            if self.args.filename is not None and self.args.mode == "raw":
                Path(self.args.filename).unlink(missing_ok=True)

    def run(self) -> None:
        args = self.args
        self.jobs = [Job(i, args, self._job_path(i)) for i in range(args.numjobs)]
        for job in self.jobs:
            self._layout(job)
            self._queues[job.index] = self._issue_order(job)
        if args.ioengine == "libaio":
            # One thread per job keeps `iodepth` I/Os in flight in the kernel, as fio's
            # libaio engine does (requests the block layer can merge and batch).
            threads = [
                threading.Thread(target=self._aio_worker, args=(job,), daemon=True)
                for job in self.jobs
            ]
        else:
            threads = [
                threading.Thread(target=self._worker, args=(job,), daemon=True)
                for job in self.jobs
                for _ in range(args.iodepth)
            ]
        # The clock starts once every worker has opened its file and touched its buffers,
        # and stops at the last completion, as fio's runtime does: setup (importing the AIO
        # module, first-touch faults of `iodepth` buffers) is not the drive's time.
        self._ready = threading.Barrier(len(threads), action=self._start_clock)
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads):
                threads[0].join(0.5) if threads[0].is_alive() else time.sleep(0.05)
                self._progress()
        except KeyboardInterrupt:
            self._stop.set()
            self._ready.abort()
            for t in threads:
                t.join()
            raise
        end_ns = self._last_ns or time.monotonic_ns()
        elapsed = (end_ns - self._t0_ns) / 1e9 if self._t0_ns else 0.0
        for job in self.jobs:
            job.runtime_s = elapsed
        if self._done_bytes and elapsed > 2:
            print(file=sys.stderr)

    def _start_clock(self) -> None:
        self._t0_ns = time.monotonic_ns()
        if self.args.runtime:
            self._deadline_ns = self._t0_ns + int(self.args.runtime * 1e9)

    def _over(self) -> bool:
        """Stopped (an error, Ctrl-C) or past --runtime."""
        return self._stop.is_set() or (
            self._deadline_ns is not None and time.monotonic_ns() >= self._deadline_ns
        )

    def _set_ready(self) -> bool:
        """Wait for every worker to finish its setup; False when another one failed."""
        assert self._ready is not None
        try:
            self._ready.wait()
        except threading.BrokenBarrierError:
            return False
        return True

    def _completed(self, size: int, ended_ns: int) -> None:
        with self._lock:
            self._done_bytes += size
            self._last_ns = max(self._last_ns, ended_ns)

    def _job_path(self, index: int) -> Path:
        """A file per job (raw) or a record directory (tier); --filename names job 0's file."""
        if self.args.filename is not None and self.args.mode == "raw" and index == 0:
            return Path(self.args.filename)
        return self.root / f"job{index}"

    def _progress(self) -> None:
        if not self._t0_ns:
            return
        elapsed = (time.monotonic_ns() - self._t0_ns) / 1e9
        if elapsed < 2:
            return
        print(
            f"\rkvtier-bench: {human_size(self._done_bytes)} in {elapsed:.0f} s, "
            f"{human_size(self._done_bytes / elapsed)}/s",
            end="",
            file=sys.stderr,
            flush=True,
        )

    # ---- data ----------------------------------------------------------------------------
    def _issue_order(self, job: Job) -> Iterator[tuple[str, int]]:
        args = self.args
        rng = random.Random(job.index * 7919 + 1)
        for index in _offsets(args, rng):
            if args.rw in ("read", "randread"):
                yield "read", index
            elif args.rw in ("write", "randwrite"):
                yield "write", index
            else:
                yield ("read" if rng.random() * 100 < args.rwmixread else "write"), index

    def _next(self, job: Job) -> tuple[str, int] | None:
        with self._lock:
            return next(self._queues[job.index], None)

    def _layout(self, job: Job) -> None:
        """Write what the job will read before timing starts (as fio lays out its files)."""
        args = self.args
        reads = args.rw not in ("write", "randwrite")
        if args.mode == "raw":
            job.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(job.path, os.O_RDWR | os.O_CREAT | self._direct(), 0o600)
            try:
                # Allocated up front, as fio lays out its files (fallocate=native): a write
                # then converts an extent rather than allocating blocks mid-run.
                os.posix_fallocate(fd, 0, _blocks(args) * args.bs)
                for i in range(_blocks(args) if reads else 0):
                    os.pwritev(fd, [self._payload_view], i * args.bs)
                # fio's create_fsync=1: the layout is on the drive before the clock starts,
                # not still draining from a write-back cache (a VM host's, a drive's)
                # while the job runs.
                os.fsync(fd)
            finally:
                os.close(fd)
            return
        tier = NvmeTier(job.path, 1 << 62, direct_io=bool(args.direct), sync_writes=False)
        tier.open()
        self._tiers[job.index] = tier
        self._generations[job.index] = {}
        # Writes too start from a full set of records: a running kvtier's NVMe tier is full
        # (it is a cache), so each new record replaces one and reuses its file.
        for i in range(_blocks(args)):
            tier.write(self._header(i), [self._payload_view])
            self._generations[job.index][i] = 1
        tier.sync()  # as the raw layout's fsync

    def _direct(self) -> int:
        return os.O_DIRECT if self.args.direct else 0

    def _header(self, index: int, generation: int = 1) -> RecordHeader:
        key = _key(index)
        return RecordHeader(
            NS_ID, key, generation, self.args.bs, self._payload_xxh3, header_size_for(NS_ID, key)
        )

    # Tier mode writes a new record per write, as the daemon does, and removes the one it
    # supersedes afterwards (the daemon does that on its I/O pool, off the write path).
    def _tier_write(self, job: Job, tier: NvmeTier, index: int) -> int:
        with self._lock:
            generation = self._next_generation
            self._next_generation += 1
        tier.write(self._header(index, generation), [self._payload_view])
        return generation

    def _supersede(self, job: Job, tier: NvmeTier, index: int, generation: int) -> None:
        with self._lock:
            current = self._generations[job.index].get(index)
            if current is None or current < generation:
                self._generations[job.index][index] = generation
                stale = current
            else:
                stale = generation  # a newer write of this block landed first
        if stale is not None:
            tier.remove(self._header(index, stale))

    def _tier_read(self, job: Job, tier: NvmeTier, index: int, into: memoryview) -> None:
        """The leased-get promotion path: straight into an aligned buffer, verified."""
        for _ in range(8):
            with self._lock:
                generation = self._generations[job.index].get(index, 1)
            try:
                tier.read_into(self._header(index, generation), into)
                return
            except FileNotFoundError:
                continue  # superseded by a concurrent write between lookup and open
        raise OSError(f"block {index} kept being superseded while read")

    def _aio_worker(self, job: Job) -> None:
        """Raw mode with Linux AIO: `iodepth` requests in flight, one resubmitted per
        completion; completion latency is from submission to its event."""
        args = self.args
        fd = -1
        ctx: Any = None
        in_flight: dict[Any, tuple[str, int, int]] = {}  # block -> (kind, slot, start ns)
        try:
            import libaio

            fd = os.open(job.path, os.O_RDWR | self._direct())
            target = _FileNo(fd)
            buffers = [_touched(round_up(args.bs, ALIGN_BYTES)) for _ in range(args.iodepth)]
            ctx = libaio.AIOContext(args.iodepth)

            def submit(slot: int) -> None:
                if self._over():
                    return
                item = self._next(job)
                if item is None:
                    return
                kind, index = item
                read = kind == "read"
                block = libaio.AIOBlock(
                    mode=libaio.AIOBLOCK_MODE_READ if read else libaio.AIOBLOCK_MODE_WRITE,
                    target_file=target,
                    buffer_list=[
                        memoryview(buffers[slot])[: args.bs] if read else self._payload_view
                    ],
                    offset=index * args.bs,
                )
                in_flight[block] = (kind, slot, time.monotonic_ns())
                ctx.submit([block])

            if not self._set_ready():
                return
            for slot in range(args.iodepth):
                submit(slot)
            while in_flight:
                for block, res, _res2 in ctx.getEvents(min_nr=1):
                    t_end = time.monotonic_ns()
                    kind, slot, t_start = in_flight.pop(block)
                    if res < 0:
                        raise OSError(-res, os.strerror(-res))
                    if res < args.bs:
                        raise OSError(f"short {kind}: {res} of {args.bs} bytes")
                    (job.read if kind == "read" else job.write).record(
                        t_start, t_end, args.bs, self._t0_ns
                    )
                    self._completed(args.bs, t_end)
                    submit(slot)
        except Exception as err:
            self._failed(job, err)
        finally:
            if ctx is not None:
                if in_flight:
                    ctx.getEvents(min_nr=None)  # the kernel still owns those buffers
                ctx.close()
            if fd >= 0:
                os.close(fd)

    def _worker(self, job: Job) -> None:
        args = self.args
        fd = -1
        try:
            read_view = memoryview(_touched(round_up(args.bs, ALIGN_BYTES)))
            fd = os.open(job.path, os.O_RDWR | self._direct()) if args.mode == "raw" else -1
            tier = self._tiers.get(job.index)
            if not self._set_ready():
                return
            while not self._over():
                item = self._next(job)
                if item is None:
                    return
                kind, index = item
                t_start = time.monotonic_ns()
                if tier is None:
                    if kind == "read":
                        got = os.preadv(fd, [read_view], index * args.bs)
                        if got < args.bs:
                            raise OSError(f"short read: {got} of {args.bs} bytes")
                    else:
                        os.pwritev(fd, [self._payload_view], index * args.bs)
                elif kind == "read":
                    self._tier_read(job, tier, index, read_view)
                else:
                    generation = self._tier_write(job, tier, index)
                t_end = time.monotonic_ns()
                (job.read if kind == "read" else job.write).record(
                    t_start, t_end, args.bs, self._t0_ns
                )
                if tier is not None and kind == "write":
                    self._supersede(job, tier, index, generation)
                self._completed(args.bs, t_end)
        except Exception as err:
            self._failed(job, err)
        finally:
            if fd >= 0:
                os.close(fd)

    def _failed(self, job: Job, err: Exception) -> None:
        job.error = f"{type(err).__name__}: {err}"
        self._stop.set()
        if self._ready is not None:
            self._ready.abort()  # workers still in setup would wait for this one forever


def _touched(size_bytes: int) -> mmap.mmap:
    """An aligned buffer with every page already faulted in: a fresh mapping's first-touch
    faults cost ~4 µs a page here, setup that fio's runtime does not count either."""
    buf = aligned_buffer(size_bytes)
    buf[:] = bytes(len(buf))
    return buf


NS_ID = "bench|kv"


class _FileNo:
    """What libaio needs of a file: its descriptor."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd


def libaio_available() -> bool:
    """The `libaio` package imports and finds the system's libaio.so.1."""
    try:
        import libaio  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def _key(index: int) -> bytes:
    return index.to_bytes(8, "little") * 4


# ---- output ---------------------------------------------------------------------------------
def job_options(args: argparse.Namespace) -> dict[str, str]:
    return {
        "rw": args.rw,
        "bs": str(args.bs),
        "size": str(args.size),
        "iodepth": str(args.iodepth),
        "numjobs": str(args.numjobs),
        "direct": str(int(args.direct)),
        "rwmixread": str(args.rwmixread),
        "runtime": str(args.runtime or 0),
        "time_based": str(int(args.time_based)),
        "mode": args.mode,
        "pattern": args.pattern,
    }


def report(args: argparse.Namespace, jobs: list[Job]) -> dict[str, Any]:
    """The run as a fio-like JSON document."""
    return {
        "kvtier-bench version": f"kvtier-{kvtier.__version__}",
        "timestamp": int(time.time()),
        "time": time.strftime("%a %b %d %H:%M:%S %Y"),
        "global options": {"directory": str(args.directory), "ioengine": args.ioengine},
        "jobs": [
            {
                "jobname": args.name,
                "groupid": 0,
                "error": 1 if job.error else 0,
                "error_message": job.error,
                "job options": job_options(args),
                "read": job.read.to_fio(job.runtime_s),
                "write": job.write.to_fio(job.runtime_s),
                "job_runtime": int(job.runtime_s * 1000),
            }
            for job in jobs
        ],
    }


def totals(doc: dict[str, Any], direction: str) -> tuple[float, int]:
    """Aggregate bandwidth (bytes/s) and I/O count of one direction over all jobs."""
    jobs = doc["jobs"]
    return (
        sum(j[direction]["bw_bytes"] for j in jobs),
        sum(j[direction]["total_ios"] for j in jobs),
    )


def _unit(ns_values: list[float]) -> tuple[str, float]:
    top = max(ns_values, default=0)
    return ("msec", 1e6) if top >= 1e7 else ("usec", 1e3)


def normal_text(doc: dict[str, Any]) -> str:
    lines = []
    for i, job in enumerate(doc["jobs"]):
        lines.append(
            f"{job['jobname']}: (groupid=0, jobs=1): err={job['error']:2d}: job={i}"
            + (f" ({job['error_message']})" if job["error"] else "")
        )
        for direction in ("read", "write"):
            d = job[direction]
            if not d["total_ios"]:
                continue
            mib = d["bw_bytes"] / (1 << 20)
            lines.append(
                f"  {direction}: IOPS={d['iops']:.0f}, BW={mib:.0f}MiB/s "
                f"({d['bw_bytes'] / 1e6:.0f}MB/s)({human_size(d['io_bytes'])}/{d['runtime']}msec)"
            )
            clat = d["clat_ns"]
            unit, div = _unit([clat["max"]])
            lines.append(
                f"    clat ({unit}): min={clat['min'] / div:.0f}, max={clat['max'] / div:.0f}, "
                f"avg={clat['mean'] / div:.2f}, stdev={clat['stddev'] / div:.2f}"
            )
            lines.append(f"     clat percentiles ({unit}):")
            cells = [f"{float(k):5.2f}th=[{v / div:6.0f}]" for k, v in clat["percentile"].items()]
            for row in range(0, len(cells), 4):
                lines.append("     | " + ", ".join(cells[row : row + 4]) + ",")
    return "\n".join(lines) + "\n"


# ---- fio, side by side -----------------------------------------------------------------------
def fio_command(args: argparse.Namespace, directory: Path) -> list[str]:
    cmd = [
        "fio",
        "--name=kvtier-vs-fio",
        f"--directory={directory}",
        f"--size={args.size}",
        f"--bs={args.bs}",
        f"--iodepth={args.iodepth}",
        f"--numjobs={args.numjobs}",
        f"--rw={args.rw}",
        f"--rwmixread={args.rwmixread}",
        f"--direct={int(args.direct)}",
        "--ioengine=libaio",
        "--group_reporting",
        "--output-format=json",
    ]
    if args.runtime:
        cmd.append(f"--runtime={args.runtime}")
    if args.time_based:
        cmd.append("--time_based")
    return cmd


def run_fio(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    if shutil.which("fio") is None:
        raise BenchError("--vs-fio needs fio on PATH (Debian: apt-get install fio)")
    out = subprocess.run(
        fio_command(args, directory),
        capture_output=True,
        text=True,
        check=False,
        timeout=max(600, 10 * (args.runtime or 60)),
    )
    if out.returncode:
        raise BenchError(f"fio failed: {out.stderr.strip()[-400:]}")
    start = out.stdout.find("{")
    doc: dict[str, Any] = json.loads(out.stdout[start:])
    return doc


def comparison(
    ours: dict[str, Any],
    fio: dict[str, Any],
    pairs: dict[str, list[tuple[float, float]]] | None = None,
) -> dict[str, Any]:
    """Ours against fio's: the median runs' bandwidths and their ratio; with `pairs` (per
    direction, (ours, fio) bandwidth of each alternation) also the median of the pairs'
    ratios, which a disk drifting between alternations moves less: each pair ran back to
    back; from 6 pairs on, its 95 % confidence interval, which says whether the drive's
    noise leaves the comparison conclusive."""
    out: dict[str, Any] = {}
    for direction in ("read", "write"):
        bw, ios = totals(ours, direction)
        fio_bw, fio_ios = totals(fio, direction)
        if ios or fio_ios:
            fio_p50 = (
                fio["jobs"][0][direction]["clat_ns"]
                .get("percentile", {})
                .get(percentile_key(50.0), 0)
            )
            our_p50 = ours["jobs"][0][direction]["clat_ns"]["percentile"][percentile_key(50.0)]
            out[direction] = {
                "kvtier_bw_bytes": bw,
                "fio_bw_bytes": fio_bw,
                "bw_ratio": round(bw / fio_bw, 4) if fio_bw else None,
                "kvtier_clat_p50_ns": our_p50,
                "fio_clat_p50_ns": fio_p50,
            }
            paired = [a / b for a, b in (pairs or {}).get(direction, []) if b]
            if paired:
                out[direction]["paired_bw_ratio"] = round(statistics.median(paired), 4)
                ci = median_ci(paired)
                if ci is not None:
                    out[direction]["paired_bw_ratio_ci95"] = [round(x, 4) for x in ci]
    return out


def comparison_text(cmp: dict[str, Any]) -> str:
    lines = ["", f"{'':6} {'kvtier-bench':>14} {'fio':>14} {'ratio':>7}"]
    for direction, c in cmp.items():
        ratio = f"{c['bw_ratio']:.3f}" if c["bw_ratio"] is not None else "-"
        paired = f"  (paired: {c['paired_bw_ratio']:.3f}" if "paired_bw_ratio" in c else ""
        if "paired_bw_ratio_ci95" in c:
            low, high = c["paired_bw_ratio_ci95"]
            paired += f", 95% CI {low:.2f}-{high:.2f}"
        paired += ")" if paired else ""
        lines.append(
            f"{direction:6} {c['kvtier_bw_bytes'] / 1e6:>10.0f} MB/s "
            f"{c['fio_bw_bytes'] / 1e6:>9.0f} MB/s {ratio:>7}{paired}"
        )
        lines.append(
            f"{'p50':>6} {c['kvtier_clat_p50_ns'] / 1e3:>11.0f} us "
            f"{c['fio_clat_p50_ns'] / 1e3:>10.0f} us"
        )
    return "\n".join(lines) + "\n"


# ---- plot -----------------------------------------------------------------------------------
def plot(jobs: list[Job], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib") from None
    fig, (ax_lat, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    for direction in ("read", "write"):
        lat = [ns / 1e3 for job in jobs for ns in getattr(job, direction).clat_ns]
        if lat:
            # Log-spaced bins: one slow outlier must not squash the distribution.
            low, high = max(min(lat), 1e-3), max(lat)
            edges = [low * (high / low) ** (i / 60) for i in range(61)] if high > low else 60
            ax_lat.hist(lat, bins=edges, alpha=0.6, label=direction)
            ax_lat.set_xscale("log")
        points = sorted(p for job in jobs for p in getattr(job, direction).timeline)
        if points:
            bin_s = max(0.1, points[-1][0] / 100)
            bins: dict[int, int] = {}
            for t, size in points:
                bins[int(t / bin_s)] = bins.get(int(t / bin_s), 0) + size
            xs = sorted(bins)
            ax_bw.plot(
                [x * bin_s for x in xs], [bins[x] / bin_s / 1e6 for x in xs], label=direction
            )
    ax_lat.set(xlabel="completion latency (µs)", ylabel="I/Os", title="latency distribution")
    ax_bw.set(xlabel="time (s)", ylabel="MB/s", title="bandwidth over time")
    ax_lat.legend()
    ax_bw.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier bench nvme",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--name", default="kvtier-bench", help="job name in the report")
    p.add_argument("--directory", type=Path, help="where to create the test files")
    p.add_argument(
        "--filename",
        type=Path,
        help="create the test file here (must not exist); implies its directory",
    )
    p.add_argument("--size", default="1G", help="bytes per job (fio sizes: 1G, 512M, 4GiB)")
    p.add_argument("--bs", default="4M", help="block size")
    p.add_argument("--model", choices=sorted(MODELS), help="derive --bs from a model's KV size")
    p.add_argument("--tokens-per-block", type=int, default=16, help="with --model")
    p.add_argument("--iodepth", type=int, default=1)
    p.add_argument(
        "--ioengine",
        choices=["libaio", "psync"],
        help="raw mode: libaio (Linux AIO, as fio; the default where the libaio package and "
        "libaio.so.1 are present) or psync (one thread per queue slot, synchronous I/O); "
        "tier mode always runs kvtier's own threads",
    )
    p.add_argument("--numjobs", type=int, default=1)
    p.add_argument(
        "--rw", default="read", choices=["read", "write", "randread", "randwrite", "randrw"]
    )
    p.add_argument("--rwmixread", type=int, default=50)
    p.add_argument(
        "--pattern",
        default="plain",
        choices=["plain", "chain"],
        help="chain: reads arrive as prefix chains of random length",
    )
    p.add_argument("--runtime", type=float, default=0, help="seconds (0: until --size is done)")
    p.add_argument("--time-based", "--time_based", dest="time_based", action="store_true")
    p.add_argument("--direct", type=int, choices=[0, 1], default=1)
    p.add_argument("--mode", choices=["raw", "tier"], default="raw")
    p.add_argument("--output-format", choices=["normal", "json"], default="normal")
    p.add_argument("--output", type=Path, help="write the report here instead of stdout")
    p.add_argument("--vs-fio", action="store_true", help="also run fio's equivalent job")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run N times (alternating with fio) and report the median run",
    )
    p.add_argument("--plot", type=Path, help="PNG of latency distribution and bandwidth")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    fio_units = {"k": "KiB", "m": "MiB", "g": "GiB", "t": "TiB"}

    def size(text: str) -> int:
        t = text.strip()
        if t and t[-1].lower() in fio_units and t[:-1].replace(".", "").isdigit():
            t = t[:-1] + fio_units[t[-1].lower()]  # fio's 1G means 1 GiB
        return parse_size(t)

    try:
        args.size, args.bs = size(args.size), size(args.bs)
    except ValueError as err:
        raise BenchError(str(err)) from None
    if args.model:
        args.bs = MODELS[args.model] * args.tokens_per_block
    if args.filename is not None:
        if args.filename.exists():
            raise BenchError(
                f"--filename {args.filename} exists; name a new file (it is "
                "written over and removed at the end)"
            )
        args.directory = args.filename.parent
    if args.directory is None:
        raise BenchError("name where to test: --directory DIR (on the drive to measure)")
    if args.iodepth < 1 or args.numjobs < 1 or args.repeat < 1 or not 0 <= args.rwmixread <= 100:
        raise BenchError("--iodepth and --numjobs must be >= 1, --rwmixread within 0..100")
    if args.time_based and not args.runtime:
        raise BenchError("--time-based needs --runtime")
    if args.mode == "tier":
        args.ioengine = "psync"  # the tier's own code: synchronous I/O on its threads
    elif args.ioengine is None:
        # At depth 1 there is nothing to keep in flight: a plain pread/pwrite is the
        # cheapest path (AIO writes that allocate blocks measured slower here).
        args.ioengine = "libaio" if args.iodepth > 1 and libaio_available() else "psync"
    elif args.ioengine == "libaio" and not libaio_available():
        raise BenchError(
            "--ioengine libaio needs the libaio package (pip install libaio) and the "
            "system's libaio.so.1 (apt install libaio1); or use --ioengine psync"
        )
    if args.bs < 1 or args.size < args.bs:
        raise BenchError("--size must hold at least one --bs block")
    return args


def _fio_run(args: argparse.Namespace) -> dict[str, Any]:
    """fio's equivalent job in a scratch directory of its own, removed afterwards."""
    fio_dir = args.directory / f"kvtier-bench-fio-{uuid.uuid4().hex[:8]}"
    fio_dir.mkdir()
    try:
        return run_fio(args, fio_dir)
    finally:
        shutil.rmtree(fio_dir, ignore_errors=True)


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of `values`: the order
    statistics the sign test gives (k-th smallest and k-th largest, with k as large as
    keeps the chance of the median falling outside under 1 - confidence). None when
    there are too few values for that confidence (fewer than 6 at 95 %)."""
    xs = sorted(values)
    n = len(xs)
    tail = (1 - confidence) / 2
    k = 0
    below = 0.0  # P(Binomial(n, 1/2) < k)
    while k < n and (with_k := below + math.comb(n, k) / 2**n) <= tail:
        below = with_k
        k += 1
    if k == 0:
        return None
    return xs[k - 1], xs[n - k]


def _median_run(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose total bandwidth (read + write) is the median of the repeats."""
    ranked = sorted(docs, key=lambda d: totals(d, "read")[0] + totals(d, "write")[0])
    return ranked[len(ranked) // 2]


def run_once(args: argparse.Namespace) -> tuple[dict[str, Any], list[Job]]:
    runner = Runner(args)
    runner.check()
    with runner.workspace():
        runner.run()
    return report(args, runner.jobs), runner.jobs


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)
        ours: list[tuple[dict[str, Any], list[Job]]] = []
        fios: list[dict[str, Any]] = []
        # Alternate our run and fio's, so both see the same drift of a noisy disk, and
        # take turns going first: on a virtio disk the first of two back-to-back runs
        # measured slower (fio against itself, read 1M depth 8: 10 of 10 pairs), a bias
        # against whoever always leads.
        for round_index in range(args.repeat):
            fio_first = args.vs_fio and round_index % 2 == 1
            if fio_first:
                fios.append(_fio_run(args))
            ours.append(run_once(args))
            if args.vs_fio and not fio_first:
                fios.append(_fio_run(args))
        doc = _median_run([d for d, _ in ours])
        jobs = next(j for d, j in ours if d is doc)
        if args.repeat > 1:
            doc["repeats"] = {
                direction: [totals(d, direction)[0] for d, _ in ours]
                for direction in ("read", "write")
            }
        if fios:
            fio_doc = _median_run(fios)
            doc["fio"] = {
                "version": fio_doc.get("fio version"),
                "command": fio_command(args, args.directory / "<scratch>"),
                "jobs": fio_doc["jobs"],
                "repeats": {
                    direction: [totals(d, direction)[0] for d in fios]
                    for direction in ("read", "write")
                },
            }
            pairs = {
                direction: [
                    (totals(d, direction)[0], totals(f, direction)[0])
                    for (d, _), f in zip(ours, fios, strict=True)
                ]
                for direction in ("read", "write")
            }
            doc["vs_fio"] = comparison(doc, fio_doc, pairs if args.repeat > 1 else None)
        if args.plot:
            plot(jobs, args.plot)
    except BenchError as err:
        print(f"kvtier bench nvme: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nkvtier bench nvme: interrupted; test files removed", file=sys.stderr)
        return 130
    if args.output_format == "json":
        text = json.dumps(doc, indent=2) + "\n"
    else:
        text = normal_text(doc) + (comparison_text(doc["vs_fio"]) if "vs_fio" in doc else "")
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 1 if any(job["error"] for job in doc["jobs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
