"""Worker processes and their pipes: start, send, receive, notice death, stop.

Each worker has its own pair of pipes, so the main process reads the batch it
needs from the worker that owns it, with no shared queue, lock or feeder
thread. A worker's death is seen at once through its process sentinel.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing.util  # its exit handler joins child processes: ours, registered after it, runs before it
import os
import select
import signal
import sys
import threading
import time
import warnings
from multiprocessing.connection import Connection
from pickle import PicklingError

from . import messages as m

STATUS_CHECK_S = 5.0  # torch's MP_STATUS_CHECK_INTERVAL
# torch's warning, word for word, when a worker's arguments fail to pickle (spawn, forkserver).
PICKLE_WARNING = (
    "Got pickle error when attempting to start a worker Process. "
    "This might be because the worker Process arguments are not picklable. "
    "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
    "to 'forkserver', which requires the worker Process arguments to be picklable. "
    "You can also try multiprocessing.set_start_method('fork')."
)
DUMP_SIGNAL = signal.SIGUSR1  # workers print their stacks on it (faulthandler)
_READY = select.POLLIN | select.POLLHUP | select.POLLERR


class WorkerDied(RuntimeError):
    pass


class Clock:
    """The deadline (``timeout``) and the hang dump of one wait for a worker's message."""

    def __init__(self, timeout: float | None, dump_s: float, dump):
        self.start = time.monotonic()
        self.deadline = None if not timeout else self.start + timeout
        self.dump_at = None if not dump_s else self.start + dump_s
        self.dump = dump  # dump(seconds waited): print the workers' stacks
        self.timeout = timeout

    def next_wait(self) -> float:
        """Seconds to block before looking again; dumps the stacks once, when it is time."""
        now = time.monotonic()
        wait = STATUS_CHECK_S if self.deadline is None else max(0.0, self.deadline - now)
        if self.dump_at is not None:
            if now >= self.dump_at:
                self.dump(now - self.start)
                self.dump_at = None
            else:
                wait = min(wait, self.dump_at - now)
        return wait

    def check(self) -> None:
        """Raise torch's timeout error once the deadline has passed."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds")


class _PipeEnd(Connection):
    """The main process's end of a worker's pipe: once closed, its descriptor number is never used again.

    ``Connection.__del__`` closes the descriptor but leaves the number set, so a stop that ran after it (the
    pool freed by gc in the same cycle as its connections) would write to and close whatever reused the number.
    """

    def __del__(self):
        self.close()


def _pipe() -> tuple[Connection, _PipeEnd, Connection, _PipeEnd]:
    """(task reader, task writer, result reader, result writer): the workers' ends plain (spawn pickles those)."""
    task_r, task_w = os.pipe()
    res_r, res_w = os.pipe()
    return (Connection(task_r, writable=False), _PipeEnd(task_w, readable=False),
            _PipeEnd(res_r, writable=False), Connection(res_w, readable=False))  # fmt: skip


@contextlib.contextmanager
def _frozen_for_fork(context):
    """gc.freeze() while workers are forked, so that their collector never walks the parent's objects.

    A full collection in a forked worker writes to the header of every object it tracks, so every page of the
    dataset's Python objects would be copied into every worker (pytorch/pytorch#13246). Objects frozen before
    the fork sit in the permanent generation, which the child's collector skips; the child never unfreezes them
    (they live as long as it does anyway). The parent unfreezes at once, so its own garbage is still collected.
    Only for fork: spawned and forkserver workers build their own objects. A program that froze objects itself
    manages its own freezing; it is left alone.
    """
    try:
        method = context.get_start_method()
    except (AttributeError, ValueError):
        method = None
    if method != "fork" or gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class Worker:
    __slots__ = ("worker_id", "process", "tasks", "results", "poller", "_child_ends")

    def __init__(self, worker_id):
        self.worker_id = worker_id
        self.process = None  # until launched
        task_r, self.tasks, self.results, res_w = _pipe()  # main writes tasks, reads results
        self._child_ends = (task_r, res_w)
        self.poller = select.poll()
        self.poller.register(self.results.fileno(), _READY)

    def launch(self, context, target, args) -> None:
        task_r, res_w = self._child_ends
        p = context.Process(target=target, args=(*args, task_r, res_w), daemon=True)
        try:
            p.start()
        except (TypeError, AttributeError, PicklingError):
            # As torch: warn, then raise. Its warning names the line of DataLoader._get_iterator that
            # makes the iterator; so does this one (launch < Pool < iterator < _get_iterator).
            warnings.warn(PICKLE_WARNING, stacklevel=4)
            raise
        finally:
            # The child holds its own ends now. Closing ours means a dead
            # worker shows as EOF, and a dead parent as EOF in the worker.
            self.close_child_ends()
        self.process = p
        self.poller.register(p.sentinel, _READY)

    def close_child_ends(self) -> None:
        for end in self._child_ends:
            end.close()
        self._child_ends = ()


class Pool:
    """Start ``num_workers`` processes running ``target(worker_id, *args, tasks, results)``.

    Every worker is forked here, before the caller sends a task (and so draws from its sampler): what the main
    process builds before a fork and writes to after it (an epoch's sampler order, whose reference counts it writes
    as it hands indices out) ends up copied, page by page, into that worker's private memory.
    """

    def __init__(self, context, num_workers, target, args_for, hang_dump_s: float = 0):
        self.hang_dump_s = hang_dump_s  # 0: never dump stacks by itself
        self.all_gone = False  # after stop(): every worker process has exited
        self.workers: list[Worker] = []
        self._any = select.poll()
        self._fd_owner: dict[int, Worker] = {}
        self.blocked = 0  # receives that found no answer waiting, and waited
        try:
            self.workers = [Worker(wid) for wid in range(num_workers)]
            args = [args_for(wid) for wid in range(num_workers)]
            with _frozen_for_fork(context):
                for w in self.workers:
                    w.launch(context, target, args[w.worker_id])
                    for fd in (w.results.fileno(), w.process.sentinel):
                        self._any.register(fd, _READY)
                        self._fd_owner[fd] = w
        except BaseException:
            started = []
            for w in self.workers:
                if w.process is None:  # never started: only its pipes to close
                    w.close_child_ends()
                    w.tasks.close()
                    w.results.close()
                else:
                    started.append(w)
            self.workers = started
            self.stop()  # a worker that failed to start must not strand the others
            raise

    @property
    def pids(self):
        return tuple(w.process.pid for w in self.workers)

    def send(self, wid: int, message) -> None:
        try:
            self.workers[wid].tasks.send_bytes(m.dumps(message))
        except (BrokenPipeError, OSError):
            raise self.death(self.workers[wid]) from None

    def _read(self, w: Worker):
        try:
            return m.loads(w.results.recv_bytes())
        except (EOFError, OSError):
            raise self.death(w) from None

    def recv(self, wid: int, timeout: float | None):
        """The next message from worker ``wid``; raises on its death or on timeout."""
        w = self.workers[wid]
        return self._wait(w.poller, lambda fd: w, timeout)

    def ready(self, wid: int) -> bool:
        """Whether worker ``wid`` has a message waiting (or has died): recv would not wait."""
        return bool(self.workers[wid].poller.poll(0))

    def recv_any(self, timeout: float | None):
        """The next message from whichever worker answers first."""
        return self._wait(self._any, self._fd_owner.__getitem__, timeout)

    def _wait(self, poller, owner, timeout):
        clock = Clock(timeout, self.hang_dump_s, self.dump_stacks)
        events = poller.poll(0)
        if not events:  # the answer is not here yet: the consumer waits (fastfeed.stats' ``ready``)
            self.blocked += 1
        while True:
            if not events:
                events = poller.poll(clock.next_wait() * 1000)
            for fd, _ in events:
                w = owner(fd)
                if fd == w.results.fileno():
                    return self._read(w)  # data first: a worker may exit right after its last reply
            if events:  # only a sentinel fired: that process exited
                raise self.death(owner(events[0][0]))
            clock.check()
            events = None

    def dump_stacks(self, waited: float) -> None:
        """Have every worker print its Python stack to stderr (a hung loader, diagnosed)."""
        print(
            f"fastfeed: no batch for {waited:.0f} s; the stacks of the DataLoader workers follow "
            f"(pids {', '.join(str(p) for p in self.pids)}). Send SIGUSR1 to a worker for its stack "
            "at any time.",
            file=sys.stderr,
            flush=True,
        )
        for w in self.workers:
            try:
                os.kill(w.process.pid, DUMP_SIGNAL)
            except ProcessLookupError:
                continue
            _dumped(w.process.pid)

    def retire(self, wid: int) -> None:
        """Stop a worker that has nothing more to do (its IterableDataset ended)."""
        w = self.workers[wid]
        for fd in (w.results.fileno(), w.process.sentinel):
            self._any.unregister(fd)
        try:
            w.tasks.send_bytes(m.dumps(m.Stop()))
        except OSError:
            pass

    def death(self, w: Worker) -> WorkerDied:
        """The error that says which worker died, and how."""
        w.process.join(timeout=1.0)
        code = w.process.exitcode
        pid = w.process.pid
        if code is not None and code < 0:
            try:
                how = f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
            if -code == signal.SIGKILL:
                how += " (often the out-of-memory killer: check `dmesg`, or lower batch_size/num_workers)"
            elif -code == signal.SIGBUS:
                how += " (often /dev/shm is too small: docker run --shm-size=8g ...)"
        elif code is not None:
            how = f"exited unexpectedly with exit code {code}"
        else:
            how = "closed its pipe unexpectedly"
        return WorkerDied(f"DataLoader worker {w.worker_id} (pid {pid}) {how}.")

    def on_own_thread(self) -> bool:
        """Whether the caller runs on a thread of the pool's own: never (its workers are processes)."""
        return False

    def stop(self, grace: float = STATUS_CHECK_S, idle: bool = False) -> None:
        """Ask every worker to exit; those still running after ``grace`` seconds are killed.

        ``idle``: every task was answered, so no worker will write anything more. Then
        the exits are waited for in a thread of their own: a forked worker's exit tears
        down its copy of this process's page tables (tens of ms for a large dataset),
        which the next epoch need not wait for.
        """
        for w in self.workers:
            try:
                w.tasks.send_bytes(m.dumps(m.Stop()))
            except OSError:
                pass
        procs = [w.process for w in self.workers]
        if idle:
            self._close_pipes()
            self.all_gone = True  # gone from the ring's point of view: none writes again
            reaper = threading.Thread(target=_reap, args=(procs, grace), name="ff_worker_reaper", daemon=True)
            _reapers.add(reaper)
            reaper.start()
            return
        self.all_gone = _end(procs, grace)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for w in self.workers:
            w.tasks.close()
            w.results.close()
        self.workers = []


_reapers: set[threading.Thread] = set()  # threads still waiting for stopped workers to exit


def _reap(procs, grace: float) -> None:
    _end(procs, grace)
    _reapers.discard(threading.current_thread())


@atexit.register
def _join_reapers() -> None:
    """At exit, let the reapers finish before multiprocessing's own exit handler joins every child process: a
    reaper closes the processes it joined, and a closed one makes that handler raise "process object is closed"."""
    for reaper in list(_reapers):
        reaper.join()


def _end(procs, grace: float) -> bool:
    """Wait for stopped workers to exit, kill those still running after ``grace``, release them.

    Returns:
        Whether every one has exited.
    """
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    gone = True
    for p in procs:
        if p.is_alive():  # stuck in user code: it will never read Stop
            p.kill()
            p.join(timeout=STATUS_CHECK_S)
        if p.is_alive():
            gone = False
        else:
            p.close()
    return gone


DUMP_SETTLE_S = 0.1  # after a worker took the dump signal: its handler's writes, before the next worker is signalled


def _dumped(pid: int, most_s: float = 1.0) -> None:
    """Wait until worker ``pid`` has taken the dump signal (none pending in ``/proc/<pid>/status``), then
    ``DUMP_SETTLE_S`` for its handler to write, at most ``most_s`` in all. faulthandler writes a stack a few bytes at a
    time to the stderr all workers share: two workers signalled at once interleaved theirs mid-line ("in   File
    __getitem__"), on a busy 2-core machine, so that neither stack read whole."""
    deadline = time.monotonic() + most_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                pending = next((line.split()[1] for line in f if line.startswith("ShdPnd:")), "0")
        except OSError:  # gone, or no /proc
            return
        if int(pending, 16) == 0:
            break
        time.sleep(0.005)
    time.sleep(max(0.0, min(DUMP_SETTLE_S, deadline - time.monotonic())))
