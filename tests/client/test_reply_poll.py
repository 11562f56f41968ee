"""The sync client's poll for a session reply before it sleeps (zerocopy.SPIN_S): it
returns a reply that is there, gives up after `spin_s`, pauses after replies keep coming
late, and a client's `spin_s` reaches its session."""

from __future__ import annotations

import mmap
import socket
import time

import pytest

from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import HEADER, Op
from kvtier.client import zerocopy
from kvtier.client.zerocopy import SPIN_MISSES, SPIN_PAUSE_CALLS, SharedArena


@pytest.fixture
def pair() -> tuple[SharedArena, socket.socket]:
    mine, daemon = socket.socketpair()
    arena = SharedArena(7, mmap.mmap(-1, 4096), mine)
    yield arena, daemon
    arena.close()
    daemon.close()


def _reply(daemon: socket.socket, message: pb.StatsResponse) -> None:
    payload = message.SerializeToString()
    daemon.sendall(HEADER.pack(len(payload), 0) + payload)


def test_a_reply_already_there_is_read_without_sleeping(
    pair: tuple[SharedArena, socket.socket],
) -> None:
    arena, daemon = pair
    _reply(daemon, pb.StatsResponse(puts=3))
    got = arena._poll_reply()
    assert got > 0 and arena._late == 0
    length, code = HEADER.unpack_from(arena._inbox)
    assert code == 0 and pb.StatsResponse.FromString(
        bytes(arena._inbox[HEADER.size : HEADER.size + length])
    ) == pb.StatsResponse(puts=3)


def test_the_poll_gives_up_after_spin_s_and_pauses_after_late_replies(
    pair: tuple[SharedArena, socket.socket],
) -> None:
    arena, _ = pair
    arena.spin_s = 0.002
    for late in range(1, SPIN_MISSES):
        began = time.perf_counter()
        assert arena._poll_reply() == 0
        assert time.perf_counter() - began >= 0.002
        assert arena._late == late
    assert arena._poll_reply() == 0  # the last late reply in a row: polling pauses
    assert arena._asleep == SPIN_PAUSE_CALLS and arena._late == 0
    began = time.perf_counter()
    for _ in range(SPIN_PAUSE_CALLS):
        assert arena._poll_reply() == 0
    assert time.perf_counter() - began < 0.002 * SPIN_PAUSE_CALLS / 4  # no polling
    assert arena._asleep == 0


def test_no_polling_with_spin_s_zero(pair: tuple[SharedArena, socket.socket]) -> None:
    arena, daemon = pair
    arena.spin_s = 0
    _reply(daemon, pb.StatsResponse(puts=1))
    assert arena._poll_reply() == 0  # the reply is left for the sleeping read


def test_a_call_reads_its_reply_whether_it_polled_or_slept(
    pair: tuple[SharedArena, socket.socket],
) -> None:
    """A reply that comes within the poll and one that comes after it: both read whole."""
    import threading

    arena, daemon = pair
    arena.spin_s = 0.05
    for delay_s in (0.0, 0.2):

        def answer(delay_s: float = delay_s) -> None:
            daemon.recv(1 << 16)
            time.sleep(delay_s)
            _reply(daemon, pb.StatsResponse(puts=int(delay_s * 10) + 1))

        thread = threading.Thread(target=answer)
        thread.start()
        got = arena.call(Op.HITS, pb.HitsRequest(), pb.StatsResponse)
        thread.join()
        assert got == pb.StatsResponse(puts=int(delay_s * 10) + 1)


def test_the_default_poll_is_the_modules() -> None:
    import kvtier

    for spin_s, want in ((None, zerocopy.SPIN_S), (0, 0.0), (-1, 0.0), (0.001, 0.001)):
        client = kvtier.Client("unix:///nonexistent.sock", spin_s=spin_s)
        assert client.spin_s == want
        client.close()
