"""Page-locking ring segments with the CUDA runtime torch uses: cudaHostRegister, once per segment.

torch's pin-memory thread copies every batch into freshly pinned memory. The ring's slots
are reused, so registering each segment once makes every batch written into it pinned,
with no second copy and no thread. The runtime is loaded at run time (the extension does
not link it): the libcudart that torch itself loaded, found in ``/proc/self/maps``, or the
library named by ``FASTFEED_CUDART``.
"""

from __future__ import annotations

import ctypes.util
import os

import torch

from . import config
from ._native import C

_ready: bool | None = None  # None: not tried yet
_why_not = ""


def _loaded_cudart() -> str | None:
    """The path of the libcudart mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libcudart.so"):
                    return path
    except OSError:
        pass
    return None


def runtime_path() -> str | None:
    """Where the CUDA runtime to load lies: ``FASTFEED_CUDART``, torch's, or the system's."""
    override = config.cudart()
    if override:
        return override
    if torch.cuda.is_available():
        torch.cuda.init()  # torch loads its runtime lazily
    return _loaded_cudart() or ctypes.util.find_library("cudart")


def enable() -> str:
    """Load the runtime once; returns "" when segments can be pinned, else why they cannot."""
    global _ready, _why_not
    if _ready is None:
        path = runtime_path()
        _why_not = "no CUDA runtime library was found" if path is None else C.cuda_load(path)
        _ready = not _why_not
    return _why_not
