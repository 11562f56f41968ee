"""CUDA movers: copies on pooled streams, bracketed by events, completed by polling.

The rules (STYLE 7), and where each is kept:

* Streams are pooled per direction (`h2d`, `d2h`, `d2d`) and used round-robin; events are
  pooled and reused only once the transfer they bracketed has been reaped.
* A transfer is a list of copies on one stream between a start and an end event. It is
  done when `end.query()` says so; nothing synchronises except an explicit `wait`.
* Order between transfers is on the device: `submit(after=...)` makes the new transfer's
  stream wait for the other's end event (`wait_event`), never a host-side sync.
* A transfer holds every buffer it touches until it is reaped (`poll`), and only then runs
  its `on_done` callbacks, which is where a caller may free or reuse a buffer: no host or
  device memory is released while a copy may still touch it (SGLang HiCache's bug class).

`StagedUpload` pipelines NVMe -> pinned staging -> GPU: the read of block i+1 (on the disk
I/O pool) overlaps the copy of block i (on a stream), and a staging buffer is read into
again only after the copy out of it has completed.

`Device` is what the movers need from CUDA. `TorchDevice` is the real one (torch imported
on construction, so `import kvtier` needs no torch); `kvtier.movers.fake.FakeDevice` runs
the same code on a CPU with streams whose progress a test controls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

logger = logging.getLogger(__name__)

Direction = Literal["h2d", "d2h", "d2d"]
DIRECTIONS: tuple[Direction, ...] = ("h2d", "d2h", "d2d")


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Stream(Protocol):
    def record(self, event: Any) -> None: ...
    def wait(self, event: Any) -> None: ...


class Device(Protocol):
    """Streams, events and asynchronous copies on one GPU (or a fake of one)."""

    def stream(self) -> Stream: ...
    def event(self) -> Event: ...
    def copy(self, dst: Any, src: Any, stream: Stream) -> None: ...


@dataclass(eq=False)
class Transfer:
    """Copies on one stream between two events; see the module for its lifetime."""

    direction: Direction
    stream: Stream
    start: Event
    end: Event
    copies: int
    keep: list[Any] = field(default_factory=list)  # buffers held until reaped
    on_done: list[Callable[[], None]] = field(default_factory=list)
    reaped: bool = False

    def done(self) -> bool:
        return self.reaped or self.end.query()


class Mover:
    """Submit transfers from one thread (the event loop); `poll` reaps finished ones."""

    def __init__(self, device: Device, streams_per_direction: int = 2) -> None:
        if streams_per_direction <= 0:
            raise ValueError("streams_per_direction must be > 0")
        self.device = device
        self._streams = {
            d: itertools.cycle([device.stream() for _ in range(streams_per_direction)])
            for d in DIRECTIONS
        }
        self._free_events: list[Event] = []
        self._in_flight: deque[Transfer] = deque()
        self.events_created = 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def _event(self) -> Event:
        if self._free_events:
            return self._free_events.pop()
        self.events_created += 1
        return self.device.event()

    def submit(
        self,
        direction: Direction,
        copies: Sequence[tuple[Any, Any]],
        after: Sequence[Transfer] = (),
        keep: Sequence[Any] = (),
        on_done: Callable[[], None] | None = None,
    ) -> Transfer:
        """Enqueue `copies` (dst, src) on a stream of `direction`, after the transfers in
        `after` (on the device), holding their buffers and `keep` until reaped."""
        stream = next(self._streams[direction])
        for earlier in after:
            if not earlier.reaped:
                stream.wait(earlier.end)
        start, end = self._event(), self._event()
        stream.record(start)
        held: list[Any] = list(keep)
        for dst, src in copies:
            self.device.copy(dst, src, stream)
            held += (dst, src)
        stream.record(end)
        transfer = Transfer(direction, stream, start, end, len(copies), held)
        if on_done is not None:
            transfer.on_done.append(on_done)
        self._in_flight.append(transfer)
        return transfer

    def poll(self) -> int:
        """Reap every finished transfer: its events go back to the pool, its buffers are
        let go, its callbacks run. Returns how many were reaped."""
        reaped = 0
        for transfer in list(self._in_flight):
            if transfer.end.query():
                self._reap(transfer)
                reaped += 1
        return reaped

    def _reap(self, transfer: Transfer) -> None:
        self._in_flight.remove(transfer)
        transfer.reaped = True
        self._free_events += (transfer.start, transfer.end)
        transfer.keep.clear()
        for callback in transfer.on_done:
            try:
                callback()
            except Exception:  # one caller's callback must not strand the others
                logger.exception("a transfer's completion callback failed")

    def wait(self, transfer: Transfer) -> None:
        """Block until `transfer` is done (the one synchronising call), then reap."""
        if not transfer.reaped:
            transfer.end.synchronize()
            self._reap(transfer)

    async def until_done(self, transfer: Transfer, poll_s: float = 50e-6) -> None:
        """Wait without blocking the event loop: poll `event.query()`, backing off."""
        delay_s = poll_s
        while not transfer.reaped:
            if transfer.end.query():
                self._reap(transfer)
                return
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 2e-3)


class StagedUpload:
    """NVMe -> pinned staging -> GPU as a pipeline over `staging` buffers (at least two).

    `read(i, buffer)` fills a staging buffer with block i (blocking: it runs on
    `run_io`, the disk I/O pool) and returns the view to copy; block i is then copied to
    `destinations[i]` on an H2D stream. A buffer is read into again only after the copy
    out of it has been reaped."""

    def __init__(
        self,
        mover: Mover,
        staging: Sequence[Any],
        run_io: Callable[..., Awaitable[Any]],
    ) -> None:
        if len(staging) < 2:
            raise ValueError("a pipeline needs at least two staging buffers")
        self.mover = mover
        self.staging = list(staging)
        self.run_io = run_io

    async def run(
        self, read: Callable[[int, Any], Any], destinations: Sequence[Any]
    ) -> list[Transfer]:
        free: deque[int] = deque(range(len(self.staging)))
        waiting: deque[Transfer] = deque()  # copies holding a staging buffer, oldest first
        transfers: list[Transfer] = []
        for i, dst in enumerate(destinations):
            while not free:
                await self.mover.until_done(waiting.popleft())
            slot = free.popleft()
            src = await self.run_io(read, i, self.staging[slot])
            transfer = self.mover.submit(
                "h2d",
                [(dst, src)],
                keep=[self.staging[slot]],
                on_done=lambda slot=slot: free.append(slot),  # type: ignore[misc]
            )
            waiting.append(transfer)
            transfers.append(transfer)
        for transfer in transfers:
            await self.mover.until_done(transfer)
        return transfers


class _TorchStream:
    def __init__(self, stream: Any) -> None:
        self.raw = stream

    def record(self, event: Any) -> None:
        event.record(self.raw)

    def wait(self, event: Any) -> None:
        self.raw.wait_event(event)


class TorchDevice:
    """A GPU through torch (streams, events, `copy_(non_blocking=True)`)."""

    def __init__(self, index: int = 0) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: the GPU tier needs one")
        self._torch: Any = torch  # untyped calls (Stream, Event) go through Any
        self.index = index
        self.device = torch.device("cuda", index)

    def stream(self) -> Stream:
        return _TorchStream(self._torch.cuda.Stream(device=self.device))

    def event(self) -> Event:
        event: Event = self._torch.cuda.Event()
        return event

    def copy(self, dst: Any, src: Any, stream: Stream) -> None:
        assert isinstance(stream, _TorchStream)
        with self._torch.cuda.stream(stream.raw):
            dst.copy_(src, non_blocking=True)
