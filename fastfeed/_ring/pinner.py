"""Registering ring segments with CUDA off the loop's thread, under the target device.

cudaHostRegister takes milliseconds per 10 MB, and the first epoch, ring growth and slot
replacement all bring new segments: registered where they arrive, each would be paid inside
``next()``. A ``Pinner`` registers them in a thread of the main process instead (never in a
worker, where it would make a CUDA context), and unregisters the segments the ring retires.
Its thread sets the target device once, for itself, so that a rank targeting ``cuda:3`` never
makes a context on GPU 0 (about 0.5 GB there; pytorch#21081 is torch's guard against the same).

A segment is usable before it is registered: until then its batches are not pinned, and
``pin_memory=True`` copies them into pinned memory, as torch does with every batch. A failed
registration leaves that segment unpinned; the failure is kept for the ring to report once.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from typing import Callable

_pinners: dict[int, Pinner] = {}
_lock = threading.Lock()  # for_device() may be called from several loaders' threads at once


class Pinner:
    """One thread that runs registration work for one CUDA device, in order.

    Args:
        device: the CUDA device index to register under (-1: the thread's default, device 0).
    """

    def __init__(self, device: int):
        self.device = device
        self.failures: collections.deque[str] = collections.deque()  # CUDA's messages, oldest first
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name=f"fastfeed-pin-cuda:{device}", daemon=True)
        self._thread.start()

    def pin(self, segment) -> None:
        """Register ``segment`` soon; its ``pinned`` turns true once done (or a failure is kept)."""
        self._put(lambda: segment.pin(self.device))

    def unpin(self, segment) -> None:
        """Unregister ``segment`` (after any registration of it still queued) and let it go here."""
        self._put(segment.unpin)

    def probe(self, segment) -> str:
        """Register and unregister ``segment`` now, on this thread's device; "" or CUDA's reason it failed."""
        outcome: list[str] = []
        done = threading.Event()

        def job():
            try:
                segment.pin(self.device)
                segment.unpin()
                outcome.append("")
            except RuntimeError as e:
                outcome.append(str(e))
            finally:
                done.set()

        self._put(job, keep_failure=False)
        done.wait()
        return outcome[0]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _put(self, job: Callable[[], object], keep_failure: bool = True) -> None:
        with self._idle:
            self._pending += 1
        self._jobs.put((job, keep_failure))

    def _run(self) -> None:
        while True:
            job, keep_failure = self._jobs.get()
            try:
                job()
            except RuntimeError as e:
                if keep_failure:
                    self.failures.append(str(e))
            # The job holds the last reference to a retired segment: it is unmapped here, off the loop's thread.
            del job
            with self._idle:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.notify_all()


def for_device(device: int) -> Pinner:
    """This process's pinner for ``device`` (made on first use)."""
    with _lock:
        pinner = _pinners.get(device)
        if pinner is None:
            pinner = _pinners[device] = Pinner(device)
        return pinner


def flush(timeout: float | None = None) -> bool:
    """Wait for every pinner's queued work (tests, benchmarks); False if ``timeout`` passed first."""
    with _lock:
        pinners = list(_pinners.values())
    return all(p.flush(timeout) for p in pinners)


# A forked child has none of the parent's threads: it must not find their pinners.
os.register_at_fork(after_in_child=_pinners.clear)
