"""How long a thread has slept: wall time it spent neither running on a CPU nor waiting in a run queue for one.

A rank whose step waits for the other ranks sleeps inside the collective: on a CPU backend (gloo) the calling
thread blocks on the collective's completion, wherever the call is made (DDP's all-reduce inside
``backward()``, FSDP's gathers, a barrier, a collective called from Python). Read at each batch's return,
differences between readings tell how much of a step was spent so, without hooking any of those calls.

The kernel keeps, per thread, the nanoseconds it ran and the nanoseconds it waited in a run queue
(``/proc/thread-self/schedstat``, CONFIG_SCHED_INFO): what is left of the wall time was sleep. Where that file
is missing, the thread's CPU time alone is used, and time spent runnable but without a core counts as sleep.
"""

from __future__ import annotations

import os
import threading
import time


class Clock:
    """``read()``: seconds the calling thread has slept, on a base of its own (only differences mean anything).

    Each thread that reads gets its own schedstat file, opened at its first read and kept open until ``close()``;
    after it, reads fall back on the thread's CPU time and open nothing.
    """

    def __init__(self) -> None:
        self._fds: dict[int, int] | None = {}

    def read(self) -> float:
        tid = threading.get_native_id()
        fds = self._fds
        fd = -1 if fds is None else fds.get(tid)
        if fd is None:
            fd = fds[tid] = _open(tid)
        now = time.perf_counter()
        if fd >= 0:
            try:
                ran, queued = os.pread(fd, 128, 0).split()[:2]
                return now - (int(ran) + int(queued)) / 1e9
            except (OSError, ValueError):
                pass
        return now - time.thread_time()

    def close(self) -> None:
        """Close every thread's file."""
        fds, self._fds = self._fds or {}, None
        for fd in fds.values():
            if fd >= 0:
                os.close(fd)


def _open(tid: int) -> int:
    """Thread ``tid``'s schedstat file, or -1 where the kernel keeps none."""
    try:
        return os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
