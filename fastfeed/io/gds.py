"""GPUDirect Storage: ``ArrayFiles`` records read from disk straight into GPU memory through kvikio.

With GDS the NVMe drive DMAs into device memory: no page cache, no pinned bounce buffer, no host copy.
It needs three things that a CPU-only or driverless machine lacks: kvikio (the optional extra
``fastfeed[gds]``), the NVIDIA driver's ``libcuda.so.1``, and a CUDA device for torch. kvikio's reads
fail without libcuda even in its compatibility mode, so kvikio is imported and called only once all
three are present (``available()``); the POSIX path (``ArrayFiles``) never imports it.

cuFile moves data by DMA only for 4 KiB-aligned file offsets and device addresses; anything else goes
through its internal bounce buffers. ``GdsReader`` therefore reads a range straight into the batch only
when it is aligned at both ends, and otherwise widens it to page bounds, reads it into an aligned scratch
buffer and copies the wanted bytes on the device (see ``GdsReader``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import sys
from typing import Any, Sequence

import torch

from .arrays import ArrayFiles, Range

PAGE = 4096
READERS = ("auto", "gds", "posix")


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


class GdsReader:
    """Reads batches of an ``ArrayFiles`` into a device tensor with kvikio, one ``CuFile`` per file.

    A batch's byte ranges (``ArrayFiles.ranges``: contiguous samples merged) are all issued as
    ``CuFile.pread`` futures, then waited on together. A range whose file offset and destination address
    are page-aligned, and whose size is whole pages or which ends the file's data, is read straight into
    ``out``. Any other range is widened to page bounds (clamped to the data's end) and read into an aligned
    scratch buffer on ``out``'s device, from which the wanted bytes are copied on the current stream:
    at most two extra pages per range and a device copy, in exchange for DMA instead of bounce buffers.
    ``stats`` counts ``aligned`` (direct) and ``widened`` reads, and the bytes wanted and read.
    """

    def __init__(self, arrays: ArrayFiles):
        ok, why = available()
        if not ok:
            raise RuntimeError(f"GPUDirect Storage cannot work here: {why}. Use reader='posix'.")
        import kvikio

        self._kvikio = kvikio
        self.arrays = arrays
        self.stats = {"batches": 0, "aligned": 0, "widened": 0, "bytes_wanted": 0, "bytes_read": 0}
        self._handles: dict[int, Any] = {}
        self._scratch: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last batch's copies out of the scratch buffer

    def _handle(self, k: int) -> Any:
        if k not in self._handles:
            self._handles[k] = self._kvikio.CuFile(self.arrays.files[k].path, "r")
        return self._handles[k]

    def _data_end(self, k: int) -> int:
        return self.arrays.files[k].end(self.arrays.record_nbytes)

    def _direct(self, r: Range, out_bytes: torch.Tensor) -> bool:
        whole = r.nbytes % PAGE == 0 or r.file_offset + r.nbytes == self._data_end(r.file_index)
        return r.file_offset % PAGE == 0 and (out_bytes.data_ptr() + r.out_offset) % PAGE == 0 and whole

    def _widen(self, r: Range) -> tuple[int, int]:
        lo = r.file_offset - r.file_offset % PAGE
        return lo, min(_page_ceil(r.file_offset + r.nbytes), self._data_end(r.file_index))

    def _scratch_pages(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A page-aligned uint8 buffer of ``nbytes`` on ``device``, reused across batches."""
        if self._copied is not None:
            self._copied.synchronize()  # the last batch's copies still read the old contents
            self._copied = None
        raw = self._scratch
        if raw is None or raw.device != device or raw.numel() < nbytes + PAGE:
            raw = self._scratch = torch.empty(nbytes + PAGE, dtype=torch.uint8, device=device)
        skip = -raw.data_ptr() % PAGE
        return raw[skip : skip + nbytes]

    def read_batch(self, indices: Sequence[int], out: torch.Tensor) -> torch.Tensor:
        """Read samples ``indices`` into ``out``, a contiguous device tensor ``(len(indices), *sample_shape)``.

        The reads are not stream-ordered: no queued kernel may still use ``out``. Returns ``out`` once the reads
        are done; the copies out of the scratch buffer are queued on the current stream.
        """
        want = (len(indices), *self.arrays.sample_shape)
        if out.dtype != self.arrays.dtype or tuple(out.shape) != want or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {self.arrays.dtype} tensor of shape {want}; "
                             f"got {out.dtype} {tuple(out.shape)}")
        out_bytes = out.view(-1).view(torch.uint8)
        ranges = self.arrays.ranges(indices)
        direct = [r for r in ranges if self._direct(r, out_bytes)]
        widened = [r for r in ranges if not self._direct(r, out_bytes)]
        reads = [(r.file_index, r.file_offset, out_bytes[r.out_offset : r.out_offset + r.nbytes]) for r in direct]
        copies = self._widened_reads(widened, out_bytes, reads) if widened else []
        self._read_all(reads)
        for target, source in copies:
            target.copy_(source)
        if copies and out.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._count(ranges, reads, len(direct))
        return out

    def _widened_reads(
        self, widened: list[Range], out_bytes: torch.Tensor, reads: list[tuple[int, int, torch.Tensor]],
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """Append the page-bounded reads of ``widened`` into scratch to ``reads``; return the copies to make."""
        spans = [self._widen(r) for r in widened]
        starts = list(itertools.accumulate((_page_ceil(hi - lo) for lo, hi in spans), initial=0))
        scratch = self._scratch_pages(starts[-1], out_bytes.device)
        copies = []
        for r, (lo, hi), at in zip(widened, spans, starts):
            reads.append((r.file_index, lo, scratch[at : at + hi - lo]))
            skip = at + r.file_offset - lo
            copies.append((out_bytes[r.out_offset : r.out_offset + r.nbytes], scratch[skip : skip + r.nbytes]))
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

    def _count(self, ranges: list[Range], reads: list[tuple[int, int, torch.Tensor]], direct: int) -> None:
        self.stats["batches"] += 1
        self.stats["aligned"] += direct
        self.stats["widened"] += len(ranges) - direct
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
