"""The daemon's malloc set-up (kvtier/_malloc.py, server/daemon.py tune_malloc): its threads
share two glibc arenas, so what a burst of thread work frees (the NVMe recovery's) goes
back to a heap that is trimmed, not into an arena a thread keeps for itself."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_info")

# Starts 8 threads, each of which mallocs while the others hold theirs (so each meets
# contention and glibc would give it an arena of its own), then counts the arenas in
# malloc_info's report.
CHILD = textwrap.dedent(
    """
    import ctypes, ctypes.util, os, sys, tempfile, threading
    from kvtier.server.daemon import tune_malloc
    if sys.argv[1] == "tuned":
        tune_malloc()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.fopen.restype = ctypes.c_void_p
    barrier = threading.Barrier(8)

    def work():
        held = [libc.malloc(200_000) for _ in range(4)]
        barrier.wait()
        for p in held:
            libc.free(p)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path = tempfile.mktemp()
    fp = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    report = open(path).read()
    os.unlink(path)
    print(report.count("<heap nr="))
    """
)


def arenas(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


def test_the_daemons_threads_share_two_arenas() -> None:
    untuned = arenas("default")
    if untuned <= 2:
        pytest.skip(f"this libc made {untuned} arenas for 8 threads without a limit")
    assert arenas("tuned") <= 2


def test_an_operators_malloc_arena_max_wins() -> None:
    from kvtier._malloc import limit_arenas

    saved = os.environ.get("MALLOC_ARENA_MAX")
    os.environ["MALLOC_ARENA_MAX"] = "4"
    try:
        assert limit_arenas(2) is False
    finally:
        if saved is None:
            del os.environ["MALLOC_ARENA_MAX"]
        else:
            os.environ["MALLOC_ARENA_MAX"] = saved
