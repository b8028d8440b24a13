"""fastfeed's settings from the environment, in one place (every key is ``FASTFEED_*``).

- ``FASTFEED_SHM_DIR``: directory for batch segments instead of /dev/shm (another tmpfs when
  /dev/shm is small, as in Docker's default 64 MB).
- ``FASTFEED_HANG_DUMP_S``: when a batch is this many seconds late, every worker prints its stack.
- ``FASTFEED_SYSFS_ROOT``: read the machine's topology from this sysfs tree instead of /sys
  (read by ``fastfeed.topology``; for tests and bug reproductions).
- ``FASTFEED_CUDART``: the CUDA runtime library to pin ring memory with, instead of the one
  torch loaded (for a torch whose runtime is linked statically, or for tests).
"""

from __future__ import annotations

import os


def _float(key: str, default: float) -> float:
    raw = os.environ.get(key, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not a number of seconds; unset it or give e.g. {key}=60") from None
    if value < 0:
        raise ValueError(f"{key}={raw!r} must be >= 0 (0 turns it off)")
    return value


def hang_dump_s() -> float:
    return _float("FASTFEED_HANG_DUMP_S", 0.0)


def shm_dir() -> str:
    """Where batch segments are made: ``FASTFEED_SHM_DIR``, or /dev/shm."""
    return os.path.abspath(os.environ.get("FASTFEED_SHM_DIR") or "/dev/shm")


def cudart() -> str:
    return os.environ.get("FASTFEED_CUDART", "")


def sysfs_root() -> str:
    return os.environ.get("FASTFEED_SYSFS_ROOT") or "/sys"
