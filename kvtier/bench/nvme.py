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
import mmap
import os
import random
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from kvtier.bench.fio import comparison, comparison_text, fio_command, run_fio
from kvtier.bench.results import (
    BenchError,
    Job,
    early_end,
    normal_text,
    plot,
    report,
    totals,
)
from kvtier.buffers import aligned_buffer
from kvtier.profiles import MODELS as PROFILES
from kvtier.sizes import human_size, parse_size
from kvtier.tiers.allocator import round_up
from kvtier.tiers.nvme import NvmeTier, supports_o_direct
from kvtier.tiers.record import RecordHeader, header_size_for

ALIGN_BYTES = 4096
MODELS: dict[str, int] = {name: m.kv_bytes_per_token for name, m in PROFILES.items()}


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
        if args.iodepth > 1 and args.ioengine == "psync":
            # A depth asked for and not given is a different experiment (threads, not one
            # queue the block layer can merge): say so rather than let the figure mislead.
            print(
                f"kvtier bench nvme: warning: --iodepth {args.iodepth} without libaio (the "
                f"libaio package, pip install libaio, and the system's libaio.so.1, apt "
                f"install libaio1): running --ioengine psync, {args.iodepth} threads each "
                "doing synchronous I/O; pass --ioengine psync to choose that, or "
                "--ioengine libaio to require AIO",
                file=sys.stderr,
            )
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
        if why := early_end(doc):
            print(f"kvtier bench nvme: {why}", file=sys.stderr)
    else:
        text = normal_text(doc) + (comparison_text(doc["vs_fio"]) if "vs_fio" in doc else "")
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 1 if any(job["error"] for job in doc["jobs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
