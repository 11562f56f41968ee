"""benchmarks/soak.py's shadow of what each key may hold: it must tell a wrong value from
an allowed one (and say which kind of wrong), and its memory must not grow with the bytes
put (a 5-minute soak that kept every value was killed for memory on a 24 GiB machine)."""

from __future__ import annotations

import importlib.util
import random
import sys
import threading
import tracemalloc
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak_script", ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_script"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _worker(soak: ModuleType) -> Any:
    # The shadow needs no daemon: nothing here reaches one.
    return soak.Worker(0, daemon=None, tally=soak.Tally(), seed=1, stop=threading.Event())


def test_the_shadow_tells_allowed_older_zeroed_and_foreign_values_apart() -> None:
    soak = _soak()
    worker = _worker(soak)
    rng = random.Random(5)
    first, second = rng.randbytes(4096), rng.randbytes(4096)
    worker.allowed["k"] = {worker.allow("k", first)}
    fp = worker.allow("k", second)  # a put in doubt: both values may be read
    worker.check("k", first, "get")
    worker.check("k", second, "get")
    worker.check("k", None, "get")  # a miss always may
    assert worker.tally.wrong_bytes == 0
    worker.allowed["k"] = {fp}  # acknowledged: only the second now
    worker.check("k", second, "get")
    worker.check("k", first, "get")
    worker.check("k", bytes(4096), "get_into")
    worker.check("k", rng.randbytes(4096), "get_many")
    assert worker.tally.wrong_bytes == 3
    assert [e.split(": ", 1)[1] for e in worker.tally.wrong_examples] == [
        "4096 bytes, an older value (put #1 of 2)",
        "4096 bytes, all zeros",
        "4096 bytes, bytes never put under this key",
    ]


def test_the_shadow_keeps_a_fingerprint_per_value_not_the_value() -> None:
    soak = _soak()
    worker = _worker(soak)
    value = bytes(range(256)) * 4096  # 1 MiB, as the soak's largest blocks
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for i in range(200):  # 200 MiB of puts to one key
            worker.allowed["k"] = {worker.allow("k", value[:-1] + bytes([i]))}
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(worker.history["k"]) == 200
    assert after - before < 200 * 1024  # well under a KiB a put (was 1 MiB a put)
