"""Who made the event loop stall: a debugging attributor, off unless `KVTIER_STALL_TRACE`
names a file (one JSON line per stall is appended to it).

The stall probe (`looplag.py`) says how long the loop was kept, not by what. On a 2-vCPU
machine shared with other work three different things read the same as loop lag, and only
one is ours to fix: the loop's own code running long (a big numpy copy, a collection, a
chunk sized wrong), another of our threads holding the GIL in a Python loop (the loop
cannot run either), and the process simply not being scheduled. So for each stall this
records, besides the gap:

* the loop thread's CPU time and its time waiting on a run queue over the stall
  (`/proc/self/task/<tid>/schedstat`): CPU ≈ gap is our code on the loop; run-queue wait
  ≈ gap is the machine's;
* every other thread's CPU time over the stall (which of them ran, maybe holding the GIL);
* the loop thread's stack, sampled every `SAMPLE_EVERY_S` while the probe is late
  (`sys._current_frames()`), folded and counted. The sampler is a Python thread, so it
  too needs the GIL: a C call that holds it (a collection, a large copy) shows as a
  sampler late by as much (`sampler_late_max_ms`), and the frame seen after it;
* the garbage collections (`gc.callbacks`) that overlapped it, with generation and time.

Costs a thread waking every few ms and a small /proc read per wake-up: for diagnosis,
not production.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from kvtier.server.looplag import LoopLag

ENV_VAR = "KVTIER_STALL_TRACE"
LATE_OVER_S = 0.010  # the probe this much later than its interval: a stall being traced
SAMPLE_EVERY_S = 0.002
STACK_DEPTH = 14
_GC_KEPT = 256


@dataclass(frozen=True, slots=True)
class ThreadTimes:
    """One thread's cumulative CPU and run-queue wait (ns), from its schedstat."""

    cpu_ns: int
    wait_ns: int


def thread_times(native_id: int) -> ThreadTimes | None:
    """The schedstat of a thread of this process (None where /proc has none: not Linux,
    or the thread is gone)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", "rb") as f:
            fields = f.read().split()
    except OSError:
        return None
    return ThreadTimes(int(fields[0]), int(fields[1]))


def fold(frame: FrameType | None, depth: int = STACK_DEPTH) -> tuple[str, ...]:
    """A stack as `file:line function` strings, innermost first."""
    out: list[str] = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{_short(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return tuple(out)


def _short(filename: str) -> str:
    for marker in ("/kvtier/", "/site-packages/", "/lib/python3"):
        at = filename.rfind(marker)
        if at >= 0:
            return filename[at + 1 :]
    return filename


def classify(gap_s: float, loop_cpu_s: float, loop_wait_s: float, others_cpu_s: float) -> str:
    """What most of a stall was: `loop` (the loop thread ran), `descheduled` (it waited
    for a CPU), `other-threads` (it neither ran nor waited, and our other threads ran: the
    GIL, or the CPU they took), `blocked` (none of those: a syscall sleeping, a page
    fault on a slow disk)."""
    shares = {
        "loop": loop_cpu_s,
        "descheduled": loop_wait_s,
        "other-threads": others_cpu_s if loop_cpu_s + loop_wait_s < 0.5 * gap_s else 0.0,
    }
    kind, most = max(shares.items(), key=lambda kv: kv[1])
    return kind if most >= 0.25 * gap_s else "blocked"


class StallTracer:
    """The sampler thread and the gc hook; `stalled(start_s, end_s)` is called by the
    probe (on the loop) after each stall over the threshold."""

    def __init__(self, path: Path, lag: LoopLag, over_s: float = LATE_OVER_S) -> None:
        self.path = path
        self._lag = lag
        self._over_s = over_s
        self._loop_ident = threading.get_ident()
        self._loop_native = threading.get_native_id()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stacks: deque[tuple[float, tuple[str, ...]]] = deque(maxlen=20_000)
        self._gcs: deque[dict[str, Any]] = deque(maxlen=_GC_KEPT)
        self._gc_started: dict[int, float] = {}
        self._pending: deque[tuple[float, float]] = deque()
        # Schedstat snapshots: the loop thread's at each sampler tick while no stall is
        # on (the last one is where the next stall starts), all threads' when one begins.
        self._calm_loop: tuple[float, ThreadTimes] | None = None
        self._stall_threads: dict[int, tuple[str, ThreadTimes]] = {}
        self._sampler_late_max_s = 0.0
        self._thread = threading.Thread(target=self._run, name="kvtier-stalltrace", daemon=True)

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._lag.listener = self.stalled
        self._lag.listener_over_s = self._lag.interval_s + self._over_s
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._lag.listener = None
        self._thread.join(timeout=1.0)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now_s = time.monotonic()
        ident = threading.get_ident()
        if phase == "start":
            self._gc_started[ident] = now_s
            return
        began_s = self._gc_started.pop(ident, now_s)
        self._gcs.append(
            {
                "start_s": began_s,
                "ms": round((now_s - began_s) * 1e3, 2),
                "generation": info.get("generation"),
                "collected": info.get("collected"),
                "thread": threading.current_thread().name,
            }
        )

    def stalled(self, start_s: float, end_s: float) -> None:
        """From the probe, on the loop: a stall from `start_s` to `end_s` (monotonic)."""
        self._pending.append((start_s, end_s))

    def _snapshot_threads(self) -> dict[int, tuple[str, ThreadTimes]]:
        out: dict[int, tuple[str, ThreadTimes]] = {}
        for thread in threading.enumerate():
            native = thread.native_id
            if native is None or native == self._loop_native:
                continue
            times = thread_times(native)
            if times is not None:
                out[native] = (thread.name, times)
        return out

    def _run(self) -> None:
        in_stall = False
        last_tick_s = time.monotonic()
        while not self._stop.wait(SAMPLE_EVERY_S):
            now_s = time.monotonic()
            # How late this thread itself woke: a C call holding the GIL keeps it too.
            self._sampler_late_max_s = max(
                self._sampler_late_max_s, now_s - last_tick_s - SAMPLE_EVERY_S
            )
            last_tick_s = now_s
            # A stall the probe has reported is written first: the snapshot below would
            # otherwise move its window's start past it.
            while self._pending:
                self._write(*self._pending.popleft())
            late_s = now_s - self._lag.last_wake_s - self._lag.interval_s
            if late_s > self._over_s:
                if not in_stall:
                    in_stall = True
                    self._stall_threads = self._snapshot_threads()
                frame = sys._current_frames().get(self._loop_ident)
                with self._lock:
                    self._stacks.append((now_s, fold(frame)))
            elif late_s <= 0.0:
                # The probe is not due yet: the loop thread's times here are those at (or
                # just after) the start of any stall that follows.
                in_stall = False
                times = thread_times(self._loop_native)
                if times is not None:
                    self._calm_loop = (now_s, times)

    def _write(self, start_s: float, end_s: float) -> None:
        gap_s = end_s - start_s
        now_loop = thread_times(self._loop_native)
        calm = self._calm_loop
        loop_cpu_s = loop_wait_s = 0.0
        if now_loop is not None and calm is not None:
            loop_cpu_s = (now_loop.cpu_ns - calm[1].cpu_ns) / 1e9
            loop_wait_s = (now_loop.wait_ns - calm[1].wait_ns) / 1e9
        threads = []
        for native, (name, before) in self._stall_threads.items():
            after = thread_times(native)
            if after is None:
                continue
            cpu_ms = (after.cpu_ns - before.cpu_ns) / 1e6
            if cpu_ms >= 0.5:
                threads.append({"name": name, "cpu_ms": round(cpu_ms, 2)})
        threads.sort(key=lambda t: -float(t["cpu_ms"]))
        others_cpu_s = sum(float(t["cpu_ms"]) for t in threads) / 1e3
        with self._lock:
            seen = Counter(stack for at_s, stack in self._stacks if start_s <= at_s <= end_s)
            self._stacks.clear()
        gcs = [
            {k: v for k, v in g.items() if k != "start_s"}
            for g in list(self._gcs)
            if g["start_s"] <= end_s and g["start_s"] + g["ms"] / 1e3 >= start_s
        ]
        record = {
            "pid": os.getpid(),
            "wall_time": time.time(),
            "gap_ms": round(gap_s * 1e3, 2),
            "kind": classify(gap_s, loop_cpu_s, loop_wait_s, others_cpu_s),
            # Over the window from the last calm sampler tick to now: a little wider
            # than the stall itself.
            "loop_cpu_ms": round(loop_cpu_s * 1e3, 2),
            "loop_runqueue_wait_ms": round(loop_wait_s * 1e3, 2),
            "other_threads": threads,
            "gc": gcs,
            "sampler_late_max_ms": round(self._sampler_late_max_s * 1e3, 2),
            "stacks": [{"samples": n, "frames": list(s)} for s, n in seen.most_common(6)],
        }
        self._sampler_late_max_s = 0.0
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:
            pass  # a debugging aid never takes the daemon down


def start_from_env(lag: LoopLag) -> StallTracer | None:
    """Start the tracer on `lag`'s loop thread (the caller's) if `KVTIER_STALL_TRACE` is
    set; None otherwise."""
    where = os.environ.get(ENV_VAR)
    if not where:
        return None
    tracer = StallTracer(Path(where), lag)
    tracer.start()
    return tracer
