"""Fault row: several processes put, get and delete the same keys at once, checked against
the history of what they did.

Each key is a register. Every op is logged with its invocation and completion time
(time.monotonic is system-wide on Linux, so the four processes' clocks agree) and its
result. A get that returns bytes must return exactly the value of some put of that key
that was invoked before the get completed and that was not superseded before the get was
invoked: no other put or delete of the key invoked after that put completed and completed
before the get was invoked. A miss is always allowed (it is a cache), but counted.
The DRAM tier is 2 MiB against ~2.5 MiB of live values, so blocks are evicted to NVMe and
promoted back (zero-copy gets) throughout.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import DaemonProcess
from tests.faults import _child
from tests.faults.harness import Report, Row, Shadow, check_all, still_serves

NS = "faults/concurrency"
StartDaemon = Callable[..., DaemonProcess]
PROCS = 4
OPS_PER_PROC = 300
KEYS = 16
Op = dict[str, Any]


def conflicting_pairs(ops: list[Op]) -> int:
    """Pairs of ops on the same key, from different processes, overlapping in time, at
    least one of them a write."""
    by_key: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        by_key[op["key"]].append(op)
    pairs = 0
    for key_ops in by_key.values():
        key_ops.sort(key=lambda o: o["inv"])
        for i, a in enumerate(key_ops):
            for b in key_ops[i + 1 :]:
                if b["inv"] >= a["comp"]:
                    break
                if a["proc"] != b["proc"] and not a["op"] == b["op"] == "get":
                    pairs += 1
    return pairs


def check_register(row: Row, ops: list[Op]) -> Counter[str]:
    """Check every get of the history against the puts and deletes of its key."""
    puts = {(o["proc"], o["seq"]): o for o in ops if o["op"] == "put"}
    writes: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        if o["op"] != "get" and o["ok"]:  # a failed write may have happened, never "before"
            writes[o["key"]].append(o)
    seen: Counter[str] = Counter()
    for get in (o for o in ops if o["op"] == "get"):
        if not get["ok"]:
            seen["get errors"] += 1
            row.notes.append(f"get failed: {get['error']}")
            continue
        row.gets_checked += 1
        if not get["hit"]:
            seen["misses"] += 1
            continue
        seen["hits"] += 1
        origin = get["origin"]
        put = puts.get(tuple(origin)) if origin else None
        if put is None or put["key"] != get["key"]:
            row.wrong_bytes += 1
            row.notes.append(f"{get['key']}: {get['size']} bytes that no put of it wrote")
            continue
        if put["inv"] >= get["comp"]:
            row.wrong_bytes += 1
            row.notes.append(f"{get['key']}: a value read before its put began {origin}")
            continue
        newer = [
            w
            for w in writes[get["key"]]
            if w is not put and w["inv"] > put["comp"] and w["comp"] < get["inv"]
        ]
        if newer:
            row.wrong_bytes += 1
            row.notes.append(
                f"{get['key']}: stale value {origin}, superseded by "
                f"{newer[0]['op']} {newer[0]['proc']}/{newer[0]['seq']}"
            )
    return seen


def final_shadow(ops: list[Op]) -> Shadow:
    """Per key, the values the history may have left: each put (acknowledged or failed, so
    in doubt) that no acknowledged put or delete invoked after its completion followed."""
    shadow = Shadow()
    writes: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        if o["op"] != "get":
            writes[o["key"]].append(o)
    for key, key_writes in writes.items():
        for w in key_writes:
            followed = any(v["ok"] and v["inv"] > w["comp"] for v in key_writes)
            if w["op"] == "put" and not followed:
                shadow.put(NS, key, _child.history_value(w["proc"], w["seq"]), acknowledged=False)
    return shadow


def test_concurrent_put_get_delete_of_the_same_keys(
    start_daemon: StartDaemon, report: Report, tmp_path: Path
) -> None:
    row = report.row(
        "concurrent put/get/delete of the same keys",
        f"{PROCS} processes x {OPS_PER_PROC} random ops over {KEYS} keys (gRPC and "
        "zero-copy, overwrite), history checked per key as a register",
    )
    daemon = start_daemon(dram="2MiB", nvme="256MiB")
    outs = [tmp_path / f"history{p}.json" for p in range(PROCS)]
    children = [
        _child.spawn("history", daemon.target, NS, p, OPS_PER_PROC, 1000 + p, KEYS, outs[p])
        for p in range(PROCS)
    ]
    for child in children:
        _child.expect_line(child, "ready")
    for child in children:  # all start together
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    for child in children:
        _child.expect_line(child, "done")
        _, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
    ops: list[Op] = []
    for out in outs:
        ops += json.loads(out.read_text())["log"]
    assert len(ops) == PROCS * OPS_PER_PROC

    row.injected = conflicting_pairs(ops)
    seen = check_register(row, ops)
    errors = Counter(o["error"].partition(":")[0] for o in ops if not o["ok"])
    row.notes.append(f"gets: {dict(seen)}; failed ops: {dict(errors)}")
    # Only a full DRAM tier may refuse a put (everything in it busy); nothing else may fail.
    assert set(errors) <= {"ResourceExhausted"}, errors
    assert errors["ResourceExhausted"] <= len(ops) // 20, errors
    assert seen["hits"] >= seen["misses"] // 4, f"nearly every get missed: {seen}"

    with daemon.client() as client:
        stats = client.stats()
        row.notes.append(
            f"dram evictions {stats['tiers']['dram']['evictions']}, "
            f"promotions {stats['promotions']}, demotions {stats['demotions']}"
        )
        assert stats["tiers"]["dram"]["evictions"] > 0, "the run never evicted from DRAM"
        assert stats["promotions"] > 0, "the run never promoted a block from NVMe"
        assert stats["leases"] == 0
        check_all(row, client, final_shadow(ops), must_survive=set())
        row.serving = still_serves(client)
    row.assert_ok()
