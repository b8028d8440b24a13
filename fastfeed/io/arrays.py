"""Fixed-size records in raw or ``.npy`` files as a map-style dataset, read with ``pread``.

Token files for LLM pretraining and precomputed features are arrays of fixed-size records: sample ``i``
lives at a known byte offset, so a read needs no index, no decoder and no memory map. ``pread`` keeps
no file position, so one descriptor serves every thread; and a batch can be read straight into a
preallocated (pinned) tensor with no intermediate copy (``read_into``), which is how it lands in a ring
slot. The dataset holds no iteration state, so shuffling, ``DistributedSampler`` and
``DataLoader.state_dict()`` work as for any map-style dataset. ``locate`` and ``ranges`` expose the
byte layout for readers that bypass the host (``fastfeed.io.gds``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import threading
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence, Union

import numpy as np
import torch
from numpy.lib import format as npy_format
from torch.utils.data import Dataset

PathLike = Union[str, "os.PathLike[str]"]


class Range(NamedTuple):
    """``nbytes`` bytes at ``file_offset`` in file ``file_index``, destined for byte ``out_offset`` of a batch."""

    file_index: int
    file_offset: int
    out_offset: int
    nbytes: int


@dataclass(frozen=True)
class _File:
    path: str
    offset: int  # where the records start (after a .npy header)
    records: int

    def end(self, record_nbytes: int) -> int:
        return self.offset + self.records * record_nbytes


_open_lock = threading.Lock()


def _renew_open_lock() -> None:
    # A fork while another thread holds the lock would leave it held forever in the child.
    global _open_lock
    _open_lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_open_lock)


def _torch_dtype(dtype: np.dtype | torch.dtype | str | type) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    np_dtype = np.dtype(dtype)
    if np_dtype.subdtype is not None:  # np.empty would turn it into its base dtype with extra dimensions
        raise ValueError(f"dtype {np_dtype} is a subarray dtype: give its base dtype, and its shape in shape")
    try:
        return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype
    except (TypeError, ValueError) as e:
        raise ValueError(f"dtype {np_dtype} has no torch equivalent: {e}") from None


def _as_paths(files: PathLike | Iterable[PathLike]) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        return [os.fspath(files)]
    paths = [os.fspath(f) for f in files]
    if not paths:
        raise ValueError("ArrayFiles needs at least one file")
    return paths


def _scan_raw(path: str, record_nbytes: int) -> _File:
    size = os.stat(path).st_size
    if size % record_nbytes:
        raise ValueError(
            f"{path}: its size, {size} bytes, is not a multiple of the record size ({record_nbytes} bytes)"
        )
    return _File(path, 0, size // record_nbytes)


def _read_npy_header(path: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran_order, dtype, data offset) from a ``.npy`` file's header."""
    with open(path, "rb") as f:
        try:
            version = npy_format.read_magic(f)
            if version == (1, 0):
                shape, fortran_order, dtype = npy_format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran_order, dtype = npy_format.read_array_header_2_0(f)
            else:
                raise ValueError(f"format version {version} is not supported (1.0 and 2.0 are)")
        except ValueError as e:
            raise ValueError(f"{path}: not a readable .npy file: {e}") from None
        return shape, fortran_order, dtype, f.tell()


def _scan_npy(path: str, dtype: torch.dtype, shape: tuple[int, ...], record_nbytes: int) -> _File:
    file_shape, fortran_order, file_dtype, offset = _read_npy_header(path)
    if fortran_order:
        raise ValueError(f"{path}: the array is in Fortran order; records must be C-contiguous")
    try:
        matches = _torch_dtype(file_dtype) == dtype
    except ValueError:
        matches = False
    if not matches:
        raise ValueError(f"{path}: the array's dtype is {file_dtype}, expected {dtype}")
    if len(file_shape) != len(shape) + 1 or tuple(file_shape[1:]) != shape:
        expected = f"(N, {', '.join(map(str, shape))})" if shape else "(N,)"
        raise ValueError(f"{path}: the array's shape is {file_shape}, expected {expected}")
    data = _File(path, offset, file_shape[0])
    size = os.stat(path).st_size
    if size < data.end(record_nbytes):
        raise OSError(
            f"{path}: truncated: its header says {data.records} records of {record_nbytes} bytes from offset "
            f"{offset} ({data.end(record_nbytes)} bytes in all), but the file is {size} bytes"
        )
    return data


class ArrayFiles(Dataset):
    """Fixed-size records across one or more raw binary or ``.npy`` files, concatenated in order.

    Args:
        files: a path or a list of paths. A ``.npy`` file's header gives its data offset, dtype and
            shape (checked against ``dtype`` and ``(N, *shape)``); any other file is raw records back to back.
        dtype: a numpy or torch dtype.
        shape: the shape of one record (``()`` for scalars such as tokens).
        window: if set, sample ``i`` is the ``window`` consecutive records starting at record ``i``
            (shape ``(window, *shape)``), and may span files; ``len`` is ``records - window + 1``.

    File descriptors open on first read, one per file and process (reopened after a fork, dropped
    when pickled); ``close()`` or garbage collection closes them.
    """

    def __init__(
        self, files: PathLike | Iterable[PathLike], dtype: np.dtype | torch.dtype | str | type,
        shape: Sequence[int], *, window: int | None = None,
    ):  # fmt: skip
        self.dtype = _torch_dtype(dtype)
        self.record_shape = tuple(int(n) for n in shape)
        self.record_nbytes = math.prod(self.record_shape) * self.dtype.itemsize
        if self.record_nbytes == 0:
            raise ValueError(f"a record of shape {self.record_shape} holds no bytes")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        self.window = window
        self.files = [self._scan(path) for path in _as_paths(files)]
        self._starts = list(itertools.accumulate((f.records for f in self.files[:-1]), initial=0))
        self.records = sum(f.records for f in self.files)
        self.sample_shape = self.record_shape if window is None else (window, *self.record_shape)
        self.sample_nbytes = self.record_nbytes * (window or 1)
        self._pid: int | None = None
        self._fds: list[int | None] = []

    def _scan(self, path: str) -> _File:
        if path.lower().endswith(".npy"):
            return _scan_npy(path, self.dtype, self.record_shape, self.record_nbytes)
        return _scan_raw(path, self.record_nbytes)

    def __len__(self) -> int:
        return max(0, self.records - (self.window or 1) + 1)

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return (f"ArrayFiles({len(self.files)} file(s), {self.records} records of {self.dtype} "
                f"{self.record_shape}{window})")

    def __getitem__(self, index: int) -> torch.Tensor:
        out = torch.empty((1, *self.sample_shape), dtype=self.dtype)
        self.read_into([index], out)
        return out[0]

    def _index(self, index: int) -> int:
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} is out of range for {n} samples")
        return i

    def locate(self, index: int) -> list[tuple[int, int, int]]:
        """The ``(file_index, byte_offset, nbytes)`` ranges that sample ``index`` occupies, in order."""
        record, count = self._index(index), self.window or 1
        k = bisect.bisect_right(self._starts, record) - 1
        found = []
        while count:
            f = self.files[k]
            first = record - self._starts[k]
            take = min(count, f.records - first)
            if take > 0:  # an empty file in a window's way holds nothing
                found.append((k, f.offset + first * self.record_nbytes, take * self.record_nbytes))
            record, count, k = record + take, count - take, k + 1
        return found

    def ranges(self, indices: Sequence[int]) -> list[Range]:
        """The reads filling a batch of ``indices`` packed in order, a piece that continues the last one merged."""
        merged: list[Range] = []
        out_offset = 0
        for index in indices:
            for k, file_offset, nbytes in self.locate(index):
                last = merged[-1] if merged else None
                if last and last.file_index == k and last.file_offset + last.nbytes == file_offset:
                    merged[-1] = last._replace(nbytes=last.nbytes + nbytes)
                else:
                    merged.append(Range(k, file_offset, out_offset, nbytes))
                out_offset += nbytes
        return merged

    def read_into(self, indices: Sequence[int], out: torch.Tensor) -> torch.Tensor:
        """Read samples ``indices`` into ``out``, a contiguous CPU tensor of shape ``(len(indices), *sample_shape)``.

        The reads land in ``out``'s memory directly (``preadv``); returns ``out``.
        """
        self._check_out(len(indices), out)
        memory = memoryview(out.view(-1).view(torch.uint8).numpy())
        for r in self.ranges(indices):
            self._pread_into(r.file_index, r.file_offset, memory[r.out_offset : r.out_offset + r.nbytes])
        return out

    def _check_out(self, n: int, out: torch.Tensor) -> None:
        want = (n, *self.sample_shape)
        if out.device.type != "cpu" or out.dtype != self.dtype or tuple(out.shape) != want \
                or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous CPU tensor of dtype {self.dtype} and shape {want}; got "
                f"{out.dtype} {tuple(out.shape)} on {out.device}{'' if out.is_contiguous() else ', not contiguous'}"
            )

    def _pread_into(self, k: int, offset: int, memory: memoryview) -> None:
        fd = self._fd(k)
        done = 0
        while done < len(memory):
            n = os.preadv(fd, [memory[done:]], offset + done)
            if n == 0:
                raise OSError(
                    f"{self.files[k].path}: short read at offset {offset}: wanted {len(memory)} bytes, got "
                    f"{done}; the file is now {os.fstat(fd).st_size} bytes (truncated since it was opened?)"
                )
            done += n

    def _fd(self, k: int) -> int:
        if self._pid == os.getpid() and self._fds[k] is not None:
            return self._fds[k]
        with _open_lock:
            if self._pid != os.getpid():
                # After a fork the parent's descriptors are left alone: closing them here could
                # close a number the child has since reused.
                self._pid, self._fds = os.getpid(), [None] * len(self.files)
            if self._fds[k] is None:
                self._fds[k] = os.open(self.files[k].path, os.O_RDONLY)
            return self._fds[k]

    def close(self) -> None:
        """Close the descriptors this process opened; a later read reopens them."""
        with _open_lock:
            self._close_fds()

    def _close_fds(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds:
                if fd is not None:
                    os.close(fd)
        self._pid, self._fds = None, []

    def __enter__(self) -> ArrayFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Without the lock: no other thread can reach a collected object, and the collector may run
        # while this thread holds the lock.
        if getattr(self, "_pid", None) == os.getpid():
            self._close_fds()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_pid=None, _fds=[])
        return state
