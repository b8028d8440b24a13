"""One read-only block of shared memory: a sealed memfd, mapped by every process that uses it.

Why a memfd and not a name in /dev/shm, as the ring's segments have: a memfd has no name at all. There is
nothing to guess and nothing to leave behind: the kernel frees its pages when the last descriptor and the last
mapping of it are gone, whether the processes holding them exited, crashed or were killed with SIGKILL. Nothing
needs a sweeper, and /dev/shm's size (64 MB in a default Docker container) does not limit it.

Another process reaches the block through ``/proc/<holder pid>/fd/<fd>``: the kernel lets only a process that may
inspect the holder (the same user, by default) open that path, and the block is also chmod 0600. A handle carries
the holder's pid and descriptor plus the block's device and inode, checked on attach, so a descriptor number
reused for something else is never mistaken for the block.

Once written, the block is sealed (F_SEAL_WRITE, GROW, SHRINK, SEAL): no process, the writer included, can change
it any more, and every process maps it read-only.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import weakref
from typing import NamedTuple

from .._ring.segments import _PIDNS

_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename


# Where a /proc/<pid> path means the same process as it did for the writer: one boot of one machine, one pid
# namespace.
HOST = f"{_boot_id()}/{_PIDNS}"


class Handle(NamedTuple):
    """How another process on this machine attaches to a block: what a pickle of a shared object carries."""

    host: str  # HOST of the holder
    pid: int  # a process that holds the block open
    fd: int  # its descriptor of the block
    dev: int  # the block's identity, checked on attach
    ino: int
    size: int


class Writer:
    """Appends bytes to a fresh memfd; ``seal()`` makes it the read-only Block."""

    CHUNK = 8 << 20  # bytes gathered before one write(): a syscall per item would cost more than the pickling

    def __init__(self, label: str):
        self.fd = os.memfd_create(f"fastfeed-share-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(self.fd, 0o600)
        except OSError:
            pass  # some kernels refuse chmod on a memfd; /proc's ptrace check still keeps other users out
        self.size = 0
        self._pending = bytearray()

    def write(self, data) -> int:
        """Append ``data``; returns the offset it starts at."""
        at = self.size
        self._pending += data
        self.size += len(data)
        if len(self._pending) >= self.CHUNK:
            self.flush()
        return at

    def flush(self) -> None:
        view = memoryview(self._pending)
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except OSError as e:
                os.close(self.fd)
                self.fd = -1
                raise OSError(
                    e.errno,
                    f"fastfeed.share could not write {self.size} bytes of shared memory ({e.strerror}): the "
                    "machine's memory (or this container's memory limit) is short. Share fewer or smaller "
                    "containers, or free memory first.",
                ) from e
        self._pending = bytearray()

    def seal(self) -> Block:
        self.flush()
        if self.size == 0:
            os.write(self.fd, b"\0")  # mmap refuses an empty file
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        fd, self.fd = self.fd, -1
        return Block(fd)

    def __del__(self):
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)


_attached: dict[tuple[int, int], weakref.ref] = {}  # (dev, ino) -> Block mapped in this process
# Re-entrant: a garbage collection run while this thread holds it (an allocation inside Block.__init__) may finalize
# another Block, whose __del__ takes it again.
_attached_lock = threading.RLock()


class Block:
    """A sealed memfd mapped read-only; its descriptor stays open so that others can attach through /proc."""

    def __init__(self, fd: int):
        self.fd = fd
        st = os.fstat(fd)
        self.dev, self.ino, self.size = st.st_dev, st.st_ino, st.st_size
        self.map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.view = memoryview(self.map)
        with _attached_lock:
            _attached[(self.dev, self.ino)] = weakref.ref(self)
        self._pid = os.getpid()

    def handle(self) -> Handle:
        return Handle(HOST, os.getpid(), self.fd, self.dev, self.ino, self.size)

    def __del__(self):
        # Close the descriptor only: the mapping goes with the mmap object once no numpy view or memoryview of
        # it is left (closing it by hand would pull pages from under a view still in use).
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        with _attached_lock:
            key = (getattr(self, "dev", None), getattr(self, "ino", None))
            ref = _attached.get(key)
            if ref is not None and ref() in (None, self):
                del _attached[key]


def attach(handle: Handle) -> Block:
    """The Block that ``handle`` names, mapped in this process (once per process, however often attached)."""
    with _attached_lock:
        ref = _attached.get((handle.dev, handle.ino))
        block = ref() if ref is not None else None
    if block is not None:
        return block
    if handle.host != HOST:
        raise RuntimeError(
            f"fastfeed.share: this object's items are in shared memory on another machine (or pid namespace: "
            f"{handle.host}, here {HOST}), and only processes there can map them. Call fastfeed.share on this "
            "machine (in the process that builds the dataset here), or send the object unshared."
        )
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise RuntimeError(
            f"fastfeed.share: cannot map the shared items held by process {handle.pid} ({path}: {e.strerror}). "
            "That process must still be running, and be this user's, when the object is unpickled: keep the "
            "shared object alive in the process that shared it (the main process, local rank 0) until its "
            "workers and ranks have started."
        ) from e
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (handle.dev, handle.ino) or st.st_uid != os.geteuid():
        os.close(fd)
        raise RuntimeError(
            f"fastfeed.share: descriptor {handle.fd} of process {handle.pid} is no longer the shared block it "
            "was (the process freed the shared object, and the number was reused). Keep the shared object alive "
            "in the process that shared it until its workers and ranks have started."
        )
    return Block(fd)
