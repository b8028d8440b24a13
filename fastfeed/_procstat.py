"""CPU time from /proc: the busy ticks of a set of CPUs, and the CPU seconds of a process tree.

Shared by the doctor's sampler and the tuner's noise meter (``fastfeed.tuning.noise``): a module of its own,
importing nothing of fastfeed, since the tuning is imported by the loader and the doctor's package imports the
loader.
"""

from __future__ import annotations

import os
import time
from typing import Collection

CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_stat(text: str, cpus: Collection[int] | None) -> tuple[int, int, int]:
    """``(busy, iowait, total)`` clock ticks of the ``cpuN`` lines of /proc/stat for N in ``cpus``.

    ``cpus`` None: all CPUs, read from the first, aggregate ``cpu`` line: one line to parse instead of one per
    CPU, which matters on a machine with a hundred cores and a process allowed on all of them.
    """
    if cpus is None:
        return _cpu_ticks(text[: text.index("\n")])
    wanted = {f"cpu{n}" for n in cpus}
    busy = iowait = total = 0
    for line in text.splitlines():
        if not line.startswith("cpu"):
            break  # the cpu lines come first
        if line[: line.index(" ")] in wanted:
            b, w, t = _cpu_ticks(line)
            busy, iowait, total = busy + b, iowait + w, total + t
    return busy, iowait, total


def _cpu_ticks(line: str) -> tuple[int, int, int]:
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, line.split(None, 9)[1:9])
    busy = user + nice + system + irq + softirq + steal  # guest time is already counted in user
    return busy, iowait, busy + idle + iowait


def tree_cpu_s(root: int | None = None) -> tuple[float, float]:
    """``(own, descendants)`` CPU seconds (user + system) so far of ``root`` (default: this process) and of its
    live descendants.

    ``own``: ``root``'s CPU-time clock. ``descendants``: each live descendant's CPU-time clock and its reaped
    children's time, plus ``root``'s reaped children's: a child that has exited and been reaped still counts,
    through its parent.

    A live process's time is its CPU-time clock (``clock_gettime`` on the process's clock id: every thread, ended
    ones too), in nanoseconds. ``/proc/<pid>/stat`` gives it in clock ticks (10 ms): over a short window, a few
    batches whose CPU is a few ms, the difference of two readings is off by up to a tick per process, which read a
    4-worker trial's CPU per batch as half or one and a half times what it was. Reaped children's time is in
    ticks (``cutime``, ``cstime``): the kernel keeps no finer figure for them.
    """
    root = root or os.getpid()
    stats = _tree(root)
    own, reaped = stats.pop(root, (0, 0))
    descendants = reaped / CLK_TCK
    for pid, (run, theirs) in stats.items():
        descendants += theirs / CLK_TCK + _clock_s(pid, run)
    return _clock_s(root, own), descendants


def tree_pids(root: int | None = None) -> list[int]:
    """Pids of ``root`` (default: this process) and of its live descendants, ``root`` first."""
    return list(_tree(root or os.getpid()))


def _tree(root: int) -> dict[int, tuple[int, int]]:
    """``{pid: (utime + stime, cutime + cstime)}`` of ``root`` and its live descendants, ``root`` first."""
    return _tree_stats(root) if _HAS_CHILDREN else _scanned_stats(root)


def _clock_s(pid: int, ticks: int) -> float:
    """Process ``pid``'s CPU-time clock in seconds; ``ticks`` (its stat's, just read) once it has exited."""
    try:
        # glibc's clock_getcpuclockid, which Python does not bind: (~pid << 3) | CPUCLOCK_SCHED, the whole process
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        return ticks / CLK_TCK


# /proc/<pid>/task/<tid>/children needs CONFIG_PROC_CHILDREN: where it is, the tree is walked through it (tens of
# microseconds); elsewhere the parents of every process are read (milliseconds with a few hundred processes).
_HAS_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def stat_ticks(pid: int) -> tuple[int, int, int]:
    """``(ppid, utime + stime, cutime + cstime)`` of a live process; OSError or ValueError once it has gone."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        text = f.read()
    # The command name (field 2) may hold spaces and ')': the fixed fields resume after the last ')'.
    fields = text[text.rindex(b")") + 1 :].split(None, 15)
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def _tree_stats(root: int) -> dict[int, tuple[int, int]]:
    """``{pid: (utime + stime, cutime + cstime)}`` of ``root`` and its descendants, through the children files."""
    out: dict[int, tuple[int, int]] = {}
    tree = [root]
    for pid in tree:  # grows while we walk it: breadth-first over grandchildren too
        try:
            out[pid] = stat_ticks(pid)[1:]
            for tid in os.listdir(f"/proc/{pid}/task"):  # a child's parent is the thread that forked it
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    tree.extend(int(c) for c in f.read().split())
        except (OSError, IndexError, ValueError):
            continue  # exited while we walked: once reaped, its parent's cutime holds its ticks
    return out


def _scanned_stats(root: int) -> dict[int, tuple[int, int]]:
    """``_tree_stats`` by a pass over every process in /proc, reading each one's stat once."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, tuple[int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ppid, run, reaped = stat_ticks(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # exited while we scanned
        children.setdefault(ppid, []).append(int(entry.name))
        ticks[int(entry.name)] = (run, reaped)
    out = {root: ticks.get(root, (0, 0))}
    tree = [root]
    for pid in tree:
        for child in children.get(pid, ()):
            if child in ticks:
                out[child] = ticks[child]
                tree.append(child)
    return out


# /proc/<pid>/task/<tid>/schedstat needs CONFIG_SCHED_INFO: where it is missing, run-queue waits are not known.
HAS_SCHEDSTAT = os.path.exists("/proc/self/schedstat")


def run_delay_ns(pids: Collection[int]) -> int | None:
    """Nanoseconds the threads of ``pids`` have spent runnable but waiting in a run queue for a core, summed over
    every thread (``/proc/<pid>/task/<tid>/schedstat``, second field); None where the kernel keeps no schedstat.

    A process or thread that exits between two readings takes its share along: differences may fall, and are for
    the caller to keep at 0 or more. A process already gone counts nothing.
    """
    if not HAS_SCHEDSTAT:
        return None
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the thread exited while we read
    return total
