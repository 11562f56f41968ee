"""Client processes that fault rows kill, or run side by side: `python -m tests.faults._child`.

Each mode prints a line at each milestone ("midway", "holding ...", "ready", "done") so the
parent knows when to strike; modes that are meant to be killed then hang until SIGKILL.
Block contents come from `det_bytes`, which parent and child compute alike (the fixtures'
`block_bytes` is random per process).

    stream  TARGET NS KEY SIZE OVERWRITE   gRPC Put stream, stops halfway and hangs
    reserve TARGET NS SIZE KEY...          commits one block, reserves KEYs, writes half
    acquire TARGET NS KEY...               one Acquire (one lease) per KEY, no Release
    history TARGET NS PROC OPS SEED KEYS OUT   waits for "go" on stdin, then random
                                           put/get/delete, each logged to OUT (JSON)
"""

from __future__ import annotations

import dataclasses
import json
import random
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CHUNK_BYTES = 1 << 20
COMMITTED_KEY = "committed-by-the-dead-client"
COMMITTED_SEED = 4242
COMMITTED_BYTES = 1 << 20
# History values: between these sizes, so that ~16 keys outgrow a 2 MiB DRAM tier.
VALUE_MIN_BYTES = 64 << 10
VALUE_MAX_BYTES = 256 << 10
_HEAD = struct.Struct("<II")


def det_bytes(seed: int, size_bytes: int) -> bytes:
    """The same bytes for `seed` in every process."""
    return random.Random(seed).randbytes(size_bytes)


def history_value(proc: int, seq: int) -> bytes:
    """The value process `proc` puts at step `seq`: its first 8 bytes name (proc, seq)."""
    rng = random.Random((proc << 32) | seq)
    size = rng.randrange(VALUE_MIN_BYTES, VALUE_MAX_BYTES + 1)
    return _HEAD.pack(proc, seq) + rng.randbytes(size - _HEAD.size)


def history_origin(data: bytes) -> tuple[int, int] | None:
    """(proc, seq) of a value read back, if its bytes are exactly that put's value."""
    if len(data) < _HEAD.size:
        return None
    proc, seq = _HEAD.unpack_from(data)
    if proc > 1000 or seq > 1_000_000 or history_value(proc, seq) != data:
        return None
    return proc, seq


def spawn(mode: str, *args: object) -> subprocess.Popen[str]:
    """Start a child in `mode` (from the parent test)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.faults._child", mode, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )


def expect_line(proc: subprocess.Popen[str], word: str) -> str:
    """The child's next stdout line, which must start with `word` (else its stderr)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(word):
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"child said {line!r} instead of {word!r}:\n{err}")
    return line


# ---- the child's side ----------------------------------------------------------------------
def _say(line: str) -> None:
    print(line, flush=True)


def _hang() -> None:
    while True:
        time.sleep(3600)


def _stream(target: str, ns: str, key: str, size: int, overwrite: bool) -> None:
    import grpc

    from kvtier._proto import kvtier_pb2 as pb
    from kvtier._proto import kvtier_pb2_grpc as pb_grpc

    data = det_bytes(size, size)

    def messages() -> Any:
        yield pb.PutRequest(
            header=pb.PutHeader(
                namespace=ns, key=key.encode(), size_bytes=size, overwrite=overwrite
            )
        )
        half = size // 2
        for start in range(0, half, CHUNK_BYTES):
            yield pb.PutRequest(chunk=data[start : min(start + CHUNK_BYTES, half)])
        _say(f"midway {half}")
        _hang()  # the call stays open, half sent, until the parent kills this process

    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 8 << 20)])
    pb_grpc.KVTierStub(channel).Put(messages())
    _say("finished")  # never: the stream does not end


def _reserve(target: str, ns: str, size: int, keys: list[str]) -> None:
    import kvtier
    from kvtier._proto import kvtier_pb2 as pb
    from kvtier._session import Op

    client = kvtier.Client(target)
    client.put_from(ns, COMMITTED_KEY, det_bytes(COMMITTED_SEED, COMMITTED_BYTES))
    _say("committed")
    arena = client._shared_arena()
    assert arena is not None, "no zero-copy session"
    items = [pb.ReserveItem(key=k.encode(), size_bytes=size) for k in keys]
    res = arena.call(
        Op.RESERVE,
        pb.ReserveRequest(namespace=ns, items=items, overwrite=True),
        pb.ReserveResponse,
    )
    for slot in res.slots:  # half of each slot written, then no Commit
        half = slot.size_bytes // 2
        arena.slot(slot)[:half] = b"\x01" * half
    _say(f"holding {len(res.slots)}")
    _hang()


def _acquire(target: str, ns: str, keys: list[str]) -> None:
    import kvtier
    from kvtier._proto import kvtier_pb2 as pb
    from kvtier._session import Op

    client = kvtier.Client(target)
    arena = client._shared_arena()
    assert arena is not None, "no zero-copy session"
    leases = 0
    for key in keys:
        resp = arena.call(
            Op.ACQUIRE, pb.AcquireRequest(namespace=ns, keys=[key.encode()]), pb.AcquireResponse
        )
        leases += resp.lease_id != 0
    _say(f"holding {leases}")
    _hang()


def _history(target: str, ns: str, proc: int, ops: int, seed: int, keys: int, out: str) -> None:
    import kvtier

    rng = random.Random(seed)
    client = kvtier.Client(target)
    sink = bytearray(VALUE_MAX_BYTES)
    client.get_into(ns, "warm-up", sink)  # attach the zero-copy session before the clock runs
    _say("ready")
    assert sys.stdin.readline().strip() == "go"
    log: list[dict[str, Any]] = []
    for seq in range(ops):
        key = f"k{rng.randrange(keys):02d}"
        roll = rng.random()
        via = "zc" if rng.random() < 0.5 else "grpc"
        rec: dict[str, Any] = {"proc": proc, "seq": seq, "key": key, "via": via, "ok": True}
        value = None
        if roll < 0.4:
            rec["op"] = "put"
            value = history_value(proc, seq)
        elif roll < 0.85:
            rec["op"] = "get"
        else:
            rec["op"] = "delete"
        rec["inv"] = time.monotonic()
        try:
            if rec["op"] == "put":
                assert value is not None
                if via == "zc":
                    client.put_from(ns, key, value, overwrite=True)
                else:
                    client.put(ns, key, value, overwrite=True)
            elif rec["op"] == "delete":
                client.delete(ns, key)
            elif via == "zc":
                size = client.get_into(ns, key, sink)
                got = None if size is None else bytes(sink[:size])
            else:
                got = client.get(ns, key)
        except kvtier.KVTierError as err:
            rec["ok"] = False
            rec["error"] = f"{type(err).__name__}: {err}"
        rec["comp"] = time.monotonic()
        if rec["op"] == "get" and rec["ok"]:
            rec["hit"] = got is not None
            origin = None if got is None else history_origin(got)
            rec["origin"] = list(origin) if origin else None
            rec["size"] = None if got is None else len(got)
        log.append(rec)
    stats = client.stats()
    client.close()
    Path(out).write_text(json.dumps({"log": log, "stats": dataclasses.asdict(stats)}))
    _say("done")


def main(argv: list[str]) -> None:
    mode, target, ns, *rest = argv
    if mode == "stream":
        _stream(target, ns, rest[0], int(rest[1]), rest[2] == "1")
    elif mode == "reserve":
        _reserve(target, ns, int(rest[0]), rest[1:])
    elif mode == "acquire":
        _acquire(target, ns, rest)
    elif mode == "history":
        proc, ops, seed, keys = map(int, rest[:4])
        _history(target, ns, proc, ops, seed, keys, rest[4])
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
