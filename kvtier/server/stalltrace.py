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
  (through `faulthandler`, which hands out no frame object to keep locals alive), folded
  and counted. The sampler is a Python thread, so it
  too needs the GIL: a C call that holds it (a collection, a large copy) shows as a
  sampler late by as much (`sampler_late_max_ms`), and the frame seen after it;
* the garbage collections (`gc.callbacks`) that overlapped it, with generation and time.

With `KVTIER_STALL_TRACE_CENSUS_S=N` also, every N s, the types of what the collector's
oldest generation holds (what each full collection walks again).

Costs a thread waking every few ms and a small /proc read per wake-up: for diagnosis,
not production.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import re
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

from kvtier.server.looplag import LoopLag

ENV_VAR = "KVTIER_STALL_TRACE"
# Also this often (seconds), a census of what full collections walk (`census`).
ENV_CENSUS = "KVTIER_STALL_TRACE_CENSUS_S"
_CONTAINERS = (list, dict, set, frozenset, tuple, deque)
LATE_OVER_S = 0.010  # the probe this much later than its interval: a stall being traced
SAMPLE_EVERY_S = 0.002
STACK_DEPTH = 14
THREADS_EVERY_TICKS = 4  # every thread's schedstat read at every 4th tick (~8 ms)
_GC_KEPT = 256


# One thread's cumulative (CPU ns, run-queue wait ns), from its schedstat. A plain tuple
# of ints: the collector stops tracking it, so the tracer's own rings of them add nothing
# to what a full collection walks (a dataclass each was 13 k objects in every full pass).
ThreadTimes = tuple[int, int]


def thread_times(native_id: int) -> ThreadTimes | None:
    """The schedstat of a thread of this process (None where /proc has none: not Linux,
    or the thread is gone)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", "rb") as f:
            fields = f.read().split()
    except OSError:
        return None
    return (int(fields[0]), int(fields[1]))


_THREAD_LINE = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-f]+)")
_FRAME_LINE = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


def parse_dump(text: str, depth: int = STACK_DEPTH) -> dict[int, tuple[str, ...]]:
    """faulthandler's all-threads traceback as `file:line function` strings by thread
    ident, innermost first (as it prints them)."""
    out: dict[int, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        head = _THREAD_LINE.match(line)
        if head:
            current = out.setdefault(int(head.group(1), 16), [])
            continue
        frame = _FRAME_LINE.match(line)
        if frame and current is not None and len(current) < depth:
            current.append(f"{_short(frame.group(1))}:{frame.group(2)} {frame.group(3)}")
    return {ident: tuple(stack) for ident, stack in out.items()}


def _short(filename: str) -> str:
    for marker in ("/kvtier/", "/site-packages/", "/lib/python3"):
        at = filename.rfind(marker)
        if at >= 0:
            return filename[at + 1 :]
    return filename


_WAITS = (
    " wait",
    " select",
    " poll",
    " sleep",
    " _worker",
    " get",
    " acquire",
    " _poll_wrapper",
    " accept",
    " serve_forever",
    " _run",
)


def _waiting(frame: str) -> bool:
    """A thread's innermost frame that is it waiting, not running (a rough rule: only
    for leaving the idle threads' stacks out of a record)."""
    return frame.endswith(_WAITS) and not frame.startswith("kvtier/")


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

    def __init__(
        self,
        path: Path,
        lag: LoopLag,
        over_s: float = LATE_OVER_S,
        census_every_s: float = float("inf"),
    ) -> None:
        self.path = path
        self._census_every_s = census_every_s
        self._census_until_s = 0.0  # the end of the last census (its own stall)
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
        # Schedstat snapshots: the loop thread's at each sampler tick (a stall's window
        # starts at the last one before it), all threads' when a stall is seen.
        self._loop_times: deque[tuple[float, ThreadTimes]] = deque(maxlen=4096)
        self._thread_times: deque[tuple[float, dict[int, tuple[str, ThreadTimes]]]] = deque(
            maxlen=1024
        )
        # Other threads' innermost frames seen during stalls: (time, thread name, stack).
        self._other_stacks: deque[tuple[float, str, tuple[str, ...]]] = deque(maxlen=20_000)
        self._ticks = 0
        # Where faulthandler writes the stacks: a file in memory, reused each sample.
        self._dump_fd = os.memfd_create("kvtier-stalltrace", os.MFD_CLOEXEC)
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
        if not self._thread.is_alive():
            os.close(self._dump_fd)

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

    def _dump_stacks(self) -> dict[int, tuple[str, ...]]:
        """Every thread's stack, by thread ident, innermost first: through faulthandler,
        which reads the frames in C and hands out no frame object. Holding one (as
        `sys._current_frames()` does) keeps a returned function's locals alive, and a
        memoryview among them makes the owner's `mmap.close()` or resize fail: it took a
        traced daemon down in calibration."""
        fd = self._dump_fd
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        faulthandler.dump_traceback(fd, all_threads=True)
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 1 << 20).decode(errors="replace")
        return parse_dump(text)

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

    def census(self) -> None:
        """One line naming what the collector's oldest generation holds, by type (what
        every full collection walks). Walking it holds the GIL about as long as a full
        collection does: the stall it makes is marked `census` in the next record."""
        began_s = time.monotonic()
        held = gc.get_objects(generation=2)
        kinds = Counter(type(o).__qualname__ for o in held)
        # A collection visits every item of a container: one big list or dict can cost
        # more than thousands of small objects.
        sized = [(len(o), type(o).__qualname__) for o in held if type(o) in _CONTAINERS]
        del held
        took_s = time.monotonic() - began_s
        self._census_until_s = time.monotonic()
        line = {
            "census": {k: n for k, n in kinds.most_common(25)},
            "largest": [f"{kind} of {n}" for n, kind in sorted(sized, reverse=True)[:8]],
            "objects": sum(kinds.values()),
            "frozen": gc.get_freeze_count(),
            "took_ms": round(took_s * 1e3, 2),
            "wall_time": time.time(),
        }
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            pass

    def _run(self) -> None:
        last_tick_s = time.monotonic()
        next_census_s = last_tick_s + self._census_every_s
        while not self._stop.wait(SAMPLE_EVERY_S):
            now_s = time.monotonic()
            if now_s >= next_census_s:
                self.census()
                next_census_s = time.monotonic() + self._census_every_s
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
                stacks = self._dump_stacks()
                names = {t.ident: t.name for t in threading.enumerate()}
                with self._lock:
                    self._stacks.append((now_s, stacks.get(self._loop_ident, ())))
                    for ident, stack in stacks.items():
                        if ident not in (self._loop_ident, threading.get_ident()):
                            name = names.get(ident, str(ident))
                            self._other_stacks.append((now_s, name, stack[:6]))
            times = thread_times(self._loop_native)
            if times is not None:
                self._loop_times.append((now_s, times))
            self._ticks += 1
            if self._ticks % THREADS_EVERY_TICKS == 0:
                self._thread_times.append((now_s, self._snapshot_threads()))

    def _write(self, start_s: float, end_s: float) -> None:
        gap_s = end_s - start_s
        now_s = time.monotonic()
        now_loop = thread_times(self._loop_native)
        before = None
        for at_s, times in reversed(self._loop_times):
            if at_s <= start_s:
                before = (at_s, times)
                break
        loop_cpu_s = loop_wait_s = 0.0
        window_s = gap_s
        if now_loop is not None and before is not None:
            # Scaled to the gap: the window (last tick before the stall to now) is wider.
            window_s = max(now_s - before[0], gap_s)
            scale = gap_s / window_s
            loop_cpu_s = (now_loop[0] - before[1][0]) / 1e9 * scale
            loop_wait_s = (now_loop[1] - before[1][1]) / 1e9 * scale
        with self._lock:
            seen = Counter(stack for at_s, stack in self._stacks if start_s <= at_s <= end_s)
            self._stacks.clear()
            others_seen: dict[str, Counter[tuple[str, ...]]] = {}
            for at_s, name, stack in self._other_stacks:
                if start_s <= at_s <= end_s and stack and not _waiting(stack[0]):
                    others_seen.setdefault(name, Counter())[stack] += 1
            self._other_stacks.clear()
        threads: list[dict[str, Any]] = []
        then = None
        for at_s, snapshot in reversed(self._thread_times):
            if at_s <= start_s:
                then = (at_s, snapshot)
                break
        if then is not None:
            scale = gap_s / max(now_s - then[0], gap_s)
            for native, (name, was) in then[1].items():
                after = thread_times(native)
                if after is None:
                    continue
                cpu_ms = (after[0] - was[0]) / 1e6 * scale
                if cpu_ms >= 0.5:
                    row: dict[str, Any] = {"name": name, "cpu_ms": round(cpu_ms, 2)}
                    if name in others_seen:
                        row["stack"] = list(others_seen[name].most_common(1)[0][0])
                    threads.append(row)
        threads.sort(key=lambda t: -float(t["cpu_ms"]))
        others_cpu_s = sum(float(t["cpu_ms"]) for t in threads) / 1e3
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
            # Measured from the last sampler tick before the stall to its record
            # (`window_ms`, a little wider than the stall) and scaled to the gap.
            "window_ms": round(window_s * 1e3, 2),
            "loop_cpu_ms": round(loop_cpu_s * 1e3, 2),
            "loop_runqueue_wait_ms": round(loop_wait_s * 1e3, 2),
            "other_threads": threads,
            "gc": gcs,
            "sampler_late_max_ms": round(self._sampler_late_max_s * 1e3, 2),
            "census": start_s <= self._census_until_s,
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
    census_s = os.environ.get(ENV_CENSUS)
    tracer = StallTracer(
        Path(where), lag, census_every_s=float(census_s) if census_s else float("inf")
    )
    tracer.start()
    return tracer
