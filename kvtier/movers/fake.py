"""A CPU stand-in for CUDA streams and events (the `Device` of kvtier/movers/cuda.py).

Each stream is a queue of operations that runs only when the device is let make progress
(a seeded random interleaving of the streams, a few steps at each `query`), as a GPU runs
them whenever it likes after the host enqueued them. The tests use it to check the
movers' ordering and buffer lifetimes; `gpu.emulate` runs the daemon's CUDA path on it,
so the engine-facing RPCs are tested end to end on machines without a GPU.

It records what CUDA would silently get wrong: a copy whose source changed between
enqueue and execution, or that touches a buffer already released (`release`), lands in
`violations`.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class FakeEvent:
    device: FakeDevice
    recorded: int = 0  # records enqueued
    completed: int = 0  # records executed

    def query(self) -> bool:
        self.device.progress()
        return self.completed == self.recorded

    def synchronize(self) -> None:
        while self.completed < self.recorded:
            if not self.device.step():
                raise AssertionError("synchronize on an event no stream will ever record")


@dataclass(eq=False)
class FakeStream:
    device: FakeDevice
    name: str
    ops: deque[tuple[Any, ...]] = field(default_factory=deque)

    def record(self, event: FakeEvent) -> None:
        event.recorded += 1
        self.ops.append(("record", event, event.recorded))

    def wait(self, event: FakeEvent) -> None:
        self.ops.append(("wait", event, event.recorded))

    def runnable(self) -> bool:
        if not self.ops:
            return False
        op = self.ops[0]
        if op[0] != "wait":
            return True
        event: FakeEvent = op[1]
        return event.completed >= int(op[2])


class FakeDevice:
    def __init__(self, seed: int = 0, max_steps_per_query: int = 2) -> None:
        self.rng = random.Random(seed)
        self.max_steps_per_query = max_steps_per_query
        self.streams: list[FakeStream] = []
        self.log: list[tuple[str, Any]] = []  # ("copy", dst id) / ("record", event id) ...
        self.violations: list[str] = []
        self.released: set[int] = set()

    # ---- the Device protocol ---------------------------------------------------------
    def stream(self) -> FakeStream:
        stream = FakeStream(self, f"s{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        assert isinstance(stream, FakeStream), "a stream of this device"
        stream.ops.append(("copy", dst, src, bytes(src)))

    # ---- driving it ----------------------------------------------------------------------
    def release(self, buf: Any) -> None:
        """What a caller's free would be: any copy touching `buf` after this is a bug."""
        self.released.add(id(buf))

    def step(self) -> bool:
        """Run one operation of a random stream that can run; False if none can."""
        ready = [s for s in self.streams if s.runnable()]
        if not ready:
            return False
        stream = self.rng.choice(ready)
        op = stream.ops.popleft()
        if op[0] == "copy":
            _, dst, src, at_enqueue = op
            if id(src) in self.released or id(dst) in self.released:
                self.violations.append("copy touched a released buffer")
            if bytes(src) != at_enqueue:
                self.violations.append("copy source changed while the copy was in flight")
            dst[:] = src
            self.log.append(("copy", id(dst)))
        elif op[0] == "record":
            op[1].completed = max(op[1].completed, op[2])
            self.log.append(("record", id(op[1])))
        return True

    def progress(self) -> None:
        for _ in range(self.rng.randint(0, self.max_steps_per_query)):
            if not self.step():
                return

    def drain(self) -> None:
        while self.step():
            pass
