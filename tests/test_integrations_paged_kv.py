"""The engine connectors' transports (kvtier.integrations.paged_kv) against a real daemon:
CPU KV through the shared arena, and the GPU path (CUDA IPC) on the daemon's CPU
stand-in (`gpu.emulate`), with KV tensors laid out as vLLM lays them out (every layer a
block-major view of one backing allocation)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kvtier
from kvtier.integrations.paged_kv import (
    ArenaKV,
    CudaIpcKV,
    Loaded,
    describe,
    paged_kv,
    pages_of,
)
from kvtier.integrations.prefix import layer_key
from tests.conftest import DaemonProcess

NS = "tiny-llama/bf16-b16-l3-test"
EMULATE = {"KVTIER_GPU__EMULATE": "true"}
LAYERS, BLOCKS, HEADS, TOKENS, WIDTH = 3, 8, 2, 16, 32  # [blocks, kv heads, tokens, 2 * head]
StartDaemon = Callable[..., DaemonProcess]


def engine_kv(seed: int) -> tuple[list[str], list[torch.Tensor]]:
    """One int8 allocation viewed as a bf16 [blocks, heads, tokens, width] tensor per layer
    (layer-compact, as vLLM's allocate_kv_cache does), filled with random values."""
    page = HEADS * TOKENS * WIDTH
    raw = torch.zeros(LAYERS * BLOCKS * page * 2, dtype=torch.int8)
    views = [
        raw[layer * BLOCKS * page * 2 : (layer + 1) * BLOCKS * page * 2]
        .view(torch.bfloat16)
        .view(BLOCKS, HEADS, TOKENS, WIDTH)
        for layer in range(LAYERS)
    ]
    gen = torch.Generator().manual_seed(seed)
    for view in views:
        view.copy_(torch.randn(view.shape, generator=gen).to(torch.bfloat16))
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)], views


def keys(count: int, tag: str = "b") -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(32, b".") for i in range(count)]


def same_block(a: list[torch.Tensor], a_block: int, b: list[torch.Tensor], b_block: int) -> bool:
    return all(torch.equal(x[a_block], y[b_block]) for x, y in zip(a, b, strict=True))


def test_gpu_kv_through_emulated_cuda_ipc_is_loaded_layer_by_layer_bit_exact(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon(env=EMULATE)
    names, source = engine_kv(seed=1)
    sender = CudaIpcKV(NS, names, source, BLOCKS, emulated=True)
    assert sender.registrations == 1  # every layer lives in one allocation: one register
    # Written after the storage moved into shared memory: the engine's views followed it.
    source[2][3].fill_(1.5)
    stored = keys(3)
    with daemon.client() as engine, daemon.client() as saver:
        sender.save(saver, list(zip(stored, [1, 3, 0], strict=True)), sender.save_fence())
        assert saver.stats()["tiers"]["dram"]["blocks"] == 3 * LAYERS  # one per block, layer
        assert saver.get(NS, layer_key(stored[1], 2)) == bytes(
            source[2][3].view(torch.uint8).flatten().numpy()
        )
        names, target = engine_kv(seed=2)
        receiver = CudaIpcKV(NS, names, target, BLOCKS, emulated=True)
        receiver.start_load(engine, list(zip(stored, [5, 6, 7], strict=True)))
        receiver.wait_layer(0)
        assert all(torch.equal(source[0][s], target[0][d]) for s, d in ((1, 5), (3, 6), (0, 7)))
        assert receiver.end_load() == Loaded(3)
        for s, d in ((1, 5), (3, 6), (0, 7)):
            assert same_block(source, s, target, d)
        assert engine.stats()["leases"] == 0


def test_a_block_missing_one_layer_ends_the_loaded_prefix(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(env=EMULATE)
    names, source = engine_kv(seed=3)
    stored = keys(3)
    _, target = engine_kv(seed=4)
    untouched = target[2][4].clone()
    with daemon.client() as client:
        CudaIpcKV(NS, names, source, BLOCKS, emulated=True).save(
            client, list(zip(stored, [0, 1, 2], strict=True)), None
        )
        assert client.delete(NS, layer_key(stored[1], 2))
        receiver = CudaIpcKV(NS, names, target, BLOCKS, emulated=True)
        receiver.start_load(client, list(zip(stored, [3, 4, 5], strict=True)))
        for layer in reversed(range(LAYERS)):  # any order
            receiver.wait_layer(layer)
        assert receiver.end_load() == Loaded(1)
    assert same_block(source, 0, target, 3)
    assert torch.equal(target[2][4], untouched)  # the missing record's range: left as it was


def test_cuda_ipc_against_a_daemon_without_a_gpu_loads_nothing_and_says_why(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon()
    names, layers = engine_kv(seed=5)
    kv = CudaIpcKV(NS, names, layers, BLOCKS, emulated=True)
    with daemon.client() as client:
        kv.start_load(client, [(keys(1)[0], 0)])
        loaded = kv.end_load()
        with pytest.raises(kvtier.Unimplemented, match="serves no GPU"):
            kv.save(client, [(keys(1)[0], 0)], None)
    assert loaded.blocks == 0 and isinstance(loaded.error, kvtier.Unimplemented)
    kv.start_load(None, [(keys(1)[0], 0)])  # the daemon down: nothing, and no error
    assert kv.end_load() == Loaded(0)


def test_cpu_kv_goes_through_the_shared_arena_one_record_per_block(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon()
    names, source = engine_kv(seed=6)
    kv = paged_kv(NS, names, source, BLOCKS)
    assert isinstance(kv, ArenaKV)
    stored = keys(2, "a")
    _, target = engine_kv(seed=7)
    with daemon.client() as client:
        kv.save(client, list(zip(stored, [2, 4], strict=True)), kv.save_fence())
        assert client.stats()["tiers"]["dram"]["blocks"] == 2
        receiver = paged_kv(NS, names, target, BLOCKS)
        receiver.start_load(client, [(stored[0], 0), (b"never-stored", 1), (stored[1], 2)])
        assert receiver.end_load() == Loaded(1)
    assert same_block(source, 2, target, 0)
    assert describe(kv) == "KV on the CPU moves through the shared arena"
    emulated = paged_kv(NS, names, source, BLOCKS, emulate_ipc=True)
    assert isinstance(emulated, CudaIpcKV)
    assert describe(emulated).startswith("KV on cpu moves through CUDA IPC (emulated")


def test_pages_are_found_in_any_block_major_layout_and_refused_when_split() -> None:
    names, layers = engine_kv(seed=8)
    pages = pages_of(names[1], layers[1], BLOCKS)
    element = layers[1].element_size()
    assert pages.of(3) == (
        (layers[1].storage_offset() + 3 * layers[1].stride(0)) * element,
        HEADS * TOKENS * WIDTH * element,
    )
    # Kernel blocks of half an engine block (vLLM splits blocks for some attention kernels).
    halves = layers[1].view(2 * BLOCKS, HEADS, TOKENS // 2, WIDTH)
    assert pages_of(names[1], halves, BLOCKS).of(3) == pages.of(3)
    # Heads outermost: a block's page is no longer one range.
    with pytest.raises(ValueError, match="not one contiguous range"):
        pages_of(names[1], layers[1].transpose(0, 1).contiguous().transpose(0, 1), BLOCKS)
    with pytest.raises(ValueError, match="does not hold 3 blocks"):
        pages_of(names[1], layers[1], 3)
