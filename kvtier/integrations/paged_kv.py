"""Moving an engine's paged KV blocks between its KV tensors and kvtier: one interface
(`PagedKV`), two transports, and the choice between them follows the tensors' device.

* CPU KV, `ArenaKV`: the client copies between the daemon's shared arena and the tensors
  (`get_many` / `put_many`); one record per engine block, every layer's page of it back
  to back. A load is complete when `start_load` returns.
* GPU KV, `CudaIpcKV`: the allocations holding the tensors are registered with the daemon
  once per session (CUDA IPC) and the daemon's own streams copy. A load is one grouped get
  per registered allocation, one group per layer, all started at once (`start_load`) and
  waited for layer by layer (`wait_layer`, just before the layer's attention reads its
  KV), so layer 0 computes while later layers arrive; a save is the daemon's D2H into its
  pinned arena, on a thread of the caller's, so the step does not wait for it. One record
  per (engine block, layer), under `layer_key`: a layer's page of a block is one
  contiguous range of its allocation. `emulated`: CPU tensors take this path against a
  daemon running `gpu.emulate` (tests, demos): their storage is moved into shared memory,
  in place, and the daemon maps it, so the bytes really move between the engine's tensors
  and the daemon.

Lifecycle, per engine step: `start_load(client, loads)` before the forward pass; then
`wait_layer(i)` before layer i reads its KV (each layer at most once, any subset); then
`end_load()` once the forward pass is done, before the step ends: it waits for whatever
was not waited for (until then the daemon may still write into the engine's memory) and
says how many leading blocks arrived whole. Saves: `save_fence()` on the engine's thread
after the forward pass (what a save must wait for: the kernels that wrote those blocks),
then `save(client, blocks, fence)` on another thread, with a client of its own. The
blocks a load or save names must stay allocated to their request until it has ended.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import kvtier
from kvtier.client import CudaGetGroups
from kvtier.client.cuda import cuda_ipc_handle, shared_memory_handle
from kvtier.errors import AlreadyExists, KVTierError
from kvtier.integrations.prefix import layer_key

Blocks = list[tuple[bytes, int]]  # (chained key, engine block id)
Fence = Callable[[], None]
# One allocation's share of a load or save: its index, its layers, and their records'
# keys and (offset, size) ranges, layer after layer (a group per layer).
_Request = tuple[int, list[int], list[bytes], list[tuple[int, int]]]


@dataclass(frozen=True, slots=True)
class Loaded:
    """A step's load: its first `blocks` arrived whole (every layer's page of them);
    `error` the client's failure, when the daemon is why the rest did not."""

    blocks: int
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class Pages:
    """Where one layer's page of each engine block lies in the storage holding the layer."""

    offset_bytes: int  # block 0's page, from the storage's start
    stride_bytes: int  # from one block's page to the next one's
    size_bytes: int
    kernel_blocks: int  # the tensor's blocks per engine block (an attention kernel's own)

    def of(self, block_id: int) -> tuple[int, int]:
        """(offset, size) in bytes of the block's page."""
        return self.offset_bytes + block_id * self.stride_bytes, self.size_bytes


def pages_of(name: str, kv: torch.Tensor, num_blocks: int) -> Pages:
    """The pages of one layer's KV tensor, block-major ([blocks, ...], as vLLM views every
    layout): each block's page must be one contiguous range."""
    if num_blocks <= 0 or kv.dim() < 2 or kv.shape[0] % num_blocks:
        raise ValueError(
            f"layer {name}: a KV tensor of shape {tuple(kv.shape)} does not hold "
            f"{num_blocks} blocks along its first dimension"
        )
    per_block = kv.shape[0] // num_blocks
    if not kv[:per_block].is_contiguous():
        raise ValueError(f"layer {name}: a KV block is not one contiguous range of its tensor")
    size = kv.element_size()
    return Pages(
        int(kv.storage_offset()) * size,
        int(kv.stride(0)) * per_block * size,
        int(kv[:per_block].numel()) * size,
        int(per_block),
    )


class PagedKV(ABC):
    """See the module for the lifecycle. `layers` in the engine's order (layer i is what
    `wait_layer(i)` names), `num_blocks` the engine's blocks in each."""

    def __init__(
        self, namespace: str, names: Sequence[str], layers: Sequence[torch.Tensor], num_blocks: int
    ) -> None:
        if len(names) != len(layers) or not layers:
            raise ValueError("name each KV tensor, one per layer, at least one")
        self.namespace = namespace
        self.layers = list(layers)
        self.pages = [pages_of(n, kv, num_blocks) for n, kv in zip(names, layers, strict=True)]
        self.block_bytes = sum(p.size_bytes for p in self.pages)
        self.wait_s = 0.0  # the engine's time blocked on this step's load (not compute)

    @abstractmethod
    def start_load(self, client: kvtier.Client | None, loads: Blocks) -> None:
        """Start copying `loads` into the engine's blocks (client None: the daemon is down,
        nothing is loaded). Never raises the client's errors: `end_load` reports them."""

    def wait_layer(self, layer: int) -> None:
        """Block until layer `layer`'s pages of the load are in (or known missing)."""
        return

    @abstractmethod
    def end_load(self) -> Loaded:
        """Wait for the rest of the step's load; how many leading blocks arrived whole."""

    def save_fence(self) -> Fence | None:
        """On the engine's thread after the forward pass: what a save of blocks this step
        wrote must wait for before the daemon reads them (None: nothing)."""
        return None

    @abstractmethod
    def save(self, client: kvtier.Client, blocks: Blocks, fence: Fence | None) -> None:
        """Store the blocks (on the caller's thread, after `fence`). A block already stored
        with other bytes stays as it is: recomputed KV may differ from it in its last bits
        (another split of the prompt), and either is right. Raises the client's errors."""


def whole_prefix(arrived: Iterable[bool]) -> int:
    """How many leading blocks arrived (a chain is loaded as a prefix: after the first
    block that did not, none count)."""
    count = 0
    for ok in arrived:
        if not ok:
            break
        count += 1
    return count


class ArenaKV(PagedKV):
    """CPU KV through the shared arena: the client copies each block's layer pages."""

    def __init__(
        self, namespace: str, names: Sequence[str], layers: Sequence[torch.Tensor], num_blocks: int
    ) -> None:
        for name, kv in zip(names, layers, strict=True):
            if kv.device.type != "cpu":
                raise ValueError(
                    f"layer {name}: KV on {kv.device}: the shared arena moves CPU KV; GPU KV "
                    "moves through CUDA IPC (CudaIpcKV)"
                )
        super().__init__(namespace, names, layers, num_blocks)
        self._loaded = Loaded(0)

    def parts(self, block_id: int) -> list[torch.Tensor]:
        """The block's page in every layer, in order: one record's bytes."""
        return [
            kv[block_id * p.kernel_blocks : (block_id + 1) * p.kernel_blocks]
            for kv, p in zip(self.layers, self.pages, strict=True)
        ]

    def start_load(self, client: kvtier.Client | None, loads: Blocks) -> None:
        self._loaded, self.wait_s = Loaded(0), 0.0
        if client is None or not loads:
            return
        started_s = time.perf_counter()
        try:
            keys = [k for k, _ in loads]
            got = client.get_many(
                self.namespace, keys, [self.parts(b) for _, b in loads], verify=True
            )
        except (KVTierError, OSError) as err:
            self._loaded = Loaded(0, err)
            return
        finally:
            self.wait_s = time.perf_counter() - started_s
        self._loaded = Loaded(whole_prefix(size == self.block_bytes for size in got))

    def end_load(self) -> Loaded:
        loaded, self._loaded = self._loaded, Loaded(0)
        return loaded

    def save(self, client: kvtier.Client, blocks: Blocks, fence: Fence | None) -> None:
        with contextlib.suppress(AlreadyExists):
            client.put_many(self.namespace, [(k, self.parts(b)) for k, b in blocks])


class CudaIpcKV(PagedKV):
    """GPU KV through CUDA IPC (or, `emulated`, CPU KV through the daemon's stand-in)."""

    def __init__(
        self,
        namespace: str,
        names: Sequence[str],
        layers: Sequence[torch.Tensor],
        num_blocks: int,
        emulated: bool = False,
    ) -> None:
        self.emulated = emulated
        want = "cpu" if emulated else "cuda"
        self.device = layers[0].device if layers else torch.device(want)
        for name, kv in zip(names, layers, strict=True):
            if kv.device != self.device or kv.device.type != want:
                raise ValueError(
                    f"layer {name}: KV on {kv.device}; CUDA IPC moves the KV of one GPU"
                    + (" (emulated: CPU KV)" if emulated else "")
                )
        super().__init__(namespace, names, layers, num_blocks)
        # The allocations (storages) holding the layers: each registered once per session.
        storages: list[torch.UntypedStorage] = []
        index_of: dict[int, int] = {}  # data_ptr -> index in storages
        self.layer_storage: list[int] = []
        for kv in layers:
            storage = kv.untyped_storage()
            index = index_of.setdefault(storage.data_ptr(), len(storages))
            if index == len(storages):
                storages.append(storage)
            self.layer_storage.append(index)
        if emulated:
            # Now, not at the first registration: moving a storage copies it, and the
            # engine's views follow it only if nothing computes into them meanwhile.
            for storage in storages:
                storage.share_memory_()
        self._memory = [
            torch.empty(0, dtype=torch.uint8, device=self.device).set_(s) for s in storages
        ]
        self._layers_of: dict[int, list[int]] = {}
        for layer, index in enumerate(self.layer_storage):
            self._layers_of.setdefault(index, []).append(layer)
        self._registered: weakref.WeakKeyDictionary[kvtier.Client, list[int]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()  # the loader's and the saver's clients register apart
        self._loads: Blocks = []
        self._pending: dict[int, tuple[CudaGetGroups[list[bool]], int]] = {}
        self._found: dict[int, list[bool]] = {}
        self._error: Exception | None = None

    @property
    def registrations(self) -> int:
        """Allocations registered per session (one when vLLM holds every layer in one)."""
        return len(self._memory)

    def _buffers(self, client: kvtier.Client) -> list[int]:
        """The client's buffer ids of the allocations, registered on its first use (a new
        client, after the daemon was down, registers anew: registrations end with their
        session)."""
        with self._lock:
            ids = self._registered.get(client)
        if ids is None:
            handle = shared_memory_handle if self.emulated else cuda_ipc_handle
            ids = [client.register_cuda_handle(*handle(memory)) for memory in self._memory]
            with self._lock:
                self._registered[client] = ids
        return ids

    def _requests(self, blocks: Blocks) -> Iterable[_Request]:
        for index, layers in self._layers_of.items():
            keys = [layer_key(k, layer) for layer in layers for k, _ in blocks]
            ranges = [self.pages[layer].of(b) for layer in layers for _, b in blocks]
            yield index, layers, keys, ranges

    def start_load(self, client: kvtier.Client | None, loads: Blocks) -> None:
        self._loads, self._pending, self._found = list(loads), {}, {}
        self._error, self.wait_s = None, 0.0
        if client is None or not loads:
            return
        if not self.emulated:
            # The engine's queued work on these blocks (vLLM zeroes blocks it hands out)
            # must land before the daemon's copies, which its stream does not order.
            torch.cuda.current_stream(self.device).synchronize()
        try:
            buffers = self._buffers(client)
            for index, layers, keys, ranges in self._requests(self._loads):
                groups = client.start_get_into_cuda(
                    self.namespace, keys, buffers[index], ranges, [len(loads)] * len(layers)
                )
                for group, layer in enumerate(layers):
                    self._pending[layer] = (groups, group)
        except (KVTierError, OSError) as err:
            self._error = err  # the groups started before it are still waited for

    def wait_layer(self, layer: int) -> None:
        pending = self._pending.pop(layer, None)
        if pending is None:
            return
        started_s = time.perf_counter()
        try:
            self._found[layer] = pending[0].wait(pending[1])
        except (KVTierError, OSError) as err:
            self._error = self._error or err
        finally:
            self.wait_s += time.perf_counter() - started_s

    def end_load(self) -> Loaded:
        for layer in list(self._pending):
            self.wait_layer(layer)
        count = len(self._loads)
        found = [self._found.get(layer, [False] * count) for layer in range(len(self.layers))]
        loaded = Loaded(whole_prefix(all(f[j] for f in found) for j in range(count)), self._error)
        self._loads, self._found, self._error = [], {}, None
        return loaded

    def save_fence(self) -> Fence | None:
        if self.emulated:
            return None  # CPU kernels are done when the forward pass returns
        cuda: Any = torch.cuda  # Event is untyped
        event = cuda.Event()
        event.record(cuda.current_stream(self.device))
        fence: Fence = event.synchronize
        return fence

    def save(self, client: kvtier.Client, blocks: Blocks, fence: Fence | None) -> None:
        if fence is not None:
            fence()
        buffers = self._buffers(client)
        for index, _, keys, ranges in self._requests(blocks):
            with contextlib.suppress(AlreadyExists):
                client.put_from_cuda(self.namespace, keys, buffers[index], ranges)


def paged_kv(
    namespace: str,
    names: Sequence[str],
    layers: Sequence[torch.Tensor],
    num_blocks: int,
    emulate_ipc: bool = False,
) -> PagedKV:
    """The transport the tensors' device calls for: CUDA IPC for GPU KV, the shared arena
    for CPU KV (`emulate_ipc`: CUDA IPC on the daemon's CPU stand-in instead)."""
    device = layers[0].device.type if layers else "cpu"
    if device == "cuda":
        return CudaIpcKV(namespace, names, layers, num_blocks)
    if emulate_ipc:
        return CudaIpcKV(namespace, names, layers, num_blocks, emulated=True)
    return ArenaKV(namespace, names, layers, num_blocks)


def describe(kv: PagedKV) -> str:
    """One line saying how the blocks move (for the engine's log)."""
    if not isinstance(kv, CudaIpcKV):
        return "KV on the CPU moves through the shared arena"
    emulated = " (emulated: shared memory, for a daemon with gpu.emulate)" if kv.emulated else ""
    return (
        f"KV on {kv.device} moves through CUDA IPC{emulated}: {len(kv.layers)} layers in "
        f"{kv.registrations} registered allocation(s), loaded layer by layer"
    )
