"""Page-locking the arena: the memlock check, the parallel first touch, and the daemon's
refusal to start for a GPU it does not have (the registration itself: test_cuda_gpu.py)."""

from __future__ import annotations

import mmap
import resource
from pathlib import Path

import psutil
import pytest

from kvtier.errors import ConfigError
from kvtier.movers.pinned import check_memlock, first_touch
from kvtier.tiers.dram import DramTier
from tests.conftest import cuda_available


def test_a_memlock_limit_below_the_arena_says_what_to_set() -> None:
    with pytest.raises(ConfigError, match="LimitMEMLOCK=infinity") as err:
        check_memlock(8 << 30, (64 << 10, 64 << 10), privileged=False)
    assert "8.0 GiB" in str(err.value) and "64.0 KiB" in str(err.value)
    check_memlock(8 << 30, (resource.RLIM_INFINITY, resource.RLIM_INFINITY), privileged=False)
    check_memlock(8 << 30, (8 << 30, 8 << 30), privileged=False)
    check_memlock(8 << 30, (64 << 10, 64 << 10), privileged=True)  # CAP_IPC_LOCK lifts it


def test_first_touch_faults_every_page_in_from_several_threads() -> None:
    size = 256 << 20
    arena = DramTier(size, prefault=False)
    try:
        rss_before = psutil.Process().memory_info().rss
        seconds = first_touch(arena.address, arena.capacity_bytes, threads=4)
        grown = psutil.Process().memory_info().rss - rss_before
        assert grown >= 0.9 * size, grown  # resident now, not on the first put
        assert seconds > 0
        view = arena.view(arena.allocate(1 << 20))  # type: ignore[arg-type]
        assert not bytes(view).strip(b"\0")
        view.release()
    finally:
        arena.close()


def test_the_arena_address_is_where_its_bytes_are() -> None:
    import ctypes

    arena = DramTier(1 << 20, prefault=False)
    try:
        extent = arena.allocate(4096)
        assert extent is not None
        view = arena.view(extent)
        view[:5] = b"hello"
        assert ctypes.string_at(arena.address + extent.offset, 5) == b"hello"
        view.release()
    finally:
        arena.close()
    assert mmap.PAGESIZE  # the arena is page-aligned by construction


@pytest.mark.skipif(cuda_available(), reason="a CUDA machine would pin the arena")
def test_a_daemon_told_to_serve_a_gpu_it_does_not_have_refuses_to_start(
    start_daemon: object, workdir: Path
) -> None:
    with pytest.raises(AssertionError, match=r"gpu.device = 0: no CUDA device is visible") as err:
        start_daemon(env={"KVTIER_GPU__DEVICE": "0"})  # type: ignore[operator]
    assert "Traceback" not in str(err.value)
