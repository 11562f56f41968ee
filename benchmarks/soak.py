#!/usr/bin/env python3
"""Soak: many clients, every operation, faults at a low rate, for N minutes (loopback only).

    python benchmarks/soak.py --minutes 10 --seed 1 [--layout segments] [--json out.json]

A real `kvtier serve` on a UNIX socket in a temporary directory, two tenants, a DRAM
tier small enough that blocks move to NVMe and back. Client threads (each owning its own
keys, so the shadow of what each key may hold is exact) put, get, put_from/get_into
(zero-copy), put_many/get_many, lookup, stat, plan, delete and stats. Faults, all seeded:
failpoints in the daemon (EIO on read and delete, short writes) at a low rate, bit flips
in record files on disk, SIGKILL of the daemon then a restart, and client processes
SIGKILLed in the middle of a zero-copy batch, a streamed put or while holding leases.
At the end every key is checked, everything is deleted, and every tier and the disk must
be empty again.

Prints operations done, faults injected, wrong bytes served (must be 0) and leaked
capacity (must be 0); exits 1 if either is not. The shadow keeps a 128-bit fingerprint
of each value, not the value: a run puts tens of GB (a 5-minute run that kept every value
was killed for memory on a 24 GiB machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

import kvtier
from kvtier.keys import hash_token

TENANTS = {"alice": "soak-token-alice-0001", "bob": "soak-token-bob-00002"}
FAILPOINTS = "nvme.read=eio@0.003,nvme.remove=eio@0.003,nvme.pwrite=short@0.02"
SIZES_BYTES = (4096, 64 << 10, 256 << 10, 1 << 20)
NS = "soak/model"


@dataclass
class Tally:
    ops: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    wrong_bytes: int = 0
    wrong_examples: list[str] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def op(self, name: str) -> None:
        with self.lock:
            self.ops[name] += 1

    def wrong(self, what: str) -> None:
        with self.lock:
            self.wrong_bytes += 1
            if len(self.wrong_examples) < 20:
                self.wrong_examples.append(what)


class Daemon:
    def __init__(self, workdir: Path, dram: str, nvme: str, layout: str = "files") -> None:
        self.workdir = workdir
        self.layout = layout
        self.socket = workdir / "kvtier.sock"
        self.log_path = workdir / "daemon.log"
        config = workdir / "soak.toml"
        config.write_text(
            "[auth.tokens]\n"
            + "".join(f'"{hash_token(t)}" = "{n}"\n' for n, t in TENANTS.items())
            + "".join(f'[tenants.{n}]\ndram_capacity_bytes = "{dram}"\n' for n in TENANTS)
        )
        self.args = [
            sys.executable, "-m", "kvtier", "serve",
            "--listen", f"unix://{self.socket}",
            "--nvme-path", str(workdir / "nvme"),
            "--nvme-capacity", nvme,
            "--config", str(config),
        ]  # fmt: skip
        self.proc: subprocess.Popen[str] | None = None
        self.up = threading.Event()

    def start(self, seed: int) -> None:
        env = dict(
            os.environ,
            KVTIER_FAILPOINTS=FAILPOINTS,
            KVTIER_FAILPOINTS_SEED=str(seed),
            KVTIER_NVME__OFFLINE_AFTER_ERRORS="50",
            KVTIER_NVME__OFFLINE_RETRY_S="1",
            KVTIER_PLANNER__CALIBRATION_S="0",
            KVTIER_NVME__LAYOUT=self.layout,
        )
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=subprocess.PIPE, stderr=log, text=True, env=env
            )
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        banner = self.proc.stdout.readline() if sel.select(60) else ""
        if "serving on" not in banner:
            raise SystemExit(f"daemon did not start; see {self.log_path}")
        # It serves while its NVMe index fills; the tally wants every acknowledged block.
        if "recovering its index" in banner and "NVMe index recovered" not in (
            self.proc.stdout.readline()
        ):
            raise SystemExit(f"daemon did not recover its NVMe index; see {self.log_path}")
        self.up.set()

    def kill(self) -> None:
        self.up.clear()
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
            assert self.proc.stdout is not None
            self.proc.stdout.close()

    def stop(self) -> None:
        self.up.clear()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)
            assert self.proc.stdout is not None
            self.proc.stdout.close()

    def client(self, tenant: str) -> kvtier.Client:
        return kvtier.Client(f"unix://{self.socket}", token=TENANTS[tenant], timeout_s=30)


def payload(rng: random.Random, size_bytes: int) -> bytes:
    return rng.randbytes(size_bytes)


def fingerprint(data: bytes) -> int:
    """What the shadow keeps of a value: xxh3-128 (an accidental match is 2^-128)."""
    return int(xxhash.xxh3_128_intdigest(data))


class Worker(threading.Thread):
    """One client: its own keys, a shadow of what each may hold, every operation."""

    def __init__(self, n: int, daemon: Daemon, tally: Tally, seed: int, stop: threading.Event):
        super().__init__(name=f"client-{n}", daemon=True)
        self.n = n
        self.tenant = list(TENANTS)[n % len(TENANTS)]
        self.daemon_ = daemon
        self.tally = tally
        self.rng = random.Random(seed * 1000 + n)
        self.stop_ = stop
        # key -> fingerprints of the values a get may return (a miss always may): one
        # after an acknowledged put, more while a put or delete is in doubt.
        self.allowed: dict[str, set[int]] = {}
        self.keys = [f"c{n}-k{i}" for i in range(48)]
        # Every value put (its fingerprint), to explain a wrong one.
        self.history: dict[str, list[int]] = {}

    def allow(self, key: str, data: bytes) -> int:
        """`data` may now be read under `key` (a put in doubt); its fingerprint, which
        alone is allowed once the put is acknowledged."""
        fp = fingerprint(data)
        self.allowed.setdefault(key, set()).add(fp)
        self.history.setdefault(key, []).append(fp)
        return fp

    def check(self, key: str, got: bytes | None, how: str) -> None:
        if got is None:
            return
        fp = fingerprint(got)
        if fp not in self.allowed.get(key, set()):
            past = self.history.get(key, [])
            what = (
                f"an older value (put #{past.index(fp) + 1} of {len(past)})"
                if fp in past
                else "all zeros"
                if not got.strip(b"\0")
                else "bytes never put under this key"
            )
            self.tally.wrong(f"{self.tenant}/{key} via {how}: {len(got)} bytes, {what}")

    def run(self) -> None:
        client: kvtier.Client | None = None
        while not self.stop_.is_set():
            if not self.daemon_.up.wait(1):
                continue
            if client is None:
                client = self.daemon_.client(self.tenant)
            try:
                self.step(client)
            except kvtier.KVTierError as err:
                self.tally.errors[type(err).__name__] += 1
                client.close()
                client = None
                time.sleep(0.05)
        if client is not None:
            client.close()

    def step(self, client: kvtier.Client) -> None:
        rng = self.rng
        key = rng.choice(self.keys)
        roll = rng.random()
        if roll < 0.22:
            data = payload(rng, rng.choice(SIZES_BYTES))
            zero_copy = rng.random() < 0.5
            fp = self.allow(key, data)  # in doubt until acknowledged
            if zero_copy:
                client.put_from(NS, key, data, overwrite=True)
            else:
                client.put(NS, key, data, overwrite=True)
            self.allowed[key] = {fp}
            self.tally.op("put_from" if zero_copy else "put")
        elif roll < 0.52:
            if rng.random() < 0.5:
                self.check(key, client.get(NS, key), "get")
                self.tally.op("get")
            else:
                buf = bytearray(max(SIZES_BYTES))
                n = client.get_into(NS, key, buf)
                self.check(key, None if n is None else bytes(buf[:n]), "get_into")
                self.tally.op("get_into")
        elif roll < 0.62:
            batch = rng.sample(self.keys, 4)
            datas = [payload(rng, rng.choice(SIZES_BYTES[:3])) for _ in batch]
            fps = [self.allow(k, d) for k, d in zip(batch, datas, strict=True)]
            client.put_many(NS, list(zip(batch, datas, strict=True)), overwrite=True)
            for k, fp in zip(batch, fps, strict=True):
                self.allowed[k] = {fp}
            self.tally.op("put_many")
        elif roll < 0.72:
            batch = rng.sample(self.keys, 4)
            bufs = [bytearray(max(SIZES_BYTES)) for _ in batch]
            sizes = client.get_many(NS, batch, bufs)
            for k, b, n in zip(batch, bufs, sizes, strict=True):
                self.check(k, None if n is None else bytes(b[:n]), "get_many")
            self.tally.op("get_many")
        elif roll < 0.80:
            client.lookup(NS, rng.sample(self.keys, 8))
            self.tally.op("lookup")
        elif roll < 0.85:
            client.stat(NS, key)
            self.tally.op("stat")
        elif roll < 0.90:
            client.plan(NS, rng.sample(self.keys, 8), tokens_per_block=16)
            self.tally.op("plan")
        elif roll < 0.98:
            # In doubt until acknowledged: the old values stay allowed (so does a miss).
            client.delete(NS, key)
            self.allowed.pop(key, None)
            self.tally.op("delete")
        else:
            client.stats()
            self.tally.op("stats")

    def final_check(self, client: kvtier.Client) -> None:
        for key in self.keys:
            self.check(key, client.get(NS, key), "final get")
            self.tally.op("get")


# A client process killed at a random moment of a batch put, a streamed put or a lease.
_DOOMED_CLIENT = """
import os, sys, kvtier
c = kvtier.Client(sys.argv[1], token=sys.argv[2])
big = os.urandom(3 << 20)
while True:
    items = [(f"d{i}", big[i << 18 : (i + 1) << 18]) for i in range(8)]
    c.put_many("soak/doomed", items, overwrite=True)
    c.put("soak/doomed", "stream", big, overwrite=True)
    c.get_many("soak/doomed", [f"d{i}" for i in range(8)], [bytearray(1 << 18) for _ in range(8)])
"""


def kill_a_client(daemon: Daemon, rng: random.Random) -> bool:
    tenant = rng.choice(list(TENANTS))
    proc = subprocess.Popen(
        [sys.executable, "-c", _DOOMED_CLIENT, f"unix://{daemon.socket}", TENANTS[tenant]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.4 + rng.random() * 0.6)  # python start-up, then somewhere in the loop
    alive = proc.poll() is None
    proc.kill()
    proc.wait(30)
    return alive


def on_disk(nvme_dir: Path) -> list[Path]:
    """The tier's record files (the file layout) or segment files (the segment layout)."""
    return sorted((nvme_dir / "v1").glob("*/*.kvr")) + sorted((nvme_dir / "segments").glob("*.kvs"))


def flip_a_record(nvme_dir: Path, rng: random.Random) -> bool:
    """Flip one bit anywhere in one file of the tier: a record's header or payload, or in
    the segment layout also a segment's header, footer or trailer."""
    records = on_disk(nvme_dir)
    if not records:
        return False
    path = rng.choice(records)
    try:
        size = path.stat().st_size
        with path.open("r+b") as fh:
            offset = rng.randrange(size)
            fh.seek(offset)
            byte = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
    except (FileNotFoundError, IndexError):
        return False  # removed or recycled under us: no fault injected
    return True


def leaked(daemon: Daemon, workers: list[Worker], deadline_s: float) -> dict[str, int]:
    """Delete every key; then every tier, every lease and the disk must come back to empty."""
    for tenant in TENANTS:
        with daemon.client(tenant) as c:
            for w in workers:
                if w.tenant == tenant:
                    for key in w.keys:
                        c.delete(NS, key)
            for key in [*(f"d{i}" for i in range(8)), "stream"]:
                c.delete("soak/doomed", key)
    nvme_dir = daemon.workdir / "nvme"
    while True:
        with daemon.client("alice") as c:
            stats = c.stats()
        out = {
            "dram_used_bytes": stats["tiers"]["dram"]["used_bytes"],
            "nvme_used_bytes": stats["tiers"]["nvme"]["used_bytes"],
            "blocks": stats["tiers"]["dram"]["blocks"] + stats["tiers"]["nvme"]["blocks"],
            "leases": stats["leases"],
            "record_files": len(list((nvme_dir / "v1").glob("*/*.kvr"))),
            "temporary_files": len(list((nvme_dir / "tmp").glob("*"))),
            # Segments without a live record are deleted by the reclaimer; the one being
            # appended to and the one reclaim copies into stay.
            "segment_files_past_two": max(0, len(list((nvme_dir / "segments").glob("*.kvs"))) - 2),
        }
        if not any(out.values()) or time.monotonic() > deadline_s:
            return out
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--dram", default="12MiB", help="DRAM arena per tenant")
    parser.add_argument("--nvme", default="256MiB")
    parser.add_argument("--layout", choices=["files", "segments"], default="files")
    parser.add_argument("--kill-every-s", type=float, default=45.0)
    parser.add_argument("--flip-every-s", type=float, default=7.0)
    parser.add_argument("--client-kill-every-s", type=float, default=10.0)
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="kvt-soak-"))
    rng = random.Random(args.seed)
    tally = Tally()
    daemon = Daemon(workdir, args.dram, args.nvme, args.layout)
    daemon.start(args.seed)
    stop = threading.Event()
    workers = [Worker(n, daemon, tally, args.seed, stop) for n in range(args.clients)]
    for w in workers:
        w.start()
    started_s = time.monotonic()
    end_s = started_s + args.minutes * 60
    next_kill_s = started_s + args.kill_every_s * (0.5 + rng.random())
    next_flip_s = started_s + args.flip_every_s
    next_client_kill_s = started_s + args.client_kill_every_s
    restarts = 0
    quiet_end_s = min(20.0, args.minutes * 20)  # no daemon kill in the last third/20 s
    while time.monotonic() < end_s:
        time.sleep(0.2)
        now = time.monotonic()
        if now >= next_flip_s:
            tally.faults["bit flip in a tier file"] += flip_a_record(workdir / "nvme", rng)
            next_flip_s = now + args.flip_every_s * (0.5 + rng.random())
        if now >= next_client_kill_s and daemon.up.is_set():
            tally.faults["client process SIGKILLed mid-call"] += kill_a_client(daemon, rng)
            next_client_kill_s = now + args.client_kill_every_s * (0.5 + rng.random())
        if now >= next_kill_s and now < end_s - quiet_end_s:
            daemon.kill()
            tally.faults["SIGKILL of the daemon"] += 1
            restarts += 1
            daemon.start(args.seed + restarts)
            next_kill_s = now + args.kill_every_s * (0.5 + rng.random())
    stop.set()
    for w in workers:
        w.join(120)
    for w in workers:
        with daemon.client(w.tenant) as c:
            w.final_check(c)
    log = daemon.log_path.read_text()
    for point, action in re.findall(r"failpoint (\S+) fired: (\S+)", log):
        tally.faults[f"failpoint {point}={action}"] += 1
    leak = leaked(daemon, workers, time.monotonic() + 60)
    daemon.stop()
    result: dict[str, Any] = {
        "minutes": args.minutes,
        "seed": args.seed,
        "layout": args.layout,
        "clients": args.clients,
        "operations": sum(tally.ops.values()),
        "operations_by_kind": dict(sorted(tally.ops.items())),
        "faults_injected": sum(tally.faults.values()),
        "faults_by_kind": dict(sorted(tally.faults.items())),
        "client_errors_by_kind": dict(sorted(tally.errors.items())),
        "wrong_bytes_served": tally.wrong_bytes,
        "wrong_examples": tally.wrong_examples,
        "leaked": leak,
        "leaked_capacity_bytes": leak["dram_used_bytes"] + leak["nvme_used_bytes"],
        "daemon_restarts": restarts,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"work directory kept: {workdir}", file=sys.stderr)
    return 1 if tally.wrong_bytes or any(leak.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
