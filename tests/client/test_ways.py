"""Two ways chosen by what each took (kvtier/client/ways.py): how the sync client waits
for a session reply (each op the way that measured faster, polling only when clearly so,
the other still sampled; the poll returns a reply that is there and gives up after
`spin_s`), and whether a large put streams."""

from __future__ import annotations

import mmap
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier
from kvtier._proto import kvtier_pb2 as pb
from kvtier._session import HEADER, Op
from kvtier.client.ways import _CLIP, _WEIGHT, EXPLORE_EVERY, MARGIN, SPIN_S, ReplyWait, TwoWays
from kvtier.client.zerocopy import SharedArena


@pytest.fixture(autouse=True)
def idle_host(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The choices as on a host with CPUs to spare, whatever the machine running the
    tests is doing (one test sets the load itself)."""
    from kvtier.client import ways as ways_module

    if "host_is_busy" not in request.node.name:
        monkeypatch.setattr(ways_module, "host_busy", lambda: False)


def _ways(wait: ReplyWait, op: int, calls: int, poll_s: float, sleep_s: float) -> list[bool]:
    """`calls` waits where polling takes `poll_s` and sleeping `sleep_s`: how each went."""
    ways = []
    for _ in range(calls):
        polls = wait.polls(op)
        wait.took(op, polls, poll_s if polls else sleep_s)
        ways.append(polls)
    return ways


def test_each_way_is_measured_first_then_the_faster_is_used_and_the_other_sampled() -> None:
    wait = ReplyWait()
    ways = _ways(wait, Op.PLAN, 2 + 10 * EXPLORE_EVERY, poll_s=150e-6, sleep_s=250e-6)
    assert ways[:2] == [True, False]
    assert ways[2:].count(False) == 10  # one in EXPLORE_EVERY
    ways = _ways(wait, Op.STAGE, 2 + 10 * EXPLORE_EVERY, poll_s=300e-6, sleep_s=200e-6)
    assert ways[2:].count(True) == 10


def test_a_tie_sleeps() -> None:
    wait = ReplyWait()
    ways = _ways(wait, Op.PLAN, 200, poll_s=200e-6, sleep_s=200e-6 * (MARGIN + 0.02))
    assert ways[2:].count(True) <= 200 // EXPLORE_EVERY + 1


def test_the_way_follows_when_the_host_changes() -> None:
    """Polling wins on an idle host; once load makes it slower, the sampled sleeps show
    it and the client turns to sleeping (and back)."""
    wait = ReplyWait()
    _ways(wait, Op.PUT_STAGED, 300, poll_s=150e-6, sleep_s=250e-6)
    assert wait.polls(Op.PUT_STAGED) or wait.polls(Op.PUT_STAGED)
    loaded = _ways(wait, Op.PUT_STAGED, 60 * EXPLORE_EVERY, poll_s=400e-6, sleep_s=230e-6)
    assert loaded[-4 * EXPLORE_EVERY :].count(True) <= 4  # only the samples poll now
    quiet = _ways(wait, Op.PUT_STAGED, 60 * EXPLORE_EVERY, poll_s=150e-6, sleep_s=250e-6)
    assert quiet[-4 * EXPLORE_EVERY :].count(False) <= 4
    polled, slept = wait.mean_s(Op.PUT_STAGED)
    assert polled < slept


def test_ops_are_measured_apart() -> None:
    wait = ReplyWait()
    _ways(wait, Op.PLAN, 100, poll_s=100e-6, sleep_s=200e-6)
    _ways(wait, Op.ACQUIRE, 100, poll_s=400e-6, sleep_s=200e-6)
    assert wait.mean_s(Op.PLAN)[0] < wait.mean_s(Op.PLAN)[1]
    assert wait.mean_s(Op.ACQUIRE)[0] > wait.mean_s(Op.ACQUIRE)[1]


def test_no_polling_with_spin_s_zero() -> None:
    assert not any(_ways(ReplyWait(spin_s=0), Op.PLAN, 50, poll_s=1e-6, sleep_s=1.0))


def test_a_stall_counts_as_at_most_a_few_dozen_averages() -> None:
    """A wait that stalled (a preemption, a pause of the collector) moves its way's figure
    by at most _CLIP averages' worth: it cannot turn the choice for long."""
    wait = ReplyWait()
    _ways(wait, Op.PLAN, 50, poll_s=100e-6, sleep_s=200e-6)
    wait.took(Op.PLAN, True, 10.0)
    polled = wait.mean_s(Op.PLAN)[0]
    assert polled <= 100e-6 * (1 + _WEIGHT * (_CLIP - 1)) * 1.01
    _ways(wait, Op.PLAN, 200, poll_s=100e-6, sleep_s=200e-6)  # it comes back
    assert wait.mean_s(Op.PLAN)[0] < 200e-6


@pytest.fixture
def pair() -> Iterator[tuple[SharedArena, socket.socket]]:
    mine, daemon = socket.socketpair()
    arena = SharedArena(7, mmap.mmap(-1, 4096), mine)
    yield arena, daemon
    arena.close()
    daemon.close()


def _reply(daemon: socket.socket, message: pb.StatsResponse) -> None:
    payload = message.SerializeToString()
    daemon.sendall(HEADER.pack(len(payload), 0) + payload)


def test_the_poll_reads_a_reply_that_is_there_and_gives_up_after_spin_s(
    pair: tuple[SharedArena, socket.socket],
) -> None:
    arena, daemon = pair
    arena.reply_wait.spin_s = 0.002
    began = time.perf_counter()
    assert arena._poll_reply() == 0
    assert time.perf_counter() - began >= 0.002
    _reply(daemon, pb.StatsResponse(puts=3))
    got = arena._poll_reply()
    length, code = HEADER.unpack_from(arena._inbox)
    assert got == HEADER.size + length and code == 0
    assert pb.StatsResponse.FromString(bytes(arena._inbox[HEADER.size : got])).puts == 3


def test_a_call_reads_its_reply_whether_it_polled_or_slept(
    pair: tuple[SharedArena, socket.socket],
) -> None:
    """Replies that come within the poll and after it, both ways: each read whole, and
    each way's time measured."""
    arena, daemon = pair
    arena.reply_wait.spin_s = 0.05
    for n, delay_s in enumerate([0.0, 0.0, 0.1, 0.0, 0.1, 0.0]):

        def answer(delay_s: float = delay_s, n: int = n) -> None:
            daemon.recv(1 << 16)
            time.sleep(delay_s)
            _reply(daemon, pb.StatsResponse(puts=n))

        thread = threading.Thread(target=answer)
        thread.start()
        got = arena.call(Op.HITS, pb.HitsRequest(), pb.StatsResponse)
        thread.join()
        assert got == pb.StatsResponse(puts=n)
    polled, slept = arena.reply_wait.mean_s((Op.HITS, 0))
    assert polled > 0 and slept > 0


def test_a_clients_spin_s() -> None:
    for spin_s, want in ((None, SPIN_S), (0, 0.0), (-1, 0.0), (0.001, 0.001)):
        client = kvtier.Client("unix:///nonexistent.sock", spin_s=spin_s)
        assert client.spin_s == want
        client.close()


def test_the_cheap_way_is_taken_at_a_tie_and_keys_are_apart() -> None:
    ways = TwoWays()
    for _ in range(200):
        for key, dear_s, cheap_s in ((21, 1.0, 1.0), (23, 0.5, 1.0)):
            dear = ways.dear(key)
            ways.took(key, dear, dear_s if dear else cheap_s)
    assert sum(ways.dear(21) for _ in range(64)) == 64 // EXPLORE_EVERY
    assert sum(ways.dear(23) for _ in range(64)) == 64 - 64 // EXPLORE_EVERY


def test_no_dear_way_while_the_host_is_busy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With no CPU to spare (CPU pressure over the gate's), neither polling nor streaming
    is taken, whatever the figures say; once the pressure falls, they are again."""
    from kvtier import hostload

    psi = tmp_path / "pressure" / "cpu"
    psi.parent.mkdir()

    def pressure(pct: float) -> None:
        psi.write_text(f"some avg10={pct:.2f} avg60=0.00 avg300=0.00 total=0\n")

    pressure(hostload.PRESSURE_BUSY_PCT + 30)
    host = hostload.HostLoad(cgroup=hostload.Cgroup(), proc=tmp_path)
    host.check_s = 0.0  # every call looks
    monkeypatch.setattr(hostload, "_host", host)  # restored after the test
    wait = ReplyWait()
    assert not any(_ways(wait, Op.PLAN, 40, poll_s=50e-6, sleep_s=500e-6))
    pressure(1.0)
    assert _ways(wait, Op.PLAN, 40, poll_s=50e-6, sleep_s=500e-6).count(True) >= 36
    pressure(hostload.PRESSURE_BUSY_PCT)  # at the gate: busy
    assert not TwoWays().dear("streamed")


def test_each_key_samples_the_other_way_even_when_calls_cycle_through_keys() -> None:
    """Calls alternating between two kinds (a put, a get) sample the other way for each:
    a count shared by all keys landed every sample on one of them."""
    ways = TwoWays()
    samples = {1: 0, 2: 0}
    for _ in range(40 * EXPLORE_EVERY):
        for key in (1, 2):
            dear = ways.dear(key)
            ways.took(key, dear, 1.0 if dear else 2.0)  # the dear way is faster: mostly it
            samples[key] += not dear
    assert all(n >= 39 for n in samples.values()), samples
