"""The event loop kept awake after a reply (kvtier/server/awake.py): while a window is
open every loop turn polls its selector instead of sleeping, other callbacks and timers
run as before, a later kick extends the window, and nothing polls with the window at 0 or
while the host is busy. The side socket kicks after each reply it sends, not after a
reply-less request."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtier._session import Op, frame
from kvtier.server import awake as awake_module
from kvtier.server.awake import LoopAwake
from tests.server.test_arena_socket import Side, attached, reply, side  # noqa: F401


@pytest.fixture(autouse=True)
def idle_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(awake_module, "host_busy", lambda: False)


class _Turns:
    """Counts the loop's selector calls that may block (timeout None or > 0)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        selector = loop._selector  # type: ignore[attr-defined]
        self.blocking = 0
        self.polls = 0
        original = selector.select

        def select(timeout: float | None = None) -> object:
            if timeout is None or timeout > 0:
                self.blocking += 1
            else:
                self.polls += 1
            return original(timeout)

        selector.select = select


async def test_the_loop_polls_instead_of_sleeping_while_the_window_is_open() -> None:
    turns = _Turns(asyncio.get_running_loop())
    awake = LoopAwake(0.05)
    awake.kick()
    fired: list[float] = []
    due_s = time.perf_counter() + 0.02
    asyncio.get_running_loop().call_later(0.02, lambda: fired.append(time.perf_counter()))
    started_s = time.perf_counter()
    await asyncio.sleep(0.03)
    polls_at_30ms = turns.polls
    assert turns.blocking == 0, "the loop slept inside the window"
    assert polls_at_30ms > 100
    assert fired and fired[0] - due_s < 0.01  # a timer inside the window ran on time
    awake.kick()  # extends the window from now: 50 ms more
    await asyncio.sleep(0.04)
    assert turns.blocking == 0 and time.perf_counter() - started_s > 0.06
    await asyncio.sleep(0.05)  # the window has closed: the loop sleeps again
    blocking = turns.blocking
    assert blocking > 0
    polls = turns.polls
    await asyncio.sleep(0.05)
    assert turns.polls - polls < 5


@pytest.mark.parametrize("busy", [False, True])
async def test_no_polling_with_the_window_at_zero_or_on_a_busy_host(
    monkeypatch: pytest.MonkeyPatch, busy: bool
) -> None:
    monkeypatch.setattr(awake_module, "host_busy", lambda: busy)
    turns = _Turns(asyncio.get_running_loop())
    awake = LoopAwake(0.0 if not busy else 0.05)
    awake.kick()
    await asyncio.sleep(0.03)
    assert turns.polls < 5 and awake.kicks == 0


async def test_the_side_socket_kicks_after_each_reply_not_after_a_reply_less_request(
    side: Side,  # noqa: F811
) -> None:
    side.arena.awake.window_s = 0.0001
    conn = await attached(side)
    for i in range(3):
        conn.sendall(frame(Op.PLAN, b"plan %d" % i))
        assert (await asyncio.to_thread(reply, conn))[0] == 0
    assert side.arena.awake.kicks == 3
    conn.sendall(frame(Op.RELEASE, b"no reply") + frame(Op.PLAN, b"last"))
    assert (await asyncio.to_thread(reply, conn))[1].startswith(b"last")
    assert side.arena.awake.kicks == 4
