"""The segment tier's questions to the catalog (kvtier/engine/nvme.py's bridge, issue 22):
asked from the reclaimer's thread, answered on the event loop where the catalog lives, and
given up (OSError) when the tier closes instead of waiting on a loop that is stopping."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from kvtier.engine.nvme import _LoopOwner
from kvtier.tiers.record import RecordHeader

H = RecordHeader("t|m", b"k", 1, 10, 0, 4096)


class Owner:
    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def live(self, headers: Sequence[RecordHeader], locations: Sequence[int]) -> list[bool]:
        self.threads.append(threading.current_thread())
        return [loc % 2 == 1 for loc in locations]

    def moved(
        self, headers: Sequence[RecordHeader], old: Sequence[int], new: Sequence[int]
    ) -> list[bool]:
        self.threads.append(threading.current_thread())
        return [o != n for o, n in zip(old, new, strict=True)]


async def test_questions_from_a_thread_are_answered_on_the_loop() -> None:
    owner = Owner()
    bridge = _LoopOwner(asyncio.get_running_loop(), owner, lambda: False)
    live = await asyncio.to_thread(bridge.live, [H, H, H], [1, 2, 3])
    moved = await asyncio.to_thread(bridge.moved, [H, H], [1, 2], [1, 5])
    assert live == [True, False, True] and moved == [False, True]
    assert owner.threads == [threading.main_thread()] * 2  # the loop's thread, not the asker's
    # Asked on the loop's own thread (a test calling reclaim there): answered at once.
    assert bridge.live([H], [7]) == [True]


async def test_a_closing_tier_stops_waiting_for_a_stuck_loop() -> None:
    closing = threading.Event()
    bridge = _LoopOwner(asyncio.get_running_loop(), Owner(), closing.is_set)
    out: list[BaseException] = []

    def ask() -> None:
        try:
            bridge.live([H], [1])
        except OSError as err:
            out.append(err)

    asker = threading.Thread(target=ask)
    asker.start()
    closing.set()
    started_s = time.monotonic()
    asker.join(5)  # the loop is blocked here: the answer can never come
    assert not asker.is_alive() and time.monotonic() - started_s < 2
    assert len(out) == 1 and isinstance(out[0], OSError)
    await asyncio.sleep(0.05)  # the cancelled question, run now, answers nobody


def test_a_loop_run_by_another_thread_answers_too() -> None:
    loop = asyncio.new_event_loop()
    try:
        bridge = _LoopOwner(loop, Owner(), lambda: False)
        runner = threading.Thread(target=loop.run_forever)
        runner.start()
        try:
            assert bridge.live([H], [3]) == [True]  # from this (non-loop) thread
        finally:
            loop.call_soon_threadsafe(loop.stop)
            runner.join(5)
    finally:
        loop.close()


@pytest.mark.parametrize("n", [0, 1, 2048])
async def test_chunks_of_any_size_round_trip(n: int) -> None:
    bridge = _LoopOwner(asyncio.get_running_loop(), Owner(), lambda: False)
    got = await asyncio.to_thread(bridge.live, [H] * n, list(range(n)))
    assert got == [i % 2 == 1 for i in range(n)]
