"""GPUDirect Storage: ``ArrayFiles`` records read from disk straight into GPU memory through kvikio.

With GDS the NVMe drive DMAs into device memory: no page cache, no pinned bounce buffer, no host copy.
It needs three things that a CPU-only or driverless machine lacks: kvikio (the optional extra
``fastfeed[gds]``), the NVIDIA driver's ``libcuda.so.1``, and a CUDA device for torch. kvikio's reads
fail without libcuda even in its compatibility mode, so kvikio is imported and called only once all
three are present (``available()``); the POSIX path (``ArrayFiles``) never imports it.

cuFile moves data by DMA only for 4 KiB-aligned file offsets and device addresses; anything else goes
through its internal bounce buffers. ``GdsReader`` therefore reads a range straight into the batch only
when it is aligned at both ends, and otherwise widens it to page bounds, reads it into an aligned scratch
buffer and copies the wanted bytes on the device (see ``GdsReader``). It widens only reads that would
really go through cuFile: kvikio sends a read under its GDS threshold (``KVIKIO_GDS_THRESHOLD``, 1 MiB),
and every read in its compatibility mode, to POSIX, where alignment buys nothing.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import os
import sys
from typing import Any, Callable, Sequence

import torch

from .arrays import ArrayFiles, Range

PAGE = 4096
READERS = ("auto", "gds", "posix")
GDS_THRESHOLD = 1 << 20  # kvikio's default KVIKIO_GDS_THRESHOLD


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _kvikio_installed() -> bool:
    # find_spec locates the package without importing it (importing loads its CUDA libraries).
    return "kvikio" in sys.modules or importlib.util.find_spec("kvikio") is not None


def available() -> tuple[bool, str]:
    """Whether GDS reads can work in this process, and why not."""
    missing = []
    if not _kvikio_installed():
        missing.append("kvikio is not installed (pip install 'fastfeed[gds]')")
    if not _libcuda_loads():
        missing.append("libcuda.so.1 does not load (no NVIDIA driver)")
    elif not torch.cuda.is_available():
        missing.append("torch.cuda.is_available() is False")
    if missing:
        return False, "; ".join(missing)
    try:
        import kvikio  # noqa: F401
    except Exception as e:  # a broken install fails in its own ways (missing shared libraries, ABI)
        return False, f"kvikio is installed but does not import: {e!r}"
    return True, "kvikio, libcuda.so.1 and a CUDA device are present"


def choose(reader: str) -> str:
    """The reader to use for ``reader`` (``"auto"``, ``"gds"`` or ``"posix"``): ``"gds"`` or ``"posix"``."""
    if reader not in READERS:
        raise ValueError(f"reader={reader!r}: choose one of {', '.join(map(repr, READERS))}")
    if reader == "posix":
        return "posix"
    ok, why = available()
    if ok:
        return "gds"
    if reader == "gds":
        raise RuntimeError(f"reader='gds', but GPUDirect Storage cannot work here: {why}. Use reader='posix'.")
    return "posix"


def _page_ceil(n: int) -> int:
    return -(-n // PAGE) * PAGE


def aligned_pages(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``nbytes`` of ``raw`` (a uint8 buffer of at least ``nbytes + PAGE``) starting on a page boundary."""
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


# kvikio's settings moved from one function each (``gds_threshold()``, ``num_threads_reset(n)``, up to 24.12) to
# ``kvikio.defaults.get(name)`` / ``set(name, value)`` (25.04, the old ones deprecated). Up to 24.12
# ``set_num_threads`` is a context manager, so calling it alone would change nothing: the new API is tried first.


def compat_mode(kvikio) -> bool:
    """Whether kvikio reads through POSIX rather than cuFile (its compatibility mode; False where it cannot say)."""
    defaults = getattr(kvikio, "defaults", None)
    if defaults is None:
        return False
    if hasattr(defaults, "is_compat_mode_preferred"):  # AUTO resolved against the system
        return bool(defaults.is_compat_mode_preferred())
    mode = defaults.get("compat_mode") if hasattr(defaults, "get") else defaults.compat_mode()
    if isinstance(mode, bool):  # up to 24.08
        return mode
    return getattr(mode, "name", str(mode)).upper() == "ON"  # CompatMode.ON / OFF / AUTO


def gds_threshold(kvikio) -> int:
    """The read size under which kvikio's ``pread`` skips cuFile and reads through POSIX."""
    defaults = getattr(kvikio, "defaults", None)
    if defaults is not None and hasattr(defaults, "get"):
        return int(defaults.get("gds_threshold"))
    if defaults is not None and hasattr(defaults, "gds_threshold"):
        return int(defaults.gds_threshold())
    raw = os.environ.get("KVIKIO_GDS_THRESHOLD", "")
    try:
        return int(raw) if raw else GDS_THRESHOLD
    except ValueError:
        return GDS_THRESHOLD


def num_threads(kvikio) -> int | None:
    """The size of kvikio's thread pool, which splits and runs every ``pread`` (None where it cannot say)."""
    defaults = getattr(kvikio, "defaults", None)
    if defaults is not None and hasattr(defaults, "get"):
        return int(defaults.get("num_threads"))
    if defaults is not None and hasattr(defaults, "get_num_threads"):
        return int(defaults.get_num_threads())
    return None


def raise_threads(kvikio, wanted: int) -> int | None:
    """Grow kvikio's thread pool (one per process, 1 thread unless ``KVIKIO_NTHREADS`` says otherwise) to
    ``wanted``; returns its size. The user's ``KVIKIO_NTHREADS`` is kept, and a larger pool (another loader's)
    is not shrunk: resetting the pool waits for every read in flight."""
    have = num_threads(kvikio)
    if os.environ.get("KVIKIO_NTHREADS") or have is None or have >= wanted:
        return have
    defaults = kvikio.defaults
    if hasattr(defaults, "get") and hasattr(defaults, "set"):
        defaults.set("num_threads", wanted)
    elif hasattr(defaults, "num_threads_reset"):
        defaults.num_threads_reset(wanted)
    else:
        return have
    return num_threads(kvikio)


class Scratch:
    """A page-aligned uint8 buffer for widened reads that grows as needed; ``alloc(nbytes)`` makes its memory.

    ``alloc`` must return memory that no queued device work still uses: cuFile writes it at once, outside any
    stream order.
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor]):
        self._alloc = alloc
        self._raw: torch.Tensor | None = None

    def pages(self, nbytes: int) -> torch.Tensor:
        if self._raw is None or self._raw.numel() < nbytes + PAGE:
            self._raw = None  # its memory may go back to the allocator before the larger one is made
            self._raw = self._alloc(nbytes + PAGE)
        return aligned_pages(self._raw, nbytes)


class GdsReader:
    """Reads batches of an ``ArrayFiles`` into a device tensor with kvikio, one ``CuFile`` per file.

    A batch's byte ranges (``ArrayFiles.ranges``: contiguous samples merged) are all issued as
    ``CuFile.pread`` futures, then waited on together. A range whose file offset and destination address
    are page-aligned, and whose size is whole pages or which ends the file's data, is read straight into
    ``out``. So is a range that kvikio reads through POSIX whatever its alignment (under its GDS threshold,
    or in compatibility mode). Any other range is widened to page bounds (clamped to
    the data's end) and read into an aligned scratch buffer on ``out``'s device, from which the wanted bytes
    are copied on the current stream: at most two extra pages per range and a device copy, in exchange for
    DMA instead of bounce buffers. ``stats`` counts ``aligned`` (cuFile, direct), ``widened`` (cuFile, through
    scratch) and ``posix`` reads (kvikio's POSIX path), and the bytes wanted and read.

    Args:
        arrays: the dataset.
        threads: kvikio's thread pool is grown to this many threads (see ``raise_threads``); None leaves it.
    """

    def __init__(self, arrays: ArrayFiles, threads: int | None = None):
        ok, why = available()
        if not ok:
            raise RuntimeError(f"GPUDirect Storage cannot work here: {why}. Use reader='posix'.")
        import kvikio

        self._kvikio = kvikio
        self.arrays = arrays
        self.stats = {"batches": 0, "aligned": 0, "widened": 0, "posix": 0, "bytes_wanted": 0, "bytes_read": 0}
        self.compat_mode = compat_mode(kvikio)
        self.gds_threshold = gds_threshold(kvikio)
        self.threads = raise_threads(kvikio, threads) if threads else num_threads(kvikio)
        self._handles: dict[int, Any] = {}
        self._scratch: Scratch | None = None  # read_batch's own, when the caller brings none
        self._scratch_device: torch.device | None = None
        self._copied: torch.cuda.Event | None = None  # the last batch's copies out of that scratch buffer

    def _handle(self, k: int) -> Any:
        if k not in self._handles:
            self._handles[k] = self._kvikio.CuFile(self.arrays.files[k].path, "r")
        return self._handles[k]

    def _data_end(self, k: int) -> int:
        return self.arrays.files[k].end(self.arrays.record_nbytes)

    def _direct(self, r: Range, out_bytes: torch.Tensor) -> bool:
        whole = r.nbytes % PAGE == 0 or r.file_offset + r.nbytes == self._data_end(r.file_index)
        return r.file_offset % PAGE == 0 and (out_bytes.data_ptr() + r.out_offset) % PAGE == 0 and whole

    def _posix(self, r: Range) -> bool:
        """Whether kvikio reads ``r`` through POSIX (into a bounce buffer) whatever its alignment."""
        return self.compat_mode or r.nbytes < self.gds_threshold

    def _widen(self, r: Range) -> tuple[int, int]:
        lo = r.file_offset - r.file_offset % PAGE
        return lo, min(_page_ceil(r.file_offset + r.nbytes), self._data_end(r.file_index))

    def _own_scratch(self, device: torch.device) -> Scratch:
        """read_batch's own scratch buffer, for a caller that brings none: the last batch's copies must be done."""
        if self._copied is not None:
            self._copied.synchronize()  # the last batch's copies still read the old contents
            self._copied = None
        if self._scratch is None or self._scratch_device != device:
            self._scratch = Scratch(lambda n: torch.empty(n, dtype=torch.uint8, device=device))
            self._scratch_device = device
        return self._scratch

    def read_batch(
        self, indices: Sequence[int], out: torch.Tensor, scratch: Scratch | None = None,
        copy: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Read samples ``indices`` into ``out``, a contiguous device tensor ``(len(indices), *sample_shape)``.

        The reads are not stream-ordered: no queued work may still use ``out`` (nor ``scratch``). Returns
        ``out`` once the reads are done; the copies out of the scratch buffer are queued on the current stream.

        Args:
            indices: the samples.
            out: where they go.
            scratch: the buffer for widened reads, which the caller keeps until the copies out of it are done;
                None: the reader's own, and then it waits for the last call's copies before reusing it.
            copy: ``copy(target, source)`` queues a device copy (default ``target.copy_(source)``).
        """
        want = (len(indices), *self.arrays.sample_shape)
        if out.dtype != self.arrays.dtype or tuple(out.shape) != want or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {self.arrays.dtype} tensor of shape {want}; "
                             f"got {out.dtype} {tuple(out.shape)}")
        out_bytes = out.view(-1).view(torch.uint8)
        ranges = self.arrays.ranges(indices)
        posix = [r for r in ranges if self._posix(r)]
        direct = [r for r in ranges if not self._posix(r) and self._direct(r, out_bytes)]
        widened = [r for r in ranges if not self._posix(r) and not self._direct(r, out_bytes)]
        reads = [(r.file_index, r.file_offset, out_bytes[r.out_offset : r.out_offset + r.nbytes])
                 for r in posix + direct]  # fmt: skip
        own = scratch is None and bool(widened)
        if own:
            scratch = self._own_scratch(out_bytes.device)
        copies = self._widened_reads(widened, out_bytes, reads, scratch) if widened else []
        self._read_all(reads)
        for target, source in copies:
            target.copy_(source) if copy is None else copy(target, source)
        if own and out.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._count(ranges, reads, len(direct), len(posix))
        return out

    def _widened_reads(
        self, widened: list[Range], out_bytes: torch.Tensor, reads: list[tuple[int, int, torch.Tensor]],
        scratch: Scratch,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """Append the page-bounded reads of ``widened`` into scratch to ``reads``; return the copies to make."""
        spans = [self._widen(r) for r in widened]
        starts = list(itertools.accumulate((_page_ceil(hi - lo) for lo, hi in spans), initial=0))
        pages = scratch.pages(starts[-1])
        copies = []
        for r, (lo, hi), at in zip(widened, spans, starts):
            reads.append((r.file_index, lo, pages[at : at + hi - lo]))
            skip = at + r.file_offset - lo
            copies.append((out_bytes[r.out_offset : r.out_offset + r.nbytes], pages[skip : skip + r.nbytes]))
        return copies

    def _read_all(self, pending: list[tuple[int, int, torch.Tensor]]) -> None:
        """Issue every ``(file_index, file_offset, destination)`` read, then wait for all of them."""
        futures, results = [], []
        try:
            for k, offset, buf in pending:
                futures.append(self._handle(k).pread(buf, size=buf.numel(), file_offset=offset))
        finally:
            # Wait for every issued read, even after an error: one still in flight would write into reused memory.
            for future in futures:
                try:
                    results.append(future.get())
                except Exception as e:
                    results.append(e)
        for (k, offset, buf), got in zip(pending, results):
            where = f"{self.arrays.files[k].path}: read of {buf.numel()} bytes at offset {offset}"
            if isinstance(got, Exception):
                raise OSError(f"{where} failed: {got}") from got
            if got != buf.numel():
                raise OSError(f"{where} came back short: {got} bytes")

    def _count(self, ranges: list[Range], reads: list[tuple[int, int, torch.Tensor]], direct: int,
               posix: int) -> None:  # fmt: skip
        self.stats["batches"] += 1
        self.stats["aligned"] += direct
        self.stats["posix"] += posix
        self.stats["widened"] += len(ranges) - direct - posix
        self.stats["bytes_wanted"] += sum(r.nbytes for r in ranges)
        self.stats["bytes_read"] += sum(buf.numel() for _, _, buf in reads)

    def close(self) -> None:
        """Close the ``CuFile`` handles; a later read reopens them."""
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.close()

    def __enter__(self) -> GdsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
