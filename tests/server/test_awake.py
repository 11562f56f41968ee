"""The event loop kept awake after a reply (kvtier/server/awake.py): while a window is
open every loop turn polls its selector instead of sleeping, other callbacks and timers
run as before, a later kick extends the window, and nothing polls with the window at 0 or
while the host is busy. The side socket kicks after each successful reply, not after a
refusal or a reply-less request, and counts the polled seconds for its metrics."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier._session import HEADER, Op, frame
from kvtier.config import Config
from kvtier.server import awake as awake_module
from kvtier.server.arena_socket import ArenaSocket, SessionLimits
from kvtier.server.awake import LoopAwake
from tests.server.test_arena_socket import SMALL, Side, attached, reply, side  # noqa: F401


@pytest.fixture(autouse=True)
def idle_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(awake_module, "host_busy", lambda: False)


class _Turns:
    """Counts the loop's selector calls that may block (timeout None or > 0) and polls."""

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


async def wait_closed(awake: LoopAwake) -> None:
    deadline_s = time.monotonic() + 5
    while awake._ticking:
        assert time.monotonic() < deadline_s, "the window never closed"
        await asyncio.sleep(0.005)


async def test_the_loop_polls_instead_of_sleeping_while_the_window_is_open() -> None:
    turns = _Turns(asyncio.get_running_loop())
    awake = LoopAwake(0.05)
    assert awake.kick() == pytest.approx(0.05, abs=0.005)
    fired: list[float] = []
    asyncio.get_running_loop().call_later(0.02, lambda: fired.append(time.perf_counter()))
    await asyncio.sleep(0.03)
    assert turns.blocking == 0, "the loop slept inside the window"
    assert turns.polls > 10
    assert fired  # a timer inside the window ran (before the 30 ms sleep's own)
    added_s = awake.kick()  # extends the window to 50 ms from now: ~30 ms more
    assert 0.01 < added_s < 0.05
    await asyncio.sleep(0.03)
    assert turns.blocking == 0
    await wait_closed(awake)  # the window closes: the loop sleeps again
    blocking, polls = turns.blocking, turns.polls
    await asyncio.sleep(0.05)
    assert turns.blocking > blocking and turns.polls - polls < 5


@pytest.mark.parametrize("busy", [False, True])
async def test_no_polling_with_the_window_at_zero_or_on_a_busy_host(
    monkeypatch: pytest.MonkeyPatch, busy: bool
) -> None:
    monkeypatch.setattr(awake_module, "host_busy", lambda: busy)
    turns = _Turns(asyncio.get_running_loop())
    awake = LoopAwake(0.0 if not busy else 0.05)
    assert awake.kick() == 0.0
    await asyncio.sleep(0.03)
    assert turns.polls < 5


def test_a_loop_that_ended_with_a_window_open_does_not_stop_the_next_from_polling() -> None:
    awake = LoopAwake(0.5)

    async def kick_and_leave() -> None:
        awake.kick()  # the loop closes with the window open and a tick pending

    async def kick_and_count() -> int:
        turns = _Turns(asyncio.get_running_loop())
        awake.window_s = 0.02
        awake.kick()
        await asyncio.sleep(0.01)
        return turns.polls

    asyncio.run(kick_and_leave())
    assert asyncio.run(kick_and_count()) > 10


async def test_the_side_socket_kicks_after_each_successful_reply_only(
    side: Side,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    awake = side.arena.awake
    awake.window_s = 0.0001
    kicks: list[float] = []
    kick = awake.kick

    def counted() -> float:
        kicks.append(kick())
        return kicks[-1]

    monkeypatch.setattr(awake, "kick", counted)
    conn = await attached(side)
    for i in range(3):
        conn.sendall(frame(Op.PLAN, b"plan %d" % i))
        assert (await asyncio.to_thread(reply, conn))[0] == 0
    assert len(kicks) == 3
    conn.sendall(frame(Op.RELEASE, b"no reply") + frame(Op.PLAN, b"last"))
    assert (await asyncio.to_thread(reply, conn))[1].startswith(b"last")
    assert len(kicks) == 4
    # A refusal (a request over its op's cap) is answered without a window.
    over = SessionLimits.of(SMALL).caps[Op.PLAN] + 1
    conn.sendall(HEADER.pack(over, Op.PLAN) + b"x" * over)
    assert (await asyncio.to_thread(reply, conn))[0] != 0
    assert len(kicks) == 4
    assert side.arena.counters.poll_s == pytest.approx(sum(kicks)) and sum(kicks) > 0


def test_a_reload_sets_the_window_and_a_window_over_1_ms_is_refused() -> None:
    arena = ArenaSocket(Path("/nonexistent.sock"), lambda t: (0, 0), lambda s: None)
    for window_s in (0.0, 0.0005):
        arena.reconfigure(Config.model_validate({"server": {"poll_after_reply_s": window_s}}))
        assert arena.awake.window_s == window_s
    for wrong in (-1e-6, 0.002):
        with pytest.raises(ValidationError, match="poll_after_reply_s"):
            Config.model_validate({"server": {"poll_after_reply_s": wrong}})
