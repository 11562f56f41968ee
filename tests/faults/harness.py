"""What every fault row checks: no wrong byte served, nothing lost that should survive, and
a daemon that still serves — counted per row for RELIABILITY.md.

`Shadow` is the model: for each key, the values a get may return. A cache may always
miss, so a miss is never wrong; bytes are right only if they are a value the key could
hold — the last acknowledged put, or, while a put or delete is in doubt (the daemon died
or failed mid-call), the values from before and after it.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import kvtier
from tests.conftest import block_bytes

_MISS = None


@dataclass
class Row:
    fault: str
    injected_by: str
    injected: int = 0
    gets_checked: int = 0
    wrong_bytes: int = 0
    must_survive: int = 0
    lost: int = 0
    serving: bool = False
    notes: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        return self.injected > 0 and self.wrong_bytes == 0 and self.lost == 0 and self.serving

    def assert_ok(self) -> None:
        assert self.injected > 0, f"{self.fault}: the fault was never injected"
        assert self.wrong_bytes == 0, f"{self.fault}: {self.wrong_bytes} gets served wrong bytes"
        assert self.lost == 0, f"{self.fault}: {self.lost} blocks lost that should have survived"
        assert self.serving, f"{self.fault}: the daemon stopped serving"


class Report:
    """The rows of one test session; written as JSON at its end (see conftest.py)."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def row(self, fault: str, injected_by: str) -> Row:
        row = Row(fault, injected_by)
        self.rows.append(row)
        return row

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([asdict(r) for r in self.rows], indent=2) + "\n")


class Shadow:
    """Per key, the set of byte strings a get may return (besides a miss)."""

    def __init__(self) -> None:
        self._allowed: dict[tuple[str, str], set[bytes]] = {}

    def put(self, ns: str, key: str, data: bytes, acknowledged: bool) -> None:
        allowed = self._allowed.setdefault((ns, key), set())
        if acknowledged:
            allowed.clear()
        allowed.add(data)

    def delete(self, ns: str, key: str, acknowledged: bool) -> None:
        if acknowledged:
            self._allowed.pop((ns, key), None)
        # In doubt: the old values stay allowed (and a miss always is).

    def allowed(self, ns: str, key: str) -> set[bytes]:
        return self._allowed.get((ns, key), set())

    def known(self) -> list[tuple[str, str]]:
        return list(self._allowed)

    def check(self, row: Row, ns: str, key: str, got: bytes | None) -> bool:
        """Count one get; False (and a wrong-bytes count) if `got` is not allowed."""
        row.gets_checked += 1
        if got is _MISS or got in self.allowed(ns, key):
            return True
        row.wrong_bytes += 1
        row.notes.append(f"wrong bytes for {ns}/{key}: {len(got)} bytes")
        return False


def check_all(row: Row, client: kvtier.Client, shadow: Shadow, must_survive: set[str]) -> None:
    """Get every key the shadow knows (and `must_survive`, which must hit)."""
    row.must_survive += len(must_survive)
    for ns, key in shadow.known():
        got = client.get(ns, key)
        shadow.check(row, ns, key, got)
        if got is None and key in must_survive:
            row.lost += 1
            row.notes.append(f"lost {ns}/{key}")


def still_serves(client: kvtier.Client, ns: str = "canary/ns") -> bool:
    """A put and a get of a fresh block work."""
    data = os.urandom(65536)
    key = f"canary-{data[:6].hex()}"
    try:
        client.put(ns, key, data)
        return client.get(ns, key) == data
    except kvtier.KVTierError:
        return False


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll until `predicate` holds; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def fired(log_text: str, point: str = "") -> int:
    """How many times failpoints (or one of them) fired, from the daemon's log."""
    name = re.escape(point) if point else r"\S+"
    pattern = rf"failpoint {name} fired"
    return len(re.findall(pattern, log_text))


def put_blocks(
    client: kvtier.Client,
    shadow: Shadow,
    prefix: str,
    count: int,
    size_bytes: int,
    seed: int,
    *,
    ns: str,
) -> list[str]:
    """Put `count` blocks `prefix0`.. into `ns` (each acknowledged, so each must survive);
    their names."""
    keys = []
    for i in range(count):
        key = f"{prefix}{i}"
        data = block_bytes(seed * 100_000 + i, size_bytes)
        client.put(ns, key, data, overwrite=True)
        shadow.put(ns, key, data, acknowledged=True)
        keys.append(key)
    return keys


def random_workload(
    client: kvtier.Client, shadow: Shadow, rng: random.Random, row: Row, *, ns: str, ops: int
) -> bool:
    """Random puts/overwrites/deletes of 24 w* keys in `ns`, a get checked every fifth op,
    until the daemon dies (True) or `ops` are done (False). The op that failed is recorded
    as unacknowledged: either outcome is right for it."""
    for step in range(ops):
        key = f"w{rng.randrange(24)}"
        size = rng.choice([64 << 10, 256 << 10, 700_000])
        data = block_bytes(rng.randrange(1 << 30), size)
        deleting = rng.random() < 0.25
        try:
            if deleting:
                client.delete(ns, key)
                shadow.delete(ns, key, acknowledged=True)
            else:
                client.put(ns, key, data, overwrite=True)
                shadow.put(ns, key, data, acknowledged=True)
            if step % 5 == 0:
                probe = f"w{rng.randrange(24)}"
                shadow.check(row, ns, probe, client.get(ns, probe))
        except kvtier.KVTierError:
            if deleting:
                shadow.delete(ns, key, acknowledged=False)
            else:
                shadow.put(ns, key, data, acknowledged=False)
            return True
    return False
