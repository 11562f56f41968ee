"""The GPU path end to end on a real daemon: an engine registers its memory and puts and
gets blocks by byte range. Run with `gpu.emulate` (a shared-memory file stands in for
GPU memory and a CPU stand-in for the streams), so everything but the CUDA calls
themselves — RPCs, validation, leases, checksums, session lifetime — is tested here;
tests/movers/test_cuda_gpu.py and scripts/gpu_check.sh cover real CUDA."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import kvtier
from tests.conftest import DaemonProcess

NS = "llama3-8b/gpu-test"
BLOCK = 64 << 10
EMULATE = {"KVTIER_GPU__EMULATE": "true"}
StartDaemon = Callable[..., DaemonProcess]


def _engine_memory(workdir: Path, blocks: int) -> tuple[Path, bytes]:
    """A file standing in for the engine's KV tensor, `blocks` blocks of random bytes."""
    data = os.urandom(blocks * BLOCK)
    path = workdir / "engine-kv.bin"
    path.write_bytes(data)
    return path, data


def _slices(first: int, count: int) -> list[tuple[int, int]]:
    return [((first + i) * BLOCK, BLOCK) for i in range(count)]


def test_an_engine_puts_and_gets_blocks_by_offset_in_its_registered_memory(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    daemon = start_daemon(env=EMULATE)
    path, data = _engine_memory(workdir, 8)
    keys = [f"b{i}".encode() for i in range(4)]
    with daemon.client() as engine:
        buffer_id = engine.register_cuda_handle(0, str(path).encode(), 0, len(data))
        assert engine.put_from_cuda(NS, keys, buffer_id, _slices(0, 4)) == [True] * 4
        # The daemon copied them out of the engine's memory: a plain get returns them.
        for i, key in enumerate(keys):
            assert engine.get(NS, key) == data[i * BLOCK : (i + 1) * BLOCK]
        # Into other places of the engine's memory (blocks 4..7), and one miss.
        wanted = [*keys[:3], b"never-stored"]
        assert engine.get_into_cuda(NS, wanted, buffer_id, _slices(4, 4)) == [
            True,
            True,
            True,
            False,
        ]
        now = path.read_bytes()
        assert now[4 * BLOCK : 7 * BLOCK] == data[: 3 * BLOCK]
        assert now[7 * BLOCK :] == data[7 * BLOCK :]  # the miss's range is untouched
        assert engine.put_from_cuda(NS, keys[:1], buffer_id, _slices(0, 1)) == [False]
        assert engine.stats()["leases"] == 0  # every lease the copies took is released


def test_bad_gpu_requests_get_clear_errors_and_store_nothing(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    daemon = start_daemon(env=EMULATE)
    path, data = _engine_memory(workdir, 2)
    with daemon.client() as engine:
        buffer_id = engine.register_cuda_handle(0, str(path).encode(), 0, len(data))
        with pytest.raises(kvtier.InvalidArgument, match="not inside the registered buffer"):
            engine.put_from_cuda(NS, [b"k"], buffer_id, [(BLOCK + 1, BLOCK)])
        with pytest.raises(kvtier.InvalidArgument, match="no buffer 99"):
            engine.put_from_cuda(NS, [b"k"], 99, [(0, BLOCK)])
        with pytest.raises(kvtier.InvalidArgument, match="serves GPU 0"):
            engine.register_cuda_handle(3, str(path).encode(), 0, len(data))
        with pytest.raises(kvtier.InvalidArgument, match="could not open the CUDA IPC handle"):
            engine.register_cuda_handle(0, b"/nonexistent/handle", 0, len(data))
        with pytest.raises(kvtier.InvalidArgument, match=r"one \(offset, size\) slice per key"):
            engine.put_from_cuda(NS, [b"a", b"b"], buffer_id, [(0, BLOCK)])
        assert engine.lookup(NS, [b"k"]).tiers == [None]
        assert engine.put_from_cuda(NS, [b"k"], buffer_id, [(0, BLOCK)]) == [True]
        with pytest.raises(kvtier.InvalidArgument, match="stored as 65536 bytes"):
            engine.get_into_cuda(NS, [b"k"], buffer_id, [(0, BLOCK // 2)])
        assert engine.get(NS, b"k") == data[:BLOCK]  # still there, unharmed


def test_a_registration_ends_with_its_session(start_daemon: StartDaemon, workdir: Path) -> None:
    daemon = start_daemon(env=EMULATE)
    path, data = _engine_memory(workdir, 1)
    with daemon.client() as engine:
        buffer_id = engine.register_cuda_handle(0, str(path).encode(), 0, len(data))
    with (
        daemon.client() as other,
        pytest.raises(kvtier.InvalidArgument, match=f"no buffer {buffer_id}"),
    ):
        other.put_from_cuda(NS, [b"k"], buffer_id, [(0, BLOCK)])


async def test_the_async_client_has_the_same_gpu_calls(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    daemon = start_daemon(env=EMULATE)
    path, data = _engine_memory(workdir, 4)
    async with kvtier.AsyncClient(daemon.target) as engine:
        buf = await engine.register_cuda_handle(0, str(path).encode(), 0, len(data))
        assert await engine.put_from_cuda(NS, [b"a", b"b"], buf, _slices(0, 2)) == [True] * 2
        assert await engine.get_into_cuda(NS, [b"b", b"z"], buf, _slices(2, 2)) == [True, False]
        assert path.read_bytes()[2 * BLOCK : 3 * BLOCK] == data[BLOCK : 2 * BLOCK]
        with pytest.raises(kvtier.InvalidArgument, match="no buffer"):
            await engine.get_into_cuda(NS, [b"a"], buf + 1, _slices(0, 1))


def test_a_daemon_without_a_gpu_says_so(start_daemon: StartDaemon, workdir: Path) -> None:
    daemon = start_daemon()
    with daemon.client() as engine, pytest.raises(kvtier.Unimplemented, match="serves no GPU"):
        engine.register_cuda_handle(0, b"handle", 0, 4096)


def test_blocks_read_through_the_gpu_path_are_kept_in_hbm_until_invalid_or_evicted(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    """HBM holds 4 blocks. The first read of a block comes from DRAM and leaves a copy in
    HBM; the second comes from HBM. An overwrite or a delete makes the copy useless, and
    reading more blocks than fit evicts copies (which ones: the policy's choice)."""
    daemon = start_daemon(env={**EMULATE, "KVTIER_GPU__HBM_CAPACITY_BYTES": str(4 * BLOCK)})
    path, data = _engine_memory(workdir, 16)
    keys = [f"h{i}".encode() for i in range(6)]
    with daemon.client() as engine:
        buf = engine.register_cuda_handle(0, str(path).encode(), 0, len(data))
        assert engine.put_from_cuda(NS, keys, buf, _slices(0, 6)) == [True] * 6
        for _ in range(2):
            assert engine.get_into_cuda(NS, keys[:4], buf, _slices(8, 4)) == [True] * 4
            assert path.read_bytes()[8 * BLOCK : 12 * BLOCK] == data[: 4 * BLOCK]
        hbm = engine.stats()["tiers"]["hbm"]
        assert (hbm["hits"], hbm["blocks"], hbm["used_bytes"]) == (4, 4, 4 * BLOCK)
        # Overwrite h0 with block 7's bytes, delete h1: their HBM copies must not serve.
        assert engine.put_from_cuda(NS, keys[:1], buf, _slices(7, 1), overwrite=True) == [True]
        assert engine.delete(NS, keys[1])
        assert engine.get_into_cuda(NS, keys[:2], buf, _slices(12, 2)) == [True, False]
        now = path.read_bytes()
        assert now[12 * BLOCK : 13 * BLOCK] == data[7 * BLOCK : 8 * BLOCK]
        assert now[13 * BLOCK : 14 * BLOCK] == data[13 * BLOCK : 14 * BLOCK]  # untouched
        # More blocks than fit: never more than capacity, and every byte still right.
        assert engine.get_into_cuda(NS, keys[2:], buf, _slices(8, 4)) == [True] * 4
        assert path.read_bytes()[8 * BLOCK : 12 * BLOCK] == data[2 * BLOCK : 6 * BLOCK]
        hbm = engine.stats()["tiers"]["hbm"]
        assert hbm["blocks"] <= 4 and hbm["used_bytes"] <= hbm["capacity_bytes"] == 4 * BLOCK
        assert hbm["evictions"] >= 1
        assert engine.stats()["leases"] == 0


def _on_a_slow_drive(
    start_daemon: StartDaemon, workdir: Path, prefix: str, delay_s: float, env: dict[str, str]
) -> tuple[DaemonProcess, Path, bytes, list[bytes]]:
    """8 blocks stored from engine memory of 16, then the daemon restarted with every
    NVMe read taking `delay_s`: the blocks are on NVMe only."""
    daemon = start_daemon(env={**EMULATE, **env})
    path, data = _engine_memory(workdir, 16)
    keys = [f"{prefix}{i}".encode() for i in range(8)]
    with daemon.client() as engine:
        buf = engine.register_cuda_handle(0, str(path).encode(), 0, len(data))
        assert engine.put_from_cuda(NS, keys, buf, _slices(0, 8)) == [True] * 8
    daemon.env = {**EMULATE, **env, "KVTIER_FAILPOINTS": f"nvme.read=delay:{delay_s}"}
    daemon.restart()
    return daemon, path, data, keys


def test_a_grouped_get_answers_each_group_once_its_own_blocks_have_arrived(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    """An engine loading layer by layer: group 0's blocks are in DRAM, group 1's on a
    drive whose reads take 1.5 s. Both groups' copies start at once; waiting for group 0
    answers as soon as its blocks are in the engine's memory, long before group 1's."""
    delay_s = 1.5
    daemon, path, data, keys = _on_a_slow_drive(start_daemon, workdir, "L", delay_s, {})
    with daemon.client() as engine:
        buf = engine.register_cuda_handle(0, str(path).encode(), 0, len(data))
        assert engine.get_into_cuda(NS, keys[:4], buf, _slices(8, 4)) == [True] * 4
        assert engine.lookup(NS, keys).tiers == ["dram"] * 4 + ["nvme"] * 4
        with path.open("r+b") as memory:  # the engine's target range, cleared
            memory.seek(8 * BLOCK)
            memory.write(bytes(8 * BLOCK))
        wanted = [*keys[:4], *keys[4:7], b"never-stored"]
        started = time.perf_counter()
        pending = engine.start_get_into_cuda(NS, wanted, buf, _slices(8, 8), [4, 4])
        assert pending.wait(0) == [True] * 4
        first_s = time.perf_counter() - started
        assert path.read_bytes()[8 * BLOCK : 12 * BLOCK] == data[: 4 * BLOCK]
        assert pending.wait(1) == [True, True, True, False]
        second_s = time.perf_counter() - started
        assert first_s < delay_s / 2 and second_s >= delay_s, (first_s, second_s)
        now = path.read_bytes()
        assert now[12 * BLOCK : 15 * BLOCK] == data[4 * BLOCK : 7 * BLOCK]
        assert now[15 * BLOCK :] == bytes(BLOCK)  # the miss's range is untouched
        with pytest.raises(kvtier.NotFound, match="waited for once"):
            pending.wait(1)
        with pytest.raises(kvtier.InvalidArgument, match="not one of the 2 groups"):
            pending.wait(2)
        with pytest.raises(kvtier.InvalidArgument, match="adding up to the 8 blocks"):
            engine.start_get_into_cuda(NS, wanted, buf, _slices(8, 8), [4, 3])
        assert engine.stats()["leases"] == 0


def test_a_get_of_blocks_on_nvme_uploads_each_run_while_the_next_is_read(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    """NVMe -> pinned -> GPU as a pipeline within one call: 8 blocks on a drive whose reads
    take 0.4 s, 2 I/O threads. The first blocks land in the engine's memory while the
    later ones are still being read (one upload after every read would land nothing
    before ~1.6 s, when the call answers)."""
    delay_s = 0.4
    daemon, path, data, keys = _on_a_slow_drive(
        start_daemon, workdir, "P", delay_s, {"KVTIER_NVME__IO_THREADS": "2"}
    )
    landed_s: list[float] = []
    done = threading.Event()

    def watch_first_block() -> None:
        with path.open("rb") as memory:
            while not done.is_set():
                memory.seek(8 * BLOCK)
                if memory.read(BLOCK) == data[:BLOCK]:
                    landed_s.append(time.perf_counter())
                    return
                time.sleep(0.005)

    with daemon.client() as engine:
        buf = engine.register_cuda_handle(0, str(path).encode(), 0, len(data))
        assert engine.lookup(NS, keys).tiers == ["nvme"] * 8
        watcher = threading.Thread(target=watch_first_block)
        started = time.perf_counter()
        watcher.start()
        try:
            assert engine.get_into_cuda(NS, keys, buf, _slices(8, 8)) == [True] * 8
            answered = time.perf_counter()
        finally:
            done.set()
            watcher.join()
        assert path.read_bytes()[8 * BLOCK :] == data[: 8 * BLOCK]
        assert landed_s, "the first block never landed"
        first_s, whole_s = landed_s[0] - started, answered - started
        assert whole_s >= 4 * delay_s and first_s < whole_s - 2 * delay_s, (first_s, whole_s)
        assert engine.stats()["leases"] == 0


async def test_the_async_client_waits_for_groups_in_any_order(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    daemon = start_daemon(env=EMULATE)
    path, data = _engine_memory(workdir, 6)
    async with kvtier.AsyncClient(daemon.target) as engine:
        buf = await engine.register_cuda_handle(0, str(path).encode(), 0, len(data))
        assert await engine.put_from_cuda(NS, [b"a", b"b", b"c"], buf, _slices(0, 3)) == [True] * 3
        pending = await engine.start_get_into_cuda(
            NS, [b"c", b"x", b"a"], buf, _slices(3, 3), [1, 2]
        )
        assert await pending.wait(1) == [False, True]
        assert await pending.wait(0) == [True]
        now = path.read_bytes()
        assert now[3 * BLOCK : 4 * BLOCK] == data[2 * BLOCK : 3 * BLOCK]
        assert now[4 * BLOCK :] == data[4 * BLOCK : 5 * BLOCK] + data[:BLOCK]


@pytest.mark.gpu
def test_a_torch_engine_tensor_round_trips_through_the_daemon_on_a_real_gpu(
    start_daemon: StartDaemon, workdir: Path
) -> None:
    """The real thing (scripts/gpu_check.sh runs it): torch's IPC handle, cupy opening it
    in the daemon, the daemon's own streams, its HBM pool on the second read."""
    import torch

    daemon = start_daemon(
        env={"KVTIER_GPU__DEVICE": "0", "KVTIER_GPU__HBM_CAPACITY_BYTES": str(8 * BLOCK)}
    )
    kv = torch.randint(0, 256, (8 * BLOCK,), dtype=torch.uint8, device="cuda")
    expected = kv.clone()
    keys = [f"g{i}".encode() for i in range(4)]
    with daemon.client() as engine:
        buf = engine.register_cuda(kv)
        assert engine.put_from_cuda(NS, keys, buf, _slices(0, 4)) == [True] * 4
        assert engine.get(NS, keys[0]) == bytes(expected[:BLOCK].cpu().numpy())
        for _ in range(2):  # from the pinned arena, then from HBM
            kv[4 * BLOCK :].zero_()
            torch.cuda.synchronize()
            assert engine.get_into_cuda(NS, keys, buf, _slices(4, 4)) == [True] * 4
            assert torch.equal(kv[4 * BLOCK :], expected[: 4 * BLOCK])
        assert engine.stats()["tiers"]["hbm"]["hits"] == 4
        kv[4 * BLOCK :].zero_()
        torch.cuda.synchronize()
        pending = engine.start_get_into_cuda(NS, keys, buf, _slices(4, 4), [2, 2])
        assert pending.wait(0) == [True] * 2
        assert torch.equal(kv[4 * BLOCK : 6 * BLOCK], expected[: 2 * BLOCK])
        assert pending.wait(1) == [True] * 2
        assert torch.equal(kv[4 * BLOCK :], expected[: 4 * BLOCK])
