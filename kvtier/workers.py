"""Worker threads run below the event loop's priority.

On two vCPUs the daemon's loop shares the GIL with its I/O threads, the restart's segment
loaders and recovery thread, and the reclaimer. When the loop asks for the GIL back, the
holder drops it within the switch interval, but whichever waiting thread the kernel runs
first takes it: with eight loaders and the recovery thread runnable at once, the loop
could wait several intervals, the restart's longest stalls. A worker thread a few nice
levels down loses those races to the loop (the kernel's scheduler weighs nice 10 about a
ninth of nice 0), and still runs whenever the loop does not want a CPU: it only waits
when the two compete.

Linux keeps a nice value per thread (setpriority(2), NOTES), so this lowers the calling
thread's alone; raising one's own nice value needs no privilege, and systemd's
`@system-service` syscall filter allows it."""

from __future__ import annotations

import os
import threading

WORKER_NICE_STEP = 10  # nice levels below the thread that starts the worker
_NICEST = 19


def lower_priority() -> None:
    """Make the calling thread WORKER_NICE_STEP levels nicer than it is (as a
    ThreadPoolExecutor initializer, or first thing in a thread's target). Where the OS
    refuses (a sandbox without setpriority), the thread runs as it was."""
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(now + WORKER_NICE_STEP, _NICEST))
    except OSError:
        pass
