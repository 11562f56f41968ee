"""The client's side of the GPU path (kvtier/engine/cuda_path.py): a CUDA tensor's IPC
handle, and the messages naming blocks by byte range in a registered buffer. torch is
imported by the caller's tensor, never here."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvtier._proto import kvtier_pb2 as pb
from kvtier.client._common import as_key
from kvtier.errors import InvalidArgument


def cuda_ipc_handle(tensor: Any) -> tuple[int, bytes, int, int]:
    """(device, IPC handle of the allocation, the tensor's byte offset in it, its bytes)
    of a contiguous CUDA tensor (torch's own sharing call, as torch.multiprocessing uses)."""
    if not getattr(tensor, "is_cuda", False):
        raise InvalidArgument("register_cuda takes a CUDA tensor (the engine's KV cache)")
    if not tensor.is_contiguous():
        raise InvalidArgument("register_cuda takes a contiguous tensor: blocks are byte ranges")
    shared = tensor.untyped_storage()._share_cuda_()
    device, handle, storage_offset = int(shared[0]), bytes(shared[1]), int(shared[3])
    offset = storage_offset + tensor.storage_offset() * tensor.element_size()
    return device, handle, offset, tensor.numel() * tensor.element_size()


def shared_memory_handle(tensor: Any) -> tuple[int, bytes, int, int]:
    """`cuda_ipc_handle`'s stand-in for a daemon running `gpu.emulate`: (device 0, the path
    of the shared-memory file holding a contiguous CPU tensor, the tensor's byte offset in
    it, its bytes). The tensor's storage is moved into shared memory first, in place
    (torch's own sharing call, as torch.multiprocessing uses): every view of it follows,
    so an engine's KV tensors can be handed over after they were allocated. The path is
    this process's descriptor of the file: valid while the storage lives."""
    if getattr(tensor, "device", None) is None or tensor.device.type != "cpu":
        raise InvalidArgument("an emulated CUDA IPC handle is for a CPU tensor")
    if not tensor.is_contiguous():
        raise InvalidArgument("register_cuda takes a contiguous tensor: blocks are byte ranges")
    storage = tensor.untyped_storage()
    storage.share_memory_()
    fd = int(storage._share_fd_cpu_()[0])
    offset = tensor.storage_offset() * tensor.element_size()
    path = f"/proc/{os.getpid()}/fd/{fd}"
    return 0, path.encode(), offset, tensor.numel() * tensor.element_size()


NO_SESSION = (
    "CUDA IPC needs the daemon's UNIX socket (a same-node session): connect with unix:///path"
)


def register_request(
    device: int, ipc_handle: bytes, offset_bytes: int, size_bytes: int
) -> pb.RegisterCudaRequest:
    return pb.RegisterCudaRequest(
        device=device, ipc_handle=ipc_handle, offset_bytes=offset_bytes, size_bytes=size_bytes
    )


def put_request(
    namespace: str,
    keys: Sequence[bytes | str],
    buffer_id: int,
    block_slices: Sequence[tuple[int, int]],
    overwrite: bool,
) -> pb.CudaPutRequest:
    return pb.CudaPutRequest(
        namespace=namespace,
        buffer_id=buffer_id,
        blocks=cuda_blocks(keys, block_slices),
        overwrite=overwrite,
    )


def get_request(
    namespace: str,
    keys: Sequence[bytes | str],
    buffer_id: int,
    block_slices: Sequence[tuple[int, int]],
    group_sizes: Sequence[int] = (),
) -> pb.CudaGetRequest:
    return pb.CudaGetRequest(
        namespace=namespace,
        buffer_id=buffer_id,
        blocks=cuda_blocks(keys, block_slices),
        group_sizes=group_sizes,
    )


def wait_request(request_id: int, group: int) -> pb.CudaWaitRequest:
    return pb.CudaWaitRequest(request_id=request_id, group=group)


R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class CudaGetGroups(Generic[R]):
    """A grouped get_into_cuda in flight (`start_get_into_cuda`): every group's copies
    have started; `wait(g)` answers once group g's blocks are in GPU memory, per block
    whether it was found. Each group is waited for once, in any order; an engine loading
    layer by layer waits for layer i just before it runs it."""

    request_id: int
    group_sizes: tuple[int, ...]
    _wait: Callable[[int, int], R]

    def wait(self, group: int) -> R:
        if not 0 <= group < len(self.group_sizes):
            raise InvalidArgument(
                f"group {group} is not one of the {len(self.group_sizes)} groups started"
            )
        return self._wait(self.request_id, group)


def found(resp: pb.CudaGetResponse) -> list[bool]:
    return [b.found for b in resp.blocks]


def cuda_blocks(
    keys: Sequence[bytes | str], block_slices: Sequence[tuple[int, int]]
) -> list[pb.CudaBlock]:
    """Blocks by (offset, size) in the registered buffer, one per key."""
    if len(keys) != len(block_slices):
        raise InvalidArgument("name one (offset, size) slice per key")
    return [
        pb.CudaBlock(key=as_key(k), offset_bytes=offset, size_bytes=size)
        for k, (offset, size) in zip(keys, block_slices, strict=True)
    ]
