"""What a DataLoader can leak: child processes, file descriptors and /dev/shm segments.

Linux-only, read straight from /proc and /dev/shm so that it works the same for
torch's DataLoader, for fastfeed's, and for another process (a script under test).
"""

import gc
import os
import time
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
SHM_PREFIXES = ("fastfeed-", "torch_")
MAX_LISTED = 12  # per kind of leak, in a failure message


def _stat(pid):
    """(state, ppid) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may contain spaces and parentheses; fields resume after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def start_ticks(pid):
    """When pid started, in clock ticks since boot (orders processes by creation)."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return int(text[text.rindex(")") + 2 :].split()[19])


def is_alive(pid):
    """True while pid runs; a zombie has exited and only waits to be reaped."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def children(pid=None):
    """Live (non-zombie) child pids of pid (default: this process)."""
    pid = os.getpid() if pid is None else pid
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[1] == pid and stat[0] not in ("Z", "X"):
                found.add(int(name))
    return found


def descendants(pid):
    """Live pids below pid in the process tree, at any depth."""
    found, frontier = set(), {pid}
    while frontier:
        level = set().union(*(children(p) for p in frontier)) - found
        found |= level
        frontier = level
    return found


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "<gone>"


def open_fds():
    """{fd: what it points at} for this process."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            # The descriptor os.listdir itself used is already closed.
            pass
    return fds


def shm_segments(prefixes=SHM_PREFIXES):
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)}


def segment_pid(name):
    """Creator pid encoded in 'fastfeed-<pid>-<hex>' or 'torch_<pid>_...', else None."""
    for prefix, sep in (("fastfeed-", "-"), ("torch_", "_")):
        if name.startswith(prefix):
            head = name[len(prefix) :].split(sep, 1)[0]
            return int(head) if head.isdigit() else None
    return None


def holders(name):
    """Live pids that map the segment /dev/shm/``name`` or hold a descriptor of it."""
    path = os.path.join(SHM_DIR, name)
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                if path in f.read():
                    found.add(int(entry))
                    continue
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}") == path:
                    found.add(int(entry))
                    break
        except OSError:  # gone, or not ours to read
            continue
    return found


def is_ours(name):
    # Other test runs (and the suite's other xdist workers) share /dev/shm: count a segment as ours if this process
    # or one of its descendants made it, or if its maker is dead (a worker of ours that already exited) and no live
    # process outside this tree still maps it; a live unrelated process's segment is not our leak, nor one that
    # another run's process maps after its maker (a killed job's main process) died.
    pid = segment_pid(name)
    mine = descendants(os.getpid()) | {os.getpid()}
    if pid is not None and is_alive(pid):
        return pid in mine
    held = holders(name)
    return not held or bool(held & mine)


@dataclass
class Snapshot:
    children: set
    fds: dict
    segments: set

    @classmethod
    def take(cls):
        return cls(children(), open_fds(), shm_segments())


def leaks(before, sockets=True):
    """Human-readable list of what exists now but did not in the `before` snapshot (``sockets=False``: less
    socket descriptors)."""
    now = Snapshot.take()
    if not sockets:
        before = Snapshot(before.children, _no_sockets(before.fds), before.segments)
        now = Snapshot(now.children, _no_sockets(now.fds), now.segments)
    found = []
    for pid in sorted(now.children - before.children):
        found.append(f"child process {pid}: {cmdline(pid)!r}")
    if len(now.fds) > len(before.fds):
        new = sorted(fd for fd, target in now.fds.items() if before.fds.get(fd) != target)
        shown = ", ".join(f"{fd} -> {now.fds[fd]}" for fd in new[:MAX_LISTED])
        more = f", and {len(new) - MAX_LISTED} more" if len(new) > MAX_LISTED else ""
        found.append(f"{len(now.fds) - len(before.fds)} file descriptor(s); new or changed: {shown}{more}")
    for name in sorted(now.segments - before.segments):
        if is_ours(name):
            found.append(f"shared-memory segment {SHM_DIR}/{name}")
    return found


def _no_sockets(fds: dict) -> dict:
    return {fd: target for fd, target in fds.items() if not target.startswith("socket:")}


def wait_for_no_leaks(before, timeout=5.0, sockets=True):
    """Poll (with gc) until nothing has leaked relative to `before`; returns what is left.

    Looked at once before any collection: with most tests nothing is left and a full collection (about 0.1 s in a
    process that imported torch, hence minutes over the suite) finds nothing to free. Where something is, a loader
    held by a reference cycle is freed by the collections that follow."""
    deadline = time.monotonic() + timeout
    found = leaks(before, sockets)
    while found and time.monotonic() < deadline:
        gc.collect()
        found = leaks(before, sockets)
        if found:
            time.sleep(0.05)
    return found


def wait_until_gone(pids, segment_prefixes, timeout=5.0):
    """For another process: poll until none of pids runs and no segment has one of the prefixes.

    Returns what is still there at the deadline.
    """
    deadline = time.monotonic() + timeout
    while True:
        alive = sorted(p for p in pids if is_alive(p))
        segments = sorted(shm_segments(tuple(segment_prefixes)))
        if (not alive and not segments) or time.monotonic() >= deadline:
            return [f"process {p}: {cmdline(p)!r}" for p in alive] + [
                f"segment {SHM_DIR}/{s}" for s in segments
            ]
        time.sleep(0.05)


def drop_tracebacks(error):
    """Detach the tracebacks of an exception and its causes; returns it.

    A traceback holds the frames of the iterator that raised, hence its workers and
    ring, until the garbage collector finds the cycle; torch's shutdown run from
    inside gc also waits ~5 s per worker.
    """
    link = error
    while link is not None:
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return error
