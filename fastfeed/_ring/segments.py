"""Naming, creating and reclaiming the shared-memory segments of one ring.

Every segment of a ring is named ``/fastfeed-<owner pid>-<ring token>-<random>``:
the random part makes names unguessable (they are created O_EXCL, mode 0600),
and the common prefix lets the owner unlink everything the ring or its workers
ever created with one sweep, even segments whose message was never read.
"""

from __future__ import annotations

import errno
import glob
import os
import secrets

from .. import _native

SHM_DIR = "/dev/shm"  # where glibc's shm_open puts POSIX shared memory on Linux
PAGE = os.sysconf("SC_PAGESIZE")


def pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: the size of every segment we create."""
    return -(-nbytes // PAGE) * PAGE


def new_prefix() -> str:
    return f"/fastfeed-{os.getpid()}-{secrets.token_hex(4)}-"


def create(prefix: str, size: int):
    """Create a fresh segment of ``size`` bytes, prefaulted, named under ``prefix``."""
    name = prefix + secrets.token_hex(8)
    try:
        return _native.C.Segment.create(name, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise OSError(
                e.errno,
                f"fastfeed could not allocate {size} bytes of shared memory in {SHM_DIR} "
                f"for a batch slot ({e.strerror}). Free space there, or give the machine or "
                "container more (for Docker: docker run --shm-size=8g ...), or lower "
                "batch_size, num_workers or prefetch_factor.",
            ) from e
        raise


def attach(name: str, populate: bool = True):
    return _native.C.Segment.attach(name, populate=populate)


def unlink(name: str) -> bool:
    return _native.C.unlink(name)


def sweep(prefix: str) -> int:
    """Unlink every segment still named under ``prefix``; returns how many."""
    count = 0
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix.lstrip("/")) + "*")):
        count += unlink("/" + os.path.basename(path))
    return count
