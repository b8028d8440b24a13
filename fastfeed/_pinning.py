"""Page-locking ring segments with the CUDA runtime torch uses: cudaHostRegister, once per segment.

torch's pin-memory thread copies every batch into freshly pinned memory. The ring's slots
are reused, so registering each segment once makes every batch written into it pinned,
with no second copy and no thread. The runtime is loaded at run time (the extension does
not link it): the libcudart that torch itself loaded, found in ``/proc/self/maps``, or the
library named by ``FASTFEED_CUDART``.

Loading is not enough: registration of shared memory can fail where CUDA works (virtualised
GPUs, exhausted locked memory, an unusual ``FASTFEED_SHM_DIR``). ``enable()`` therefore
registers and unregisters two pages of a segment once, so that such a machine copies into
pinned memory from the start rather than failing in the middle of an epoch.
"""

from __future__ import annotations

import ctypes.util
import os
import re

import torch

from . import config
from ._native import C
from ._ring import pinner, segments

_ready: bool | None = None  # None: not tried yet
_why_not = ""
_probed: dict[int, str] = {}  # device -> "" or why registering shared memory fails there

# libcudart.so.12 as the CUDA toolkit names it; libcudart-1a2b3c4d.so.12 as auditwheel renames a bundled copy.
_CUDART = re.compile(r"libcudart(?:-[0-9a-f]+)?\.so(?:\.[0-9.]+)?")


def cudart_in(paths) -> str | None:
    """Of the mapped file paths ``paths``, the libcudart to use: the one in torch's own install, else the first."""
    found = [p for p in paths if _CUDART.fullmatch(os.path.basename(p))]
    torch_dir = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))  # site-packages: torch/, nvidia/
    ours = [p for p in found if p.startswith(torch_dir + os.sep)]
    return (ours or found or [None])[0]


def _loaded_cudart() -> str | None:
    """The path of the libcudart mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.rstrip("\n").split(maxsplit=5)[-1] for line in maps]
    except OSError:
        return None
    return cudart_in(p for p in paths if p.startswith("/"))


def runtime_path() -> str | None:
    """Where the CUDA runtime to load lies: ``FASTFEED_CUDART``, torch's, or the system's."""
    override = config.cudart()
    if override:
        return override
    if torch.cuda.is_available():
        torch.cuda.init()  # torch loads its runtime lazily
    return _loaded_cudart() or ctypes.util.find_library("cudart")


def enable(device: int | None = None) -> str:
    """Load the runtime once, and try registering shared memory under ``device`` once.

    Args:
        device: the CUDA device index segments will be registered under; None: torch's current one.

    Returns:
        "" when segments can be pinned, else why they cannot.
    """
    global _ready, _why_not
    if _ready is None:
        path = runtime_path()
        _why_not = "no CUDA runtime library was found" if path is None else C.cuda_load(path)
        _ready = not _why_not
    if _why_not:
        return _why_not
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    if device not in _probed:
        _probed[device] = _probe(device)
    return _probed[device]


def _probe(device: int) -> str:
    # Two pages of a segment made where the ring's are, registered on the thread that will register theirs.
    prefix = segments.new_prefix()
    try:
        segment = segments.create(prefix, 2 * segments.PAGE)
    except OSError as e:
        return f"no shared memory to try registering: {e}"
    segments.unlink(segment.name)
    why = pinner.for_device(device).probe(segment)
    return f"registering shared memory with CUDA fails here ({why})" if why else ""
