"""A buggy engine must not corrupt what others read (issue 24 A).

A child process of the same tenant puts blocks through the zero-copy path, then writes
over every byte of every kvtier mapping it holds, as a use-after-release bug would (with
`memset` through ctypes, as C code would: a read-only mapping kills it with SIGSEGV,
which is its own business). A fresh client then reads every block on every path and
must get exactly the committed bytes or a miss, never an exception; the daemon keeps
serving."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import Op
from tests.conftest import DaemonProcess

NS = "llama3-8b/scribble"
BLOCKS = 16
BLOCK = 256 << 10
EMULATE = {"KVTIER_GPU__EMULATE": "true"}
StartDaemon = Callable[..., DaemonProcess]


def block_bytes(seed: int, size_bytes: int) -> bytes:
    """The same bytes in this process and the child (tests.conftest's are per process)."""
    return bytes(random.Random(seed).getrandbits(8) for _ in range(64)) * (size_bytes // 64)


CHILD = textwrap.dedent("""
    import ctypes, random, sys, xxhash
    import kvtier
    from kvtier._proto import kvtier_pb2 as pb
    from kvtier._session import Op

    def block_bytes(seed, size):
        return bytes(random.Random(seed).getrandbits(8) for _ in range(64)) * (size // 64)

    target, ns, mode, count, size = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:6])
    libc = ctypes.CDLL(None, use_errno=True)

    def say(line):
        print(line, flush=True)

    def mappings():
        out = []
        for line in open("/proc/self/maps"):
            if "memfd:kvtier" in line:
                span, perms = line.split()[:2]
                start, end = (int(x, 16) for x in span.split("-"))
                out.append((start, end - start, perms, line.split()[-2]))
        return out

    client = kvtier.Client(target)
    blocks = [(f"b{i}", block_bytes(i, size)) for i in range(count)]
    if mode == "reserve":  # slots written right, then scribbled, then committed
        arena = client._shared_arena()
        res = arena.call(Op.RESERVE, pb.ReserveRequest(namespace=ns, items=[
            pb.ReserveItem(key=k.encode(), size_bytes=len(d)) for k, d in blocks]),
            pb.ReserveResponse)
        for slot, (_, data) in zip(res.slots, blocks):
            arena.slot(slot)[:] = data
        for start, length, perms, _ in mappings():
            if "w" in perms:
                ctypes.memset(start, 0xAB, length)
        done = arena.call(Op.COMMIT, pb.CommitRequest(lease_id=res.lease_id, xxh3_64=[
            xxhash.xxh3_64_intdigest(d) for _, d in blocks]), pb.CommitResponse)
        say("committed " + " ".join(str(r.code) for r in done.results))
    else:
        assert client.put_many(ns, blocks) == [True] * count
        say("put")
    if mode == "release":  # read them once, released: then scribble
        sinks = [bytearray(size) for _ in blocks]
        client.get_many(ns, [k for k, _ in blocks], sinks)
    if mode == "lease":  # the parent reads a lease meanwhile
        sys.stdin.readline()
    maps = mappings()
    say("maps " + " ".join(p for _, _, p, _ in maps))
    for start, length, perms, _ in sorted(maps, key=lambda m: "w" not in m[2]):
        say(f"scribbling {perms}")
        # A real bug does not look at the permissions first; read-only ones SIGSEGV here.
        ctypes.memset(start, 0xAB, length)
        say(f"scribbled {perms}")
    say("done")
""")


def _scribbler(daemon: DaemonProcess, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, daemon.target, NS, mode, str(BLOCKS), str(BLOCK)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _read_every_path(daemon: DaemonProcess, engine_file: Path) -> dict[str, int]:
    """Reads every block on every path; returns how many were served (not missed), per
    path. A wrong byte or an exception fails the test."""
    keys = [f"b{i}" for i in range(BLOCKS)]
    want = {k: block_bytes(i, BLOCK) for i, k in enumerate(keys)}
    served: dict[str, int] = {}

    def check(path: str, key: str, got: bytes | None) -> None:
        assert got is None or got == want[key], f"{path} returned wrong bytes for {key}"
        served[path] = served.get(path, 0) + (got is not None)

    with daemon.client() as reader:
        for key in keys:
            check("get", key, reader.get(NS, key))
        for verify in (False, True):
            for key in keys:
                sink = bytearray(BLOCK)
                n = reader.get_into(NS, key, sink, verify=verify)
                check(f"get_into verify={verify}", key, bytes(sink[:n]) if n else None)
            sinks = [bytearray(BLOCK) for _ in keys]
            sizes = reader.get_many(NS, keys, sinks, verify=verify)
            for key, sink, n in zip(keys, sinks, sizes, strict=True):
                check(f"get_many verify={verify}", key, bytes(sink[:n]) if n else None)
        arena = reader._shared_arena()
        assert arena is not None
        lease = arena.call(
            Op.ACQUIRE,
            pb.AcquireRequest(namespace=NS, keys=[k.encode() for k in keys]),
            pb.AcquireResponse,
        )
        for key, block in zip(keys, lease.blocks, strict=True):
            got = bytes(arena.view[block.offset : block.offset + block.size_bytes])
            check("leased", key, got if block.found else None)
        arena.send(Op.RELEASE, pb.ReleaseRequest(lease_ids=[lease.lease_id]))
        engine_file.write_bytes(bytes(BLOCKS * BLOCK))
        buffer_id = reader.register_cuda_handle(0, str(engine_file).encode(), 0, BLOCKS * BLOCK)
        found = reader.get_into_cuda(
            NS, [k.encode() for k in keys], buffer_id, [(i * BLOCK, BLOCK) for i in range(BLOCKS)]
        )
        now = engine_file.read_bytes()
        for i, (key, hit) in enumerate(zip(keys, found, strict=True)):
            check("gpu", key, now[i * BLOCK : (i + 1) * BLOCK] if hit else None)
        assert reader.stats()["checksum_failures"] == 0, "nothing could damage a DRAM block"
    return served


@pytest.mark.parametrize("mode", ["after_put", "release", "reserve"])
def test_a_scribbling_client_never_changes_what_others_read(
    start_daemon: StartDaemon, workdir: Path, mode: str
) -> None:
    daemon = start_daemon(dram="64MiB", env=EMULATE)
    child = _scribbler(daemon, mode)
    out, err = child.communicate(timeout=60)
    assert "scribbled rw-s" in out, out + err
    assert "scribbled r--s" not in out, "the arena mapping took the write:\n" + out
    served = _read_every_path(daemon, workdir / "engine-kv.bin")
    if mode == "reserve":
        codes = out.split("committed ")[1].split("\n")[0].split()
        assert len(codes) == BLOCKS and "0" not in codes, out
        assert not any(served.values()), "a commit of scribbled slots stored something"
    else:
        assert served == dict.fromkeys(served, BLOCKS), "committed blocks must still be served"
    assert daemon.client().stats()["leases"] == 0


def test_a_scribble_over_a_leased_block_being_read_changes_nothing(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    daemon = start_daemon(dram="64MiB", env=EMULATE)
    child = _scribbler(daemon, "lease")
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "put"
    with daemon.client() as reader:
        arena = reader._shared_arena()
        assert arena is not None
        keys = [f"b{i}".encode() for i in range(BLOCKS)]
        lease = arena.call(
            Op.ACQUIRE, pb.AcquireRequest(namespace=NS, keys=keys), pb.AcquireResponse
        )
        child.stdin.write("go\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=60)
        assert "scribbled rw-s" in out and "scribbled r--s" not in out, out
        for i, block in enumerate(lease.blocks):
            got = bytes(arena.view[block.offset : block.offset + block.size_bytes])
            assert got == block_bytes(i, BLOCK), f"leased block {i} changed under its reader"
        arena.send(Op.RELEASE, pb.ReleaseRequest(lease_ids=[lease.lease_id]))
    served = _read_every_path(daemon, workdir / "engine-kv.bin")
    assert served == dict.fromkeys(served, BLOCKS)
