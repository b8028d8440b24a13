"""fastfeed's settings from the environment, in one place (every key is ``FASTFEED_*``).

- ``FASTFEED_SHM_DIR``: directory for batch segments instead of /dev/shm (another tmpfs when
  /dev/shm is small, as in Docker's default 64 MB).
- ``FASTFEED_HANG_DUMP_S``: when a batch is this many seconds late, every worker prints its stack.
- ``FASTFEED_SYSFS_ROOT``: read the machine's topology from this sysfs tree instead of /sys
  (read by ``fastfeed.topology``; for tests and bug reproductions).
- ``FASTFEED_STATS``: ``0`` turns off the per-batch measurements behind ``DataLoader.stats()``
  (read when an iterator starts).
- ``FASTFEED_CACHE_DIR``: where ``num_workers="auto"`` keeps its tuning results (``tune.json``),
  instead of ``~/.cache/fastfeed``.
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


def stats_enabled() -> bool:
    raw = os.environ.get("FASTFEED_STATS", "1").strip().lower()
    if raw in ("0", "false", "off", "no"):
        return False
    if raw in ("", "1", "true", "on", "yes"):
        return True
    raise ValueError(f"FASTFEED_STATS={raw!r}: use 1 (measure, the default) or 0 (off)")


def cache_dir() -> str:
    """Where tuning results are cached: ``FASTFEED_CACHE_DIR``, or ``~/.cache/fastfeed``."""
    raw = os.environ.get("FASTFEED_CACHE_DIR")
    if raw:
        return os.path.abspath(raw)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fastfeed")
