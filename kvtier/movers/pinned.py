"""Page-locking the DRAM arena for the GPU: one registration of the whole mapping.

`cudaHostAlloc` of a large pinned buffer faults and locks every page on one thread inside
the driver (Dynamo users measured 2.7 s for 8 GiB). The arena is instead mapped, its pages
faulted in by several threads at once (`first_touch`: a memset per chunk, which releases
the GIL), and then registered with one `cudaHostRegister` (`register`), which only has to
lock pages that already exist. Both times are measured and logged by the caller.

Locking pages counts against RLIMIT_MEMLOCK for an unprivileged process; `check_memlock`
says what to set when the limit is too low, before anything is locked.
"""

from __future__ import annotations

import ctypes
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sizes import human_size

_CUDA_HOST_REGISTER_PORTABLE = 1  # usable from every CUDA context, not only the current


@dataclass(frozen=True, slots=True)
class PinReport:
    touch_s: float
    register_s: float
    size_bytes: int


_CAP_IPC_LOCK = 14  # lifts RLIMIT_MEMLOCK


def has_ipc_lock() -> bool:
    """Whether this process may lock memory beyond RLIMIT_MEMLOCK (CAP_IPC_LOCK)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def check_memlock(
    size_bytes: int, limits: tuple[int, int] | None = None, privileged: bool | None = None
) -> None:
    """Refuse, with the setting to change, when RLIMIT_MEMLOCK is below the arena (and
    the process has no CAP_IPC_LOCK to lift it)."""
    soft, _hard = limits or resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= size_bytes:
        return
    if has_ipc_lock() if privileged is None else privileged:
        return
    raise ConfigError(
        f"the DRAM arena ({human_size(size_bytes)}) cannot be page-locked for the GPU: "
        f"RLIMIT_MEMLOCK is {human_size(soft)}. Set LimitMEMLOCK=infinity in the "
        "service's unit (systemd/kvtier.service has it) or `ulimit -l unlimited` in the "
        "shell, or turn gpu.pin_arena off (copies to the GPU then go through a bounce "
        "buffer, at about half the bandwidth)"
    )


def first_touch(address: int, size_bytes: int, threads: int, chunk_bytes: int = 64 << 20) -> float:
    """Fault in every page of [address, address + size) from `threads` threads (zeros
    written; the arena is fresh); seconds taken."""
    started_s = time.perf_counter()
    chunks = [
        (address + offset, min(chunk_bytes, size_bytes - offset))
        for offset in range(0, size_bytes, chunk_bytes)
    ]
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="kvtier-touch") as pool:
        list(pool.map(lambda c: ctypes.memset(c[0], 0, c[1]), chunks))
    return time.perf_counter() - started_s


def register(address: int, size_bytes: int) -> float:
    """`cudaHostRegister` the mapping (torch's binding, else cupy's); seconds taken.
    RuntimeError when CUDA refuses (the error says why)."""
    started_s = time.perf_counter()
    try:
        import torch

        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(address, size_bytes, _CUDA_HOST_REGISTER_PORTABLE)
        code = int(getattr(err, "value", err))
        if code != 0:
            raise RuntimeError(f"cudaHostRegister failed with CUDA error {code}")
    except ImportError:
        import cupy  # the gpu extra has one of the two

        cupy.cuda.runtime.hostRegister(address, size_bytes, _CUDA_HOST_REGISTER_PORTABLE)
    return time.perf_counter() - started_s


def require_cuda() -> None:
    """RuntimeError unless torch (or cupy) sees a CUDA device."""
    try:
        import torch
    except ImportError:
        try:
            import cupy
        except ImportError:
            raise RuntimeError(
                "neither torch nor cupy is installed: pip install 'kvtier[gpu]'"
            ) from None
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no CUDA device is visible to cupy") from None
        return
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible (torch.cuda.is_available() is False)")


def unregister(address: int) -> None:
    try:
        import torch

        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        cudart.cudaHostUnregister(address)
    except ImportError:
        import cupy

        cupy.cuda.runtime.hostUnregister(address)


def pin(address: int, size_bytes: int, threads: int) -> PinReport:
    """Check for a GPU and the limit, fault the pages in in parallel, register them: the
    arena is then pinned host memory the GPU copies to and from at full bandwidth."""
    require_cuda()
    check_memlock(size_bytes)
    touch_s = first_touch(address, size_bytes, threads)
    return PinReport(touch_s, register(address, size_bytes), size_bytes)
