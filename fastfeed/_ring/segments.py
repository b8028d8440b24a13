"""Naming, creating and reclaiming the shared-memory segments of one ring.

Every segment of a ring is named ``fastfeed-<owner pid>-<pid namespace>-<ring token>-<random>``:
the random part makes names unguessable (they are created O_EXCL, mode 0600),
and the common prefix lets the owner unlink everything the ring or its workers
ever created with one sweep, even segments whose message was never read. The
owner pid lets a later process reclaim what a killed one left behind; the pid
namespace keeps it from judging a pid of another container sharing /dev/shm.

Segments live in /dev/shm (POSIX shared memory), or, with ``FASTFEED_SHM_DIR``,
as files in that directory (another tmpfs when /dev/shm is small).
"""

from __future__ import annotations

import errno
import glob
import os
import re
import secrets

from .. import _native, config

POSIX_SHM_DIR = "/dev/shm"  # where glibc's shm_open puts POSIX shared memory on Linux
PAGE = os.sysconf("SC_PAGESIZE")
_OURS = re.compile(r"fastfeed-(\d+)-([0-9a-f]+)-[0-9a-f]+-[0-9a-f]+")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_PIDNS = f"{_pid_namespace():x}"


def _name(directory: str, base: str) -> str:
    # A POSIX shm name for /dev/shm; an absolute file path anywhere else.
    return "/" + base if directory == POSIX_SHM_DIR else os.path.join(directory, base)


def _path(name: str) -> str:
    # The file behind a segment name: the name itself, or its place in /dev/shm.
    return name if "/" in name[1:] else os.path.join(POSIX_SHM_DIR, name[1:])


def pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: the size of every segment we create."""
    return -(-nbytes // PAGE) * PAGE


def new_prefix() -> str:
    """A fresh ring's name prefix (it carries the shm directory in force now)."""
    return _name(config.shm_dir(), f"fastfeed-{os.getpid()}-{_PIDNS}-{secrets.token_hex(4)}-")


def create(prefix: str, size: int, numa_node: int | None = None):
    """Create a fresh segment of ``size`` bytes, prefaulted (on ``numa_node``, if given), named under ``prefix``."""
    name = prefix + secrets.token_hex(8)
    try:
        return _native.C.Segment.create(name, size, numa_node=-1 if numa_node is None else numa_node)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise OSError(
                e.errno,
                f"fastfeed needs {size} bytes of shared memory for a batch slot, and "
                f"{os.path.dirname(_path(name))} could not "
                f"provide them ({e.strerror}). Give it more (for Docker: docker run "
                "--shm-size=8g ...), or point FASTFEED_SHM_DIR at a larger tmpfs, or lower "
                "batch_size, num_workers or prefetch_factor.",
            ) from e
        raise


def attach(name: str, populate: bool = True):
    return _native.C.Segment.attach(name, populate=populate)


def unlink(name: str) -> bool:
    return _native.C.unlink(name)


def sweep(prefix: str, keep: frozenset | set = frozenset()) -> int:
    """Unlink every segment still named under ``prefix``, except those named in ``keep``; returns how many."""
    directory = os.path.dirname(_path(prefix))
    count = 0
    for path in glob.glob(glob.escape(_path(prefix)) + "*"):
        name = _name(directory, os.path.basename(path))
        if name not in keep:
            count += unlink(name)
    return count


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts as alive: not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return True


def reclaim(directory: str | None = None) -> list[str]:
    """Unlink the segments of fastfeed processes that died without cleaning up.

    Only this user's segments, made in this pid namespace, whose owner pid no
    longer exists are touched.

    Returns:
        The names removed.
    """
    directory = os.path.abspath(directory or config.shm_dir())
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for base in entries:
        match = _OURS.fullmatch(base)
        if match is None or match.group(2) != _PIDNS or alive(int(match.group(1))):
            continue
        try:
            if os.lstat(os.path.join(directory, base)).st_uid != os.geteuid():
                continue
        except OSError:
            continue
        name = _name(directory, base)
        if unlink(name):
            removed.append(name)
    return removed
