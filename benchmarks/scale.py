"""Issue 22's scale benchmark: a real daemon filled with N small blocks through the public
client, restarted on them, then 64 KiB and 2 MiB blocks streamed to NVMe against fio.

    PYTHONPATH=. python benchmarks/scale.py --directory /var/tmp/kvs [--blocks 100000]
        [--block-bytes 4KiB] [--dram 32MiB] [--stream-bytes 512MiB] [--skip-stream]
        [--policy kvtier] [--layout files|segments] [--json out.json] [--keep]
    PYTHONPATH=. python benchmarks/scale.py --directory /var/tmp/kvs --stream-only \
        --layout segments --rounds 3 --baseline ../main-checkout
    PYTHONPATH=. python benchmarks/scale.py --in-process-memory 1000000 [--tracemalloc]

The daemon is `kvtier serve` in a subprocess (this checkout's code), on a UNIX socket,
its NVMe tier under --directory, its DRAM small (--dram) so that most blocks live on
NVMe, its metrics endpoint on a free port. Blocks go in with `Client.put_many` in chains
of 256 chained SHA-256 keys (as an engine's prefix keys), each value derived from its key
(so a read-back check needs no stored copy). It reports:

* RssAnon per block after the fill and after the restart (the daemon's
  /proc/<pid>/status, minus the empty daemon's, measured first; the DRAM arena is a
  memfd, RssShmem, so it is not in RssAnon); the raw figures too;
* fill rate; the longest event-loop stall during the fill and during the restart (the
  daemon's stall probe, kvtier/server/looplag.py, through `Client.stats()`);
* the restart: SIGTERM (with its flush of DRAM-only blocks) timed, then from the new
  process's start to the first successful RPC ("ready") and, separately, until every one
  of --sample random old keys is served again (a daemon that recovers in the background
  is ready before it serves them);
* Lookup and Plan of a 256-block chain at N: p50/p99 over 200 calls each, client side;
* --sample random blocks read back after the restart and compared bit-exactly;
* streaming: --stream-bytes of 64 KiB, then of 2 MiB blocks, put into a daemon whose DRAM
  is tiny so that they demote to NVMe as they arrive; the rate counts only bytes that
  reached NVMe (the blocks demoted over the put: with --stream-nvme smaller than the
  stream, the tier is full and evicts as it writes) over the whole put, and over its
  second half, the steady rate ("steady": the whole put's time includes the first arena's
  worth of the stream, which stays in DRAM and writes nothing, so that rate is below the
  steady one by a share that shrinks as the stream grows, a figure of the stream's length;
  the second half's, once the arena has filled, is what it tends to); each right after,
  fio writing as many bytes at the same block size (iodepth 8, direct=1 where the
  directory supports O_DIRECT, libaio) in the same directory, and the ratios; with
  --rounds, round after round, and with --baseline another checkout's daemon (main's, for
  an A/B) streaming in each round between this one's and fio; --ceiling adds, in each
  round, the same stream into a DRAM arena that holds all of it (every byte counted: the
  put path's own rate, which bounds what any demotion can reach); --stream-jobs N puts
  by N writers at once, each a client (and zero-copy session) of its own. Each stream
  also reports where a block's time went, in µs a block (/proc/<pid>/task/*/schedstat):
  wall, the daemon's event-loop thread on a CPU and waiting for one, its other threads'
  CPU (I/O, gRPC) and this client's: what bounds the stream (one CPU, two, the GIL).

`--in-process-memory N` measures instead the index alone: a `Store` (with the configured
policy) not started, N NVMe-only entries added to its residency as recovery adds them
(each record's namespace string and key decoded separately, as from a header), and the
process's RssAnon growth per entry, the container objects the garbage collector tracks per
entry, and how long one full collection takes. `--tracemalloc` adds the top allocation
sites (slower; use a few hundred thousand entries).

Everything the run creates under --directory is removed at the end unless --keep. On a
shared 2-core machine the timings are noisy: read orders of magnitude and ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import linecache
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import kvtier
from kvtier.sizes import human_size, parse_size

NS = "scale-bench/b16"
CHAIN_BLOCKS = 256
TOKENS_PER_BLOCK = 16
LATENCY_CALLS = 200
PUT_BATCH_BYTES = 1 << 20  # one put_many carries about this much
STREAM_DRAM = "16MiB"  # tiny: streamed blocks demote to NVMe as they arrive
# Values: the key, then a window of a fixed pseudo-random pool chosen by the key.
_POOL = random.Random(22).randbytes(8 << 20)


# ---- keys and values ----------------------------------------------------------------------
def chain_keys(count: int, salt: bytes = b"") -> Iterator[bytes]:
    """`count` keys in chains of CHAIN_BLOCKS: key_i = SHA-256(key_{i-1} ‖ chain ‖ i)."""
    parent = b""
    for i in range(count):
        if i % CHAIN_BLOCKS == 0:
            parent = hashlib.sha256(
                b"chain" + salt + (i // CHAIN_BLOCKS).to_bytes(8, "little")
            ).digest()
        parent = hashlib.sha256(parent + i.to_bytes(8, "little")).digest()
        yield parent


def value_parts(key: bytes, size_bytes: int) -> list[bytes | memoryview]:
    """The block's bytes as put_many takes them (never joined): the key, then the pool."""
    head = key[:size_bytes]
    body = size_bytes - len(head)
    start = int.from_bytes(key[:8], "little") % (len(_POOL) - body + 1)
    return [head, memoryview(_POOL)[start : start + body]]


def expected_value(key: bytes, size_bytes: int) -> bytes:
    return b"".join(value_parts(key, size_bytes))


# ---- the daemon ---------------------------------------------------------------------------
def rss_anon_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/<pid>/status (not Linux?)")


def thread_cpu_ns(pid: int) -> dict[int, tuple[int, int]]:
    """Each live thread of `pid`: (ns on a CPU, ns runnable but waiting for one), from
    /proc/<pid>/task/<tid>/schedstat (its first two fields)."""
    out: dict[int, tuple[int, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            run_ns, wait_ns = task.joinpath("schedstat").read_text().split()[:2]
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue  # ended meanwhile (or no schedstats in this kernel)
        out[int(task.name)] = (int(run_ns), int(wait_ns))
    return out


def loop_cpu_per_block(
    pid: int, before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], blocks: int
) -> dict[str, float]:
    """µs a block, between two `thread_cpu_ns` of the daemon `pid`: its main thread's (the
    event loop's) time on a CPU and waiting for one, and every other thread's CPU
    together (a thread that ended meanwhile is not counted)."""
    main_run = after.get(pid, (0, 0))[0] - before.get(pid, (0, 0))[0]
    main_wait = after.get(pid, (0, 0))[1] - before.get(pid, (0, 0))[1]
    others = sum(run - before.get(tid, (0, 0))[0] for tid, (run, _) in after.items() if tid != pid)
    per = 1e3 * max(blocks, 1)
    return {
        "loop_cpu_us": round(main_run / per, 1),
        "loop_runq_us": round(main_wait / per, 1),
        "daemon_threads_cpu_us": round(others / per, 1),
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Daemon:
    """`kvtier serve` with a config file of its own; restarted on the same NVMe tier."""

    def __init__(
        self,
        run_dir: Path,
        nvme_dir: Path,
        dram: str,
        nvme_bytes: int,
        policy: str,
        layout: str = "files",
        code: Path | None = None,
        account: bool = False,
    ) -> None:
        self.code = code  # a checkout whose kvtier the daemon runs (None: this one's)
        # Run under benchmarks/rss_account.py's SIGUSR1 hook (`take_account`).
        self.account = account
        self.run_dir = run_dir
        self.socket_path = run_dir / "s.sock"
        self.target = f"unix://{self.socket_path}"
        self.metrics_port = _free_port()
        self.config_path = run_dir / "kvtier.toml"
        self.config_path.write_text(
            f'[server]\nlisten = "{self.target}"\n'
            f'metrics_listen = "127.0.0.1:{self.metrics_port}"\n'
            f'[dram]\ncapacity_bytes = "{dram}"\n'
            f'[nvme]\npath = "{nvme_dir}"\ncapacity_bytes = {nvme_bytes}\n'
            f'layout = "{layout}"\n'
            f'[policy]\nname = "{policy}"\n[log]\nlevel = "warning"\n'
        )
        self.log_path = run_dir / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0
        self.stall_trace: Path | None = None  # KVTIER_STALL_TRACE for the next start

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        env = dict(os.environ)
        if self.code is not None:
            env["PYTHONPATH"] = str(self.code)
        if self.stall_trace is not None:
            env["KVTIER_STALL_TRACE"] = str(self.stall_trace)
        entry = ["-m", "kvtier"]
        if self.account:
            entry = [str(Path(__file__).with_name("rss_account.py"))]
            env["KVTIER_RSS_ACCOUNT"] = str(self.run_dir / "account.json")
        with self.log_path.open("ab") as log:
            self.started_s = time.perf_counter()
            self.proc = subprocess.Popen(
                [sys.executable, *entry, "serve", "--config", str(self.config_path)],
                stdout=log,
                stderr=log,
                env=env,
            )

    def wait_first_rpc(self, probe_key: bytes, timeout_s: float = 600.0) -> float:
        """Seconds from `start` to the first successful RPC (a fresh channel each try, so
        gRPC's reconnect backoff is not measured)."""
        deadline = time.perf_counter() + timeout_s
        while True:
            self._check_alive()
            try:
                with kvtier.Client(self.target, timeout_s=5) as client:
                    client.lookup(NS, [probe_key])
                return time.perf_counter() - self.started_s
            except kvtier.KVTierError:
                if time.perf_counter() > deadline:
                    raise SystemExit(
                        f"no RPC answered in {timeout_s} s:\n{self._log_tail()}"
                    ) from None
                time.sleep(0.01)

    def stop(self) -> float:
        """SIGTERM and wait; the seconds it took (the DRAM-only blocks are flushed)."""
        assert self.proc is not None
        started = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=600)
        if code != 0:
            raise SystemExit(f"the daemon exited with {code}:\n{self._log_tail()}")
        return time.perf_counter() - started

    def take_account(self, trim: bool = True, timeout_s: float = 300.0) -> dict[str, Any]:
        """benchmarks/rss_account.py's account of the daemon's RssAnon, now (and with
        `trim`, what a malloc_trim then returns: it changes what is measured after)."""
        out = self.run_dir / "account.json"
        out.unlink(missing_ok=True)
        no_trim = self.run_dir / "account.json.no-trim"
        if trim:
            no_trim.unlink(missing_ok=True)
        else:
            no_trim.touch()
        assert self.proc is not None
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.perf_counter() + timeout_s
        while not out.exists():
            self._check_alive()
            if time.perf_counter() > deadline:
                raise SystemExit("no RSS account from the daemon")
            time.sleep(0.1)
        result: dict[str, Any] = json.loads(out.read_text())
        return result

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def late_wakeups(self, over_s: float = 0.025) -> int:
        """Wake-ups of the stall probe more than `over_s` late since start, from the
        Prometheus endpoint (`over_s` must be a histogram bound)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        count = within = 0.0
        for line in text.splitlines():
            if line.startswith("kvtier_event_loop_lag_seconds_count"):
                count = float(line.split()[-1])
            elif line.startswith(f'kvtier_event_loop_lag_seconds_bucket{{le="{over_s!r}"}}'):
                within = float(line.split()[-1])
        return int(count - within)

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise SystemExit(f"the daemon exited with {self.proc.returncode}:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def _batches(keys: Sequence[bytes], block_bytes: int) -> Iterator[Sequence[bytes]]:
    step = max(1, min(256, PUT_BATCH_BYTES // block_bytes))
    for i in range(0, len(keys), step):
        yield keys[i : i + step]


def put_batch(client: kvtier.Client, ns: str, batch: Sequence[bytes], block_bytes: int) -> None:
    client.put_many(ns, [(k, value_parts(k, block_bytes)) for k in batch])


# Called with a writer's client and the block it is about to put (steady rate's start).
Mark = Callable[[kvtier.Client, int], None]


def put_all(
    client: kvtier.Client,
    ns: str,
    keys: Sequence[bytes],
    block_bytes: int,
    mark_at: int | None = None,
    mark: Mark | None = None,
) -> None:
    """Every key put, in put_many batches; `mark` called once, before the batch that
    starts at or after block `mark_at`."""
    start = 0
    for batch in _batches(keys, block_bytes):
        if mark is not None and mark_at is not None and start >= mark_at:
            mark(client, start)
            mark = None
        put_batch(client, ns, batch, block_bytes)
        start += len(batch)


def put_all_jobs(
    target: str,
    ns: str,
    keys: Sequence[bytes],
    block_bytes: int,
    jobs: int,
    mark_at: int | None = None,
    mark: Mark | None = None,
) -> None:
    """`put_all` by `jobs` writers at once (fio's numjobs): each a client of its own (its
    own zero-copy session) in a thread of its own, putting every jobs-th batch; `mark`
    called by the writer of the first batch that starts at or after block `mark_at`."""
    batches = list(_batches(keys, block_bytes))
    starts = [0]
    for batch in batches:
        starts.append(starts[-1] + len(batch))
    marked_batch = next(
        (i for i, at in enumerate(starts[:-1]) if mark_at is not None and at >= mark_at), None
    )
    clients = [kvtier.Client(target, timeout_s=120) for _ in range(jobs)]
    failures: list[BaseException] = []

    def job(index: int) -> None:
        try:
            for i in range(index, len(batches), jobs):
                if i == marked_batch and mark is not None:
                    mark(clients[index], starts[i])
                put_batch(clients[index], ns, batches[i], block_bytes)
        except BaseException as err:  # re-raised in the caller's thread
            failures.append(err)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(jobs)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for client in clients:
            client.close()
    if failures:
        raise failures[0]


def wait_served(client: kvtier.Client, keys: list[bytes], timeout_s: float = 600.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while None in client.lookup(NS, keys).tiers:
        if time.perf_counter() > deadline:
            raise SystemExit(f"sampled keys not all served after {timeout_s} s")
        time.sleep(0.02)


def read_back(client: kvtier.Client, keys: list[bytes], block_bytes: int) -> dict[str, int]:
    exact = wrong = missing = 0
    for i in range(0, len(keys), 32):
        batch = keys[i : i + 32]
        buffers = [bytearray(block_bytes) for _ in batch]
        for key, buf, got in zip(batch, buffers, client.get_many(NS, batch, buffers), strict=True):
            if got is None:
                missing += 1
            elif got == block_bytes and buf == expected_value(key, block_bytes):
                exact += 1
            else:
                wrong += 1
    return {"checked": len(keys), "bit_exact": exact, "wrong": wrong, "missing": missing}


def chain_latency(client: kvtier.Client, keys: list[bytes], rng: random.Random) -> dict[str, Any]:
    chains = len(keys) // CHAIN_BLOCKS
    if chains == 0:
        return {}
    picks = [rng.randrange(chains) * CHAIN_BLOCKS for _ in range(LATENCY_CALLS)]
    out: dict[str, Any] = {"chain_blocks": CHAIN_BLOCKS, "calls": LATENCY_CALLS}
    for name in ("lookup", "plan"):
        times = []
        for start in picks:
            chain = keys[start : start + CHAIN_BLOCKS]
            began = time.perf_counter()
            if name == "lookup":
                found = client.lookup(NS, chain).prefix_blocks
            else:
                found = client.plan(NS, chain, TOKENS_PER_BLOCK).fetch_end
            times.append(time.perf_counter() - began)
            if name == "lookup" and found != CHAIN_BLOCKS:
                raise SystemExit(f"a stored chain looked up as {found} of {CHAIN_BLOCKS} blocks")
        out[f"{name}_p50_ms"] = round(_percentile(times, 0.5) * 1e3, 3)
        out[f"{name}_p99_ms"] = round(_percentile(times, 0.99) * 1e3, 3)
    return out


def fill_and_restart(args: argparse.Namespace, root: Path, run_dir: Path) -> dict[str, Any]:
    n, size = args.blocks, args.block_bytes
    record_bytes = -(-size // 4096) * 4096 + 4096
    nvme_bytes = int(n * record_bytes * 1.25) + (256 << 20)
    daemon = Daemon(
        run_dir,
        root / "nvme",
        args.dram,
        nvme_bytes,
        args.policy,
        args.layout,
        account=args.account,
    )
    rng = random.Random(7)
    keys = list(chain_keys(n))
    sample = rng.sample(keys, min(args.sample, n))
    out: dict[str, Any] = {}
    if args.stall_trace is not None:
        args.stall_trace.mkdir(parents=True, exist_ok=True)
        daemon.stall_trace = args.stall_trace / "fill.jsonl"
    try:
        daemon.start()
        daemon.wait_first_rpc(keys[0])
        with kvtier.Client(daemon.target, timeout_s=120) as client:
            client.stats()  # the fill's stall window starts here
            empty = rss_anon_bytes(daemon.pid)
            if args.account:
                out["empty_account"] = daemon.take_account()
                empty = rss_anon_bytes(daemon.pid)  # the account's own walk, not counted
            began = time.perf_counter()
            put_all(client, NS, keys, size)
            fill_s = time.perf_counter() - began
            after_fill = client.stats()
            filled = rss_anon_bytes(daemon.pid)
        out["fill"] = {
            "blocks": n,
            "block_bytes": size,
            "seconds": round(fill_s, 2),
            "blocks_per_s": round(n / fill_s),
            "mb_per_s": round(n * size / fill_s / 1e6, 1),
            "dram_blocks": after_fill.tiers["dram"].blocks,
            "nvme_blocks": after_fill.tiers["nvme"].blocks,
            "stall_max_ms": round(after_fill.event_loop_stall_recent_max_s * 1e3, 1),
            "late_wakeups_over_25ms": daemon.late_wakeups(),
            "rss_anon_empty_bytes": empty,
            "rss_anon_bytes": filled,
            "rss_anon_per_block_bytes": round((filled - empty) / n),
        }
        if args.account:
            out["fill"]["account"] = daemon.take_account()
        stop_s = daemon.stop()
        if args.stall_trace is not None:
            daemon.stall_trace = args.stall_trace / "restart.jsonl"
        daemon.start()
        ready_s = daemon.wait_first_rpc(keys[0])
        with kvtier.Client(daemon.target, timeout_s=120) as client:
            wait_served(client, sample)
            served_s = time.perf_counter() - daemon.started_s
            restarted = rss_anon_bytes(daemon.pid)
            if args.account:  # what the moment the samples are served holds (no trim)
                served_account = daemon.take_account(trim=False)
            after_restart = client.stats()
            blocks = sum(t.blocks for t in after_restart.tiers.values())
            out["restart"] = {
                "stop_s": round(stop_s, 2),
                "ready_s": round(ready_s, 2),
                "sampled_served_s": round(served_s, 2),
                "sampled": len(sample),
                "blocks_after": blocks,
                "stall_max_ms": round(after_restart.event_loop_stall_max_s * 1e3, 1),
                "late_wakeups_over_25ms": daemon.late_wakeups(),
                "rss_anon_bytes": restarted,
                "rss_anon_per_block_bytes": round((restarted - empty) / n),
            }
            # And once the whole index is in (the recovery's heap trimmed after): what a
            # restarted daemon holds from then on.
            while client.stats().tiers["nvme"].recovering:
                time.sleep(0.05)
            out["restart"]["index_complete_s"] = round(time.perf_counter() - daemon.started_s, 2)
            time.sleep(2.0)  # the trim runs on the recovery's thread after `complete`
            complete = rss_anon_bytes(daemon.pid)
            out["restart"]["rss_anon_complete_bytes"] = complete
            out["restart"]["rss_anon_complete_per_block_bytes"] = round((complete - empty) / n)
            out["restart"]["stall_max_complete_ms"] = round(
                client.stats().event_loop_stall_max_s * 1e3, 1
            )
            if args.account:
                out["restart"]["served_account"] = served_account
                out["restart"]["account"] = daemon.take_account()
            out["readback"] = read_back(client, sample, size)
            out["latency"] = chain_latency(client, keys, rng)
        daemon.stop()
    finally:
        daemon.kill()
    return out


# ---- streaming against fio ----------------------------------------------------------------
def fio_write(directory: Path, block_bytes: int, total_bytes: int, direct: bool) -> float:
    from kvtier.bench.fio import run_fio
    from kvtier.bench.results import totals

    scratch = directory / "fio-scratch"
    scratch.mkdir(exist_ok=True)
    try:
        job = argparse.Namespace(
            size=str(total_bytes),
            bs=str(block_bytes),
            iodepth=8,
            numjobs=1,
            rw="write",
            rwmixread=50,
            direct=direct,
            runtime=0,
            time_based=False,
        )
        bw_bytes, _ = totals(run_fio(job, scratch), "write")
        return float(bw_bytes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def stream(args: argparse.Namespace, root: Path, run_dir: Path) -> list[dict[str, Any]]:
    """Rounds of: per block size, this checkout's daemon and --baseline's (if given; in
    odd rounds the baseline first), then fio, back to back on the same directory
    (interleaved, so drift in the machine's load falls on both sides alike)."""
    from kvtier.tiers.nvme import supports_o_direct

    direct = supports_o_direct(root)
    have_fio = shutil.which("fio") is not None
    if not have_fio:
        print("fio not found: streaming is measured without its fio reference", flush=True)
    sides: list[tuple[str, Path | None]] = [("kvtier", None)]
    if args.baseline is not None:
        sides.append(("baseline", args.baseline.resolve()))
    if args.ceiling:
        sides.append(("ceiling", None))
    rows = []
    for round_ in range(args.rounds):
        # This checkout's and the baseline's daemon take turns going first (ABBA): the
        # first after fio's scratch file is deleted was slower in some rounds, whichever.
        order = sides
        if args.baseline is not None and round_ % 2:
            order = [sides[1], sides[0], *sides[2:]]
        for size in (64 << 10, 2 << 20):
            row: dict[str, Any] = {"round": round_, "block_bytes": size}
            for side, code in order:
                got = stream_once(args, root, run_dir, size, code, side == "ceiling")
                row.update({f"{side}_{k}": v for k, v in got.items()})
                print(f"round {round_} {human_size(size)} {side}: {got}", flush=True)
            if have_fio:
                reached = max(row["kvtier_blocks_on_nvme"], 1)
                fio_bw = fio_write(root, size, reached * size, direct)
                row["fio_mb_per_s"] = round(fio_bw / 1e6, 1)
                row["fio_direct"] = direct
                for side, _ in sides:
                    for figure in ("", "steady_"):
                        mb = row.get(f"{side}_{figure}mb_per_s")
                        if mb is not None:
                            ratio = round(mb * 1e6 / fio_bw, 3) if fio_bw else None
                            row[f"{side}_{figure}ratio"] = ratio
                print(f"round {round_} {human_size(size)} fio: {row['fio_mb_per_s']} MB/s")
            rows.append(row)
    return rows


def stream_once(
    args: argparse.Namespace,
    root: Path,
    run_dir: Path,
    size: int,
    code: Path | None,
    ceiling: bool = False,
) -> dict[str, Any]:
    """--stream-bytes of `size`-byte blocks put through the client (put_many of ~1 MiB)
    into a fresh daemon (of `code`'s checkout) whose DRAM is tiny; MB/s of the bytes that
    reached NVMe over the whole put, and the longest event-loop stall meanwhile. With
    `ceiling`, DRAM holds the whole stream instead and MB/s counts every byte put: what
    the put path alone reaches, with nothing demoted."""
    total = args.stream_bytes
    # A fresh daemon and tier each time: blocks of one size still in DRAM must not be
    # counted as the next size's demotions.
    nvme_dir = root / "stream-nvme"
    # Room for the whole stream by default; --stream-nvme smaller than it measures a tier
    # at its capacity (each block written pushes an older one out: a cache's steady state).
    nvme_bytes = args.stream_nvme or 2 * total + (256 << 20)
    dram = str(total + (64 << 20)) if ceiling else args.stream_dram
    daemon = Daemon(run_dir, nvme_dir, dram, nvme_bytes, args.policy, args.layout, code)
    keys = list(chain_keys(total // size, salt=size.to_bytes(8, "little")))
    # The steady state: the stream's second half, if the arena filled before it (the
    # first arena's worth of a stream stays in DRAM and writes nothing to NVMe, yet its
    # time is in the whole put's rate below).
    arena_blocks = parse_size(dram) // size
    steady_from = len(keys) // 2 if not ceiling and len(keys) // 2 >= arena_blocks else None
    marks: list[tuple[float, int, int]] = []

    def mark(writer: kvtier.Client, block: int) -> None:
        demotions = writer.stats().demotions
        marks.append((time.perf_counter(), demotions, block))

    try:
        daemon.start()
        daemon.wait_first_rpc(keys[0])
        with kvtier.Client(daemon.target, timeout_s=120) as client:
            before = client.stats()
            daemon_before, client_began_s = thread_cpu_ns(daemon.pid), time.process_time()
            began = time.perf_counter()
            if args.stream_jobs > 1:
                put_all_jobs(daemon.target, NS, keys, size, args.stream_jobs, steady_from, mark)
            else:
                put_all(client, NS, keys, size, steady_from, mark)
            ended = time.perf_counter()
            put_s = ended - began
            after = client.stats()  # read at once: few demotions land after `ended`
            daemon_after = thread_cpu_ns(daemon.pid)
            # The process's: --stream-jobs' writer threads have ended by now.
            client_cpu_s = time.process_time() - client_began_s
        daemon.stop()
    finally:
        daemon.kill()
        shutil.rmtree(nvme_dir, ignore_errors=True)
    # Written to NVMe by demotion (a full tier holds fewer: it evicted some of them).
    reached = after.demotions - before.demotions
    counted = len(keys) if ceiling else reached
    steady: dict[str, Any] = {}
    if marks and steady_from is not None:
        mark_s, mark_demotions, mark_block = marks[0]
        window_s = ended - mark_s
        steady = {
            "steady_blocks_put": len(keys) - mark_block,
            "steady_blocks_on_nvme": after.demotions - mark_demotions,
            "steady_mb_per_s": round((after.demotions - mark_demotions) * size / window_s / 1e6, 1),
            "steady_put_mb_per_s": round((len(keys) - mark_block) * size / window_s / 1e6, 1),
        }
    return {
        "blocks_put": len(keys),
        "blocks_on_nvme": reached,
        "mb_per_s": round(counted * size / put_s / 1e6, 1),
        **steady,
        "stall_max_ms": round(after.event_loop_stall_recent_max_s * 1e3, 1),
        "direct_io": after.nvme_direct_io,
        # Where a block's time goes (µs a block): wall, the daemon's loop thread on a CPU
        # and waiting for one, its other threads (I/O, gRPC), and this client's threads.
        "wall_us": round(put_s * 1e6 / max(len(keys), 1), 1),
        **loop_cpu_per_block(daemon.pid, daemon_before, daemon_after, len(keys)),
        "client_cpu_us": round(client_cpu_s * 1e6 / max(len(keys), 1), 1),
    }


# ---- the index alone, in process ----------------------------------------------------------
def in_process_memory(entries: int, policy: str, top: bool) -> dict[str, Any]:
    from kvtier.config import Config
    from kvtier.engine.store import Store
    from kvtier.index.catalog import Entry
    from kvtier.keys import namespace_id
    from kvtier.tiers.record import record_size_for

    ns_bytes = namespace_id("default", NS).encode()
    with tempfile.TemporaryDirectory(prefix="kvs-mem-") as scratch:
        config = Config.model_validate(
            {
                "dram": {"capacity_bytes": "1MiB", "prefault": False},
                "nvme": {"path": scratch, "capacity_bytes": 1 << 60},
                "policy": {"name": policy},
            }
        )
        store = Store(config)  # not started: no files, no tasks; its index is the subject
        record_bytes = record_size_for(ns_bytes.decode(), bytes(32), 4096)
        gc.collect()
        objects_before = len(gc.get_objects())
        rss_before = rss_anon_bytes(os.getpid())
        if top:
            tracemalloc.start()
        began = time.perf_counter()
        # As recovery adds a record: into the packed catalog's arrays where the code has
        # them (add_recovered), else an Entry per record (the code before issue 22's
        # catalog), so the one script measures both.
        add_recovered = getattr(store.residency, "add_recovered", None)
        add = store.residency.add
        fields = struct.Struct("<QQQ")
        header_bytes = record_bytes - 4096
        for generation, key in enumerate(chain_keys(entries), start=1):
            # As recovery builds an entry from a header: the namespace, the key and each
            # number decoded on their own (no object shared between entries).
            packed = fields.pack(4096, int.from_bytes(key[8:16], "little"), generation)
            size, xxh3, gen = fields.unpack(packed)
            block_id = (ns_bytes.decode(), key)
            if add_recovered is not None:
                add_recovered(block_id, size, xxh3, gen, header_bytes + size)
            else:
                add(Entry(block_id, size, xxh3, gen, nvme_record_bytes=header_bytes + size))
        build_s = time.perf_counter() - began
        snapshot = tracemalloc.take_snapshot() if top else None
        if top:
            tracemalloc.stop()
        gc.collect()
        rss_after = rss_anon_bytes(os.getpid())
        objects = len(gc.get_objects()) - objects_before
        began = time.perf_counter()
        gc.collect()
        gc_s = time.perf_counter() - began
        out: dict[str, Any] = {
            "entries": entries,
            "policy": policy,
            "build_s": round(build_s, 2),
            # With tracemalloc on, its own record of every allocation is in the RSS too.
            "rss_anon_delta_bytes": None if top else rss_after - rss_before,
            "rss_anon_per_entry_bytes": None if top else round((rss_after - rss_before) / entries),
            "gc_tracked_objects_per_entry": round(objects / entries, 2),
            "full_gc_s": round(gc_s, 3),
        }
        if snapshot is not None:
            stats = snapshot.statistics("lineno")
            traced = sum(s.size for s in stats)
            out["tracemalloc_per_entry_bytes"] = round(traced / entries)
            out["tracemalloc_top"] = [
                {
                    "where": f"{_short(frame.filename)}:{frame.lineno}",
                    "code": linecache.getline(frame.filename, frame.lineno).strip()[:60],
                    "bytes_per_entry": round(stat.size / entries, 1),
                    "blocks_per_entry": round(stat.count / entries, 2),
                }
                for stat in stats[:15]
                for frame in [stat.traceback[0]]
            ]
        del store
    return out


def _short(filename: str) -> str:
    """A source path from the package down (kvtier/index/policy.py), else its name."""
    parts = Path(filename).parts
    return "/".join(parts[parts.index("kvtier") :]) if "kvtier" in parts else Path(filename).name


# ---- report -------------------------------------------------------------------------------
def stream_report(stream_rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Per block size and side: median MB/s (range), median ratio to fio (each round's
    own fio), the longest stall over the rounds."""
    out: list[tuple[str, str]] = []
    for size in sorted({r["block_bytes"] for r in stream_rows}):
        rounds = [r for r in stream_rows if r["block_bytes"] == size]
        for side in ("kvtier", "baseline", "ceiling"):
            if f"{side}_mb_per_s" not in rounds[0]:
                continue
            mbs = [r[f"{side}_mb_per_s"] for r in rounds]
            ratios = [r[f"{side}_ratio"] for r in rounds if r.get(f"{side}_ratio") is not None]
            fio = (
                f"; vs fio {statistics.median(ratios):.3f}x (each round's own fio)"
                if ratios
                else " (fio not found)"
            )
            on_nvme = [r[f"{side}_blocks_on_nvme"] for r in rounds]
            out.append(
                (
                    f"stream {human_size(size)} to NVMe, {side}",
                    f"{round(statistics.median(mbs), 1)} MB/s ({min(mbs)}-{max(mbs)}, "
                    f"{len(mbs)} rounds; "
                    f"{min(on_nvme)}/{rounds[0][f'{side}_blocks_put']}+ on NVMe){fio}; "
                    f"stall max {max(r[f'{side}_stall_max_ms'] for r in rounds)} ms",
                )
            )
            steady_rows = [r for r in rounds if f"{side}_steady_mb_per_s" in r]
            steady = [r[f"{side}_steady_mb_per_s"] for r in steady_rows]
            if steady:
                key = f"{side}_steady_ratio"
                ratios = [r[key] for r in steady_rows if r.get(key) is not None]
                fio = (
                    f"; vs fio {statistics.median(ratios):.3f}x ({min(ratios)}-{max(ratios)})"
                    if ratios
                    else ""
                )
                out.append(
                    (
                        f"stream {human_size(size)} to NVMe, {side}, steady (its second half)",
                        f"{round(statistics.median(steady), 1)} MB/s ({min(steady)}-{max(steady)})"
                        f"{fio}",
                    )
                )
            if f"{side}_loop_cpu_us" in rounds[0]:
                names = ("wall_us", "loop_cpu_us", "loop_runq_us", "daemon_threads_cpu_us")
                us = {
                    n: round(statistics.median(r[f"{side}_{n}"] for r in rounds), 1) for n in names
                }
                client = round(statistics.median(r[f"{side}_client_cpu_us"] for r in rounds), 1)
                out.append(
                    (
                        f"stream {human_size(size)}, {side}: µs a block",
                        f"wall {us['wall_us']}; daemon loop on a CPU {us['loop_cpu_us']} "
                        f"(+{us['loop_runq_us']} waiting for one), its other threads "
                        f"{us['daemon_threads_cpu_us']}; client {client} (medians)",
                    )
                )
        fios = [r["fio_mb_per_s"] for r in rounds if "fio_mb_per_s" in r]
        if fios:
            out.append(
                (
                    f"stream {human_size(size)}: fio",
                    f"{statistics.median(fios)} MB/s ({min(fios)}-{max(fios)}, "
                    f"direct={int(rounds[0]['fio_direct'])})",
                )
            )
    return out


def print_report(result: dict[str, Any]) -> None:
    rows: list[tuple[str, str]] = []
    if "fill" in result:
        f, r = result["fill"], result["restart"]
        rows += [
            ("blocks x size", f"{f['blocks']} x {human_size(f['block_bytes'])}"),
            ("after fill: dram / nvme blocks", f"{f['dram_blocks']} / {f['nvme_blocks']}"),
            ("fill rate", f"{f['blocks_per_s']} blocks/s, {f['mb_per_s']} MB/s"),
            ("longest loop stall, fill", f"{f['stall_max_ms']} ms"),
            (
                "RssAnon per block, fill",
                f"{f['rss_anon_per_block_bytes']} B (raw {human_size(f['rss_anon_bytes'])}, "
                f"empty daemon {human_size(f['rss_anon_empty_bytes'])})",
            ),
            ("stop (SIGTERM, flush)", f"{r['stop_s']} s"),
            ("restart: first RPC", f"{r['ready_s']} s"),
            (f"restart: {r['sampled']} sampled keys served", f"{r['sampled_served_s']} s"),
            ("longest loop stall, restart", f"{r['stall_max_ms']} ms"),
            (
                "RssAnon per block, restart",
                f"{r['rss_anon_per_block_bytes']} B (raw {human_size(r['rss_anon_bytes'])})",
            ),
            ("restart: whole index in", f"{r['index_complete_s']} s"),
            ("longest loop stall, restart to index in", f"{r['stall_max_complete_ms']} ms"),
            (
                "RssAnon per block, index in (+2 s)",
                f"{r['rss_anon_complete_per_block_bytes']} B "
                f"(raw {human_size(r['rss_anon_complete_bytes'])})",
            ),
        ]
        b = result["readback"]
        rows.append(
            (
                "read back after restart",
                f"{b['bit_exact']}/{b['checked']} bit-exact, {b['wrong']} wrong, "
                f"{b['missing']} missing",
            )
        )
        lat = result["latency"]
        for name in ("lookup", "plan") if lat else ():
            rows.append(
                (
                    f"{name} of a {CHAIN_BLOCKS}-block chain",
                    f"p50 {lat[f'{name}_p50_ms']} ms, p99 {lat[f'{name}_p99_ms']} ms",
                )
            )
    rows += stream_report(result.get("stream", []))
    if "in_process" in result:
        m = result["in_process"]
        rows += [
            (f"in process: {m['entries']} entries", f"policy {m['policy']}, {m['build_s']} s"),
            (
                "  RssAnon per entry",
                "n/a (tracemalloc on)"
                if m["rss_anon_per_entry_bytes"] is None
                else f"{m['rss_anon_per_entry_bytes']} B",
            ),
            ("  GC-tracked objects per entry", str(m["gc_tracked_objects_per_entry"])),
            ("  one full gc.collect()", f"{m['full_gc_s']} s"),
        ]
        if "tracemalloc_per_entry_bytes" in m:
            rows.append(("  traced per entry", f"{m['tracemalloc_per_entry_bytes']} B"))
            rows += [
                (
                    f"    {t['where']}",
                    f"{t['bytes_per_entry']:6.1f} B, {t['blocks_per_entry']:4.2f} blocks  "
                    f"{t['code']}",
                )
                for t in m["tracemalloc_top"]
            ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--block-bytes", type=parse_size, default=4096)
    parser.add_argument("--directory", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--dram", default="32MiB", help="the filled daemon's DRAM arena")
    parser.add_argument("--sample", type=int, default=300, help="keys checked after restart")
    parser.add_argument("--stream-bytes", type=parse_size, default=512 << 20)
    parser.add_argument(
        "--stream-dram",
        default=STREAM_DRAM,
        help="the streaming daemon's DRAM arena (the stream should be several times it)",
    )
    parser.add_argument(
        "--stream-nvme",
        type=parse_size,
        default=0,
        help="the streaming daemon's NVMe capacity (default: room for the whole stream; "
        "smaller: the tier full, evicting as it writes)",
    )
    parser.add_argument("--skip-stream", action="store_true")
    parser.add_argument(
        "--stream-only", action="store_true", help="only the streaming phase (no fill/restart)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="streaming rounds (interleaved)")
    parser.add_argument(
        "--stream-jobs",
        type=int,
        default=1,
        help="writers streaming at once, each a client (session) of its own (fio's numjobs)",
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="also stream into a DRAM that holds it all (the put path alone, no demotion)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a checkout (e.g. a worktree of main) whose daemon streams in the same rounds",
    )
    parser.add_argument("--policy", default="kvtier", choices=("kvtier", "lru", "s3fifo"))
    parser.add_argument(
        "--layout", default="files", choices=("files", "segments"), help="nvme.layout"
    )
    parser.add_argument("--in-process-memory", type=int, default=0, metavar="N")
    parser.add_argument("--tracemalloc", action="store_true", help="with --in-process-memory")
    parser.add_argument(
        "--account",
        action="store_true",
        help="run the daemon under benchmarks/rss_account.py and account its RssAnon "
        "after the fill and after the restart (into --json)",
    )
    parser.add_argument(
        "--stall-trace",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the daemons with KVTIER_STALL_TRACE (fill.jsonl, restart.jsonl in DIR)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="leave the NVMe tier behind")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "kvtier_version": kvtier.__version__,
    }
    if args.in_process_memory:
        result["in_process"] = in_process_memory(
            args.in_process_memory, args.policy, args.tracemalloc
        )
    else:
        if args.blocks <= 0:
            parser.error("--blocks must be > 0")
        base = args.directory or Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="kvtier-scale-", dir=base))
        # A UNIX socket path must fit in 108 bytes: the daemon's run files stay short.
        run_dir = Path(tempfile.mkdtemp(prefix="kvs-"))
        try:
            if not args.stream_only:
                result.update(fill_and_restart(args, root, run_dir))
            if not args.skip_stream:
                result["stream"] = stream(args, root, run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        result["machine"]["directory"] = str(base)
    print_report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
