"""Worker threads: the same loop, ring, ordering and errors as worker processes.

For datasets whose work releases the GIL (image decoders, native readers) and
for free-threaded Python, threads save the processes' start-up, memory and
pickling. Batches still go through ring slots, so everything downstream (leases,
pinning, the device stage) is the same.

What differs, by nature:
- The global RNGs (``random``, ``torch``, ``numpy``) are the process's, shared
  with the training loop, so threads do not reseed them, and random draws made
  from them in ``__getitem__`` interleave between threads. ``get_worker_info().seed``
  is still ``base_seed + id``: seed a generator of your own from it.
- All threads share the one dataset object, as ``num_workers=0`` does.
- A thread stuck in user code cannot be killed: stopping abandons it (a daemon
  thread) and it exits when that call returns.
"""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
import traceback
from typing import NamedTuple

from torch.utils.data._utils import worker as torch_worker

from .._ring import segments
from . import messages as m
from . import readahead
from .. import affinity
from .loop import SlotWriter, WorkerSpec, node_of, serve, yield_to_main
from .pool import STATUS_CHECK_S, Clock, WorkerDied

STOP_WAIT_S = 1.0  # the longest stop() waits for a busy thread
_local = threading.local()


def _worker_info_here():
    return getattr(_local, "info", None) or torch_worker._worker_info


def _per_thread_worker_info():
    return _fastfeed_worker_info_here()  # noqa: F821 (a global of torch's worker module, set below)


_patched = False


def _patch_get_worker_info() -> None:
    """Make ``torch.utils.data.get_worker_info()`` answer per thread.

    torch's function returns a process-wide global, and user code holds
    references to the function itself (``from torch.utils.data import
    get_worker_info``), so only replacing its code in place reaches every
    caller. Threads that are not workers get exactly what they got before.
    """
    global _patched
    if not _patched:
        _patched = True
        torch_worker._fastfeed_worker_info_here = _worker_info_here
        torch_worker.get_worker_info.__code__ = _per_thread_worker_info.__code__


def thread_worker_main(worker_id: int, spec: WorkerSpec, control, attach, get, put) -> None:
    """Entry point of one worker thread: ``control`` is the ring's, ``attach`` its mapping of a claimed slot."""
    affinity.apply(spec.placement)  # CPU affinity and memory policy are per thread, too
    yield_to_main()  # SCHED_BATCH applies to this thread only
    _local.info = torch_worker.WorkerInfo(
        id=worker_id, num_workers=spec.num_workers, seed=spec.base_seed + worker_id, dataset=spec.dataset
    )
    serve(worker_id, spec, spec.dataset, SlotWriter(control, attach, node_of(spec)), get, put, thread=True)


class _Died(NamedTuple):
    """A worker thread ended by an exception that escaped the loop (SystemExit, say)."""

    error: BaseException


class ThreadPool:
    """Start ``num_workers`` threads running ``target(*args_for(worker_id), get, put)``.

    The same face as ``Pool``: ``send``, ``recv``, ``recv_any``, ``retire``, ``stop``.
    """

    def __init__(self, num_workers: int, target, args_for, hang_dump_s: float = 0):
        _patch_get_worker_info()
        self.hang_dump_s = hang_dump_s
        self.blocked = 0  # receives that found no answer waiting, and waited
        self._stopped = False
        self.all_gone = False  # after stop(): no thread is left behind, busy in user code
        self._tasks = [queue.SimpleQueue() for _ in range(num_workers)]
        self._replies: queue.SimpleQueue = queue.SimpleQueue()  # (worker_id, message) from all
        # Replies taken off the queue, per worker, in arrival order.
        self._held = [collections.deque() for _ in range(num_workers)]
        self.threads: list[threading.Thread] = []
        try:
            for wid in range(num_workers):
                t = threading.Thread(
                    target=self._run, args=(wid, target, args_for(wid)), name=f"ff_data_worker_{wid}", daemon=True
                )
                t.start()
                self.threads.append(t)
        except BaseException:
            self.stop()
            raise

    def _run(self, wid: int, target, args) -> None:
        def put(msg, wid=wid, replies=self._replies):
            if self._stopped and type(msg) is m.Done and msg.made:
                # Made after the pool stopped, perhaps after the ring's last sweep:
                # nobody will read this message, so its segment goes now.
                segments.unlink(msg.made)
            replies.put((wid, msg))

        tasks = self._tasks[wid]

        def get(block: bool = True):
            try:
                return tasks.get(block)
            except queue.Empty:  # only when not blocking
                return readahead.NOTHING

        try:
            target(*args, get, put)
        except BaseException as e:  # noqa: BLE001 (reported to the main thread, which raises)
            put(_Died(e))

    def send(self, wid: int, message) -> None:
        self._tasks[wid].put(message)

    def recv(self, wid: int, timeout: float | None):
        """The next message from worker ``wid``; raises on its death or on timeout."""
        return self._wait(wid, timeout)

    def ready(self, wid: int) -> bool:
        """Whether worker ``wid`` has a reply waiting: recv would not wait."""
        while not self._held[wid] and self._pull(0):
            pass
        return bool(self._held[wid])

    def recv_any(self, timeout: float | None):
        """The next message from whichever worker answers first."""
        return self._wait(None, timeout)

    def _held_reply(self, want):
        for wid in range(len(self._held)) if want is None else (want,):
            if self._held[wid]:
                return wid, self._held[wid].popleft()
        return None

    def _pull(self, timeout: float) -> bool:
        """Move the next reply (waiting up to ``timeout`` seconds) to its worker's held replies."""
        try:
            wid, msg = self._replies.get(timeout=timeout) if timeout > 0 else self._replies.get_nowait()
        except queue.Empty:
            return False
        self._held[wid].append(msg)
        return True

    def _wait(self, want, timeout):
        clock = Clock(timeout, self.hang_dump_s, self.dump_stacks)
        first = True
        while True:
            got = self._held_reply(want)
            if got is None and first:
                first = False
                if self._pull(0):
                    continue
                self.blocked += 1  # the answer is not here yet: the consumer waits (fastfeed.stats' ``ready``)
            if got is None:
                if not self._pull(clock.next_wait()):
                    clock.check()
                continue
            wid, msg = got
            if type(msg) is _Died:
                raise WorkerDied(
                    f"DataLoader worker {wid} (thread) stopped: {type(msg.error).__name__}: {msg.error}"
                ) from msg.error
            return msg

    def dump_stacks(self, waited: float) -> None:
        """Print every thread's Python stack to stderr (a hung loader, diagnosed)."""
        frames = sys._current_frames()
        lines = [f"fastfeed: no batch for {waited:.0f} s; the stacks of the DataLoader worker threads follow."]
        for t in self.threads:
            frame = frames.get(t.ident)
            if frame is not None:
                lines.append(f"{t.name} (most recent call last):\n" + "".join(traceback.format_stack(frame)))
        print("\n".join(lines), file=sys.stderr, flush=True)

    def retire(self, wid: int) -> None:
        """Stop a worker that has nothing more to do (its IterableDataset ended)."""
        self._tasks[wid].put(m.Stop())

    def on_own_thread(self) -> bool:
        """Whether the caller is one of the worker threads (``stop`` from there does not wait for itself)."""
        return threading.current_thread() in self.threads

    def stop(self, grace: float = STATUS_CHECK_S, idle: bool = False) -> None:
        """Ask every thread to exit; one still busy after ``grace`` (at most 1 s) is left behind.

        An idle thread exits at once (so ``idle``, ``Pool.stop``'s hint, changes nothing
        here). A busy one cannot be killed, so waiting longer would only hold up the
        caller; it exits when its current call returns.
        """
        self._stopped = True
        for q in self._tasks:
            while not q.empty():  # tasks not begun are dropped, not worked through
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            q.put(m.Stop())
        deadline = time.monotonic() + min(grace, STOP_WAIT_S)
        for t in self.threads:
            # A collection that frees the iterator runs its finalizer (this) in whichever thread allocated: maybe
            # a worker of this pool, which exits once that call returns and it reads its Stop.
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.all_gone = not any(t.is_alive() for t in self.threads)
        self.threads = []
