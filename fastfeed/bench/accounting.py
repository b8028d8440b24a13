"""Memory and CPU accounting for a trial: the process tree, its PSS and footprint, and its CPU seconds.

Every figure counts the whole tree (this process and its workers), read from ``/proc``, so that a loader that
moves work into worker processes, or memory into shared memory, is charged for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import resource
import threading
import time
from collections.abc import Iterator, Sequence

from .. import _procstat
from .._ring.segments import alive

MB = 1e6


def process_tree(root: int | None = None) -> list[int]:
    """Pids of ``root`` (default: this process) and all its live descendants: ``_procstat``'s walk of the tree, which
    the tuner's CPU meter and ``tree_cpu_s`` read too."""
    return _procstat.tree_pids(root)


SHM_DIR = "/dev/shm"


def shm_owner(name: str) -> int | None:
    """The pid a /dev/shm entry is named for (``fastfeed-<pid>-...``, ``torch_<pid>_...``), else None."""
    m = re.match(r"(?:fastfeed|torch)[-_](\d+)[-_]", name)
    return int(m.group(1)) if m else None


def shm_left(before: set[str]) -> list[str]:
    """The /dev/shm entries made since ``before`` (a listing) that this run may have left: all but those named for
    a live process outside this process's tree.

    Other programs on a shared machine make and remove their own entries meanwhile (another test run's loaders,
    say); a live stranger's entry is not this run's leak, while one named for a process of ours, or for one that
    has exited (a worker that died without cleaning up), is.
    """
    new = set(os.listdir(SHM_DIR)) - before
    ours = set(process_tree())

    def strangers(name: str) -> bool:
        pid = shm_owner(name)
        return pid is not None and pid not in ours and alive(pid)

    return sorted(n for n in new if not strangers(n))


def _pss_anon_shmem_mb(pids: Sequence[int]) -> tuple[float, float]:
    """Summed ``Pss_Anon`` and ``Pss_Shmem`` of ``pids``, in MB, from one read of each smaps_rollup.

    Reading smaps_rollup walks the process's page tables: ~8 ms for a process that maps the
    transport pool (403 MB), so each is read once per sample. Kernels before 5.9 give only the
    total ``Pss``, counted as anonymous.
    """
    anon_kb = shmem_kb = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                fields = dict(line.split()[:2] for line in f if line.startswith(b"Pss"))
        except OSError:
            continue  # a vanished pid counts 0
        if b"Pss_Anon:" in fields:
            anon_kb += int(fields[b"Pss_Anon:"])
            shmem_kb += int(fields.get(b"Pss_Shmem:", 0))
        else:
            anon_kb += int(fields.get(b"Pss:", 0))
    return anon_kb * 1024 / MB, shmem_kb * 1024 / MB


def pss_mb(pids: Sequence[int], anon_only: bool = False) -> float:
    """Summed PSS of anonymous and shared memory of ``pids``, in MB (a vanished pid counts 0).

    File-backed pages (the code of torch and Python) are left out: this VM's proactive reclaim
    (kdamond) evicts and refaults them at random, which moved the sum by ~15 MB from one sample
    to the next, and a loader's buffers are anonymous or shared memory, never file-backed.
    """
    anon, shmem = _pss_anon_shmem_mb(pids)
    return anon if anon_only else anon + shmem


def shmem_mb() -> float:
    """All shared memory on the machine (/proc/meminfo ``Shmem``), in MB.

    PSS only sees shared memory that some process maps. torch's workers hand each batch over as
    a file descriptor in a socket message, and while it waits there nobody maps it, so PSS misses
    torch's in-flight batches. The machine-wide figure counts them (it is only meaningful when
    nothing else on the machine is allocating shared memory).
    """
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"Shmem:"):
                return int(line.split()[1]) * 1024 / MB
    return 0.0


def footprint_mb(pids: Sequence[int]) -> float:
    """Anonymous PSS of ``pids`` plus all shared memory: the memory a loader really holds."""
    return pss_mb(pids, anon_only=True) + shmem_mb()


class PeakPss:
    """Peak of the PSS summed over the process tree, from synchronous and background samples.

    PSS splits shared pages among the processes that map them, so the sum over the tree counts
    forked-but-shared memory and shared-memory batches once, not once per process.
    """

    def __init__(self):
        self.peak_mb, self.peak_procs, self.samples = 0.0, 0, 0
        self.foot_peak_mb = 0.0
        self._lock = threading.Lock()  # the consumer and the background thread both sample

    def sample(self) -> float:
        """Take one sample now; return it in MB."""
        pids = process_tree()
        anon, shmem = _pss_anon_shmem_mb(pids)
        mb, foot = anon + shmem, anon + shmem_mb()  # footprint_mb, without reading smaps twice
        with self._lock:
            self.samples += 1
            self.foot_peak_mb = max(self.foot_peak_mb, foot)
            if mb > self.peak_mb:
                self.peak_mb, self.peak_procs = mb, len(pids)
        return mb

    @contextlib.contextmanager
    def sampling(self, interval: float = 0.01) -> Iterator[None]:
        """Sample in a background thread every ``interval`` seconds while the block runs."""
        stop = threading.Event()

        def loop():
            while not stop.wait(interval):
                self.sample()

        thread = threading.Thread(target=loop, name="bench-pss", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def main_cpu_s() -> float:
    # RUSAGE_SELF: every thread of this process (a loader's pin-memory thread is its cost), no workers.
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def tree_cpu_s() -> float:
    """CPU seconds (user + system) so far of this process and its live descendants, with their reaped children
    (``_procstat.tree_cpu_s``, in nanoseconds for the live ones: a short trial's 2 batches, prefetched before it,
    cost a few ms, which clock ticks round to 0).

    ``getrusage(RUSAGE_CHILDREN)`` cannot help, as worker processes are not reaped until their loader ends. A
    worker that exits and is joined between two readings (epoch mode, ``persistent_workers=False``) moves its CPU
    from its own entry to its parent's reaped children, so the difference of two readings keeps it, to a tick.
    """
    return sum(_procstat.tree_cpu_s())


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS.

    glibc keeps freed chunks (a 9.6 MB batch, a trial's dataset) in the heap, where they stay
    resident: the next trial's PSS baseline would include them and its loader would reuse them
    without growing PSS at all, so a trial's figure would depend on the one before it.
    """
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim with


def wait_for_exit(pids: set[int], timeout: float = 5.0) -> int:
    """Wait until none of ``pids`` is a live descendant; return how many still are."""
    deadline = time.monotonic() + timeout
    while (left := pids & set(process_tree())) and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(left)
