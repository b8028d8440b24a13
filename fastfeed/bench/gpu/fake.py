"""The GPU check's CUDA on the CPU: ``FakeCuda`` stands in for ``facade.Cuda`` in ``--dry-run``.

On a machine without a GPU every line of every check runs against it (a typo shows here, not on a GPU lent for
minutes):

- tensors stay on the CPU, and loaders are built with ``device="cpu"`` where the real check uses ``"cuda"``;
- a stream is a queue of work that runs on the host once the time it would have taken has passed: ``sleep``
  adds time, a copy costs its bytes at ``FAKE_GBPS``; events mark a point in a stream's queue;
- a ``non_blocking`` copy reads its source only when its turn comes, by address, as a DMA does: a slot that
  was rewritten in between shows as a wrong checksum (``reads_at_issue()`` turns that off);
- NVML's PCIe and utilisation readings are worked out from the same queues.

The fake's figures are the fake's: a dry run says so, and never passes a check on a GPU's behalf.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import os
import threading
import time

import torch

from ...transfer import map_tensors

FAKE_GBPS = 20.0  # the fake's copy rate: any figure will do, as long as copies take time
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)


class _FakeStream:
    """A queue of work done on the host once the device time before it has passed."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.free_at = 0.0  # perf_counter time at which everything queued so far is done
        self.queue: collections.deque = collections.deque()  # (due, fn), in due order

    def tail(self) -> float:
        return max(time.perf_counter(), self.free_at)

    def add(self, seconds: float, fn=None, nbytes: int = 0) -> None:
        begin = self.tail()
        self.free_at = begin + seconds
        self.fake._log(begin, self.free_at, nbytes)
        if fn is not None:
            self.queue.append((self.free_at, fn))
        self.run_due()

    def run_due(self) -> None:
        now = time.perf_counter()
        while self.queue and self.queue[0][0] <= now:
            self.queue.popleft()[1]()

    def finish(self, until: float | None = None) -> None:
        """Block the host until the work queued before ``until`` (default: all of it) is done."""
        delay = (self.free_at if until is None else until) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        self.run_due()

    def wait_event(self, event) -> None:
        self.free_at = max(self.free_at, event.at)

    def synchronize(self) -> None:
        self.finish()


class _FakeEvent:
    """A point in a fake stream's queue, with torch.cuda.Event's methods."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.stream: _FakeStream | None = None
        self.at = 0.0

    def record(self, stream: _FakeStream | None = None) -> None:
        self.stream = stream or self.fake.current_stream()
        self.at = self.stream.tail()

    def query(self) -> bool:
        if self.stream is not None:
            self.stream.run_due()
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.finish(self.at)

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.at - self.at) * 1e3


def _mapped(address: int, nbytes: int) -> bool:
    """Whether ``nbytes`` from ``address`` are all mapped (msync fails with ENOMEM over an unmapped page)."""
    page = address - address % _PAGE
    ms_async = 1
    ok = _libc.msync(ctypes.c_void_p(page), ctypes.c_size_t(address + nbytes - page), ms_async) == 0
    return ok or ctypes.get_errno() != errno.ENOMEM


class FakeCuda:
    """``Cuda``'s methods on the CPU, for ``--dry-run`` (see the module's docstring)."""

    dry_run = True
    index = 0
    device = torch.device("cpu")

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices  # two, so that the check of a second device runs too
        self.late_reads = True
        self.default = _FakeStream(self)
        self._current = self.default
        self._streams = [self.default]
        self._work: collections.deque = collections.deque(maxlen=100_000)  # (begin, end, bytes) for FakeNvml
        self._lock = threading.Lock()
        self.faults = 0  # late reads of memory that was no longer mapped

    def describe(self) -> str:
        return f"fake CUDA device on the CPU (dry run: {FAKE_GBPS:.0f} GB/s copies, sleeps in host time)"

    def device_count(self) -> int:
        return self.devices

    def loader_device(self, index: int | None = None) -> str:
        return "cpu"

    def uuid(self, index: int) -> str | int:
        return index

    def nvml(self) -> tuple[FakeNvml, str]:
        return FakeNvml(self), ""

    def _log(self, begin: float, end: float, nbytes: int) -> None:
        with self._lock:
            self._work.append((begin, end, nbytes))

    def window(self, seconds: float) -> tuple[float, float]:
        """Bytes copied per second and the busy share over the last ``seconds`` (what FakeNvml reports)."""
        now = time.perf_counter()
        lo = now - seconds
        nbytes = busy = 0.0
        with self._lock:
            work = list(self._work)
        for begin, end, n in work:
            overlap = max(0.0, min(end, now) - max(begin, lo))
            if overlap > 0:
                busy += overlap
                nbytes += n * overlap / max(end - begin, 1e-12)
        return nbytes / seconds, min(1.0, busy / seconds)

    def Event(self) -> _FakeEvent:
        return _FakeEvent(self)

    def Stream(self) -> _FakeStream:
        stream = _FakeStream(self)
        self._streams.append(stream)
        return stream

    @contextlib.contextmanager
    def stream(self, stream: _FakeStream):
        before, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = before

    def current_stream(self) -> _FakeStream:
        return self._current

    def synchronize(self) -> None:
        for stream in self._streams:
            stream.finish()

    def sleep(self, ms: float, stream: _FakeStream | None = None) -> None:
        (stream or self._current).add(ms / 1e3)

    def cycles_per_ms(self) -> float:
        return 1e6

    def to_device(self, data, non_blocking: bool = True):
        return map_tensors(data, lambda t: self._copy(t, non_blocking))

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copy(src, True, dst)

    def _copy(self, src: torch.Tensor, non_blocking: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        stream = self._current
        out = torch.empty(src.shape, dtype=src.dtype) if out is None else out
        seconds = src.nbytes / (FAKE_GBPS * 1e9)
        if not non_blocking:
            stream.finish()
            out.copy_(src)
            stream.add(seconds, nbytes=src.nbytes)
            stream.finish()
        elif self.late_reads and src.is_contiguous() and src.nbytes:
            # As a DMA: the source's address, not the tensor, so nothing keeps its memory (a ring slot) alive.
            address, nbytes = src.data_ptr(), src.nbytes
            stream.add(seconds, lambda: self._dma(out, address, nbytes), nbytes)
        else:
            out.copy_(src)
            stream.add(seconds, nbytes=src.nbytes)
        return out

    def _dma(self, out: torch.Tensor, address: int, nbytes: int) -> None:
        if _mapped(address, nbytes):
            ctypes.memmove(out.data_ptr(), address, nbytes)
        else:
            self.faults += 1  # a real DMA would read freed memory: leave the destination unwritten

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()

    def memory(self, index: int) -> tuple[int, int]:
        return 0, 0

    def copier(self, stage, make) -> FakeCopier:
        return FakeCopier(self, stage.transform)

    @contextlib.contextmanager
    def reads_at_issue(self):
        """Copies read their source when issued: for a check whose real guard (an event fastfeed records on the
        device's stream) cannot see the fake's streams."""
        before, self.late_reads = self.late_reads, False
        try:
            yield
        finally:
            self.late_reads = before


class FakeNvml:
    """NVML's readings, worked out from ``FakeCuda``'s queues."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake

    def count(self) -> int:
        return self.fake.devices

    def pcie_mbps(self, key, direction: str) -> float:
        time.sleep(0.02)  # NVML's window, which the real call blocks for
        return self.fake.window(0.02)[0] / 1e6 if direction == "rx" else 0.0

    def utilisation(self, key) -> float:
        return self.fake.window(0.1)[1]

    def compute_pids(self, key) -> set[int]:
        return set()


class FakeCopier:
    """``transfer.CudaCopier`` on a ``FakeCuda``: the device stage's copies on a fake side stream.

    The consumer's stream waits on the copy's event, and the host does not: a check reads what it was handed only
    after synchronizing, as host code reading device memory must.
    """

    def __init__(self, fake: FakeCuda, transform) -> None:
        self.fake = fake
        self.transform = transform
        self.stream = fake.Stream()

    def start(self, batch):
        with self.fake.stream(self.stream):
            begin = self.fake.Event()
            begin.record(self.stream)
            out = self.fake.to_device(batch, non_blocking=True)
            if self.transform is not None:
                self.stream.finish()  # the transform is host code: it needs the copied bytes
                out = self.transform(out)
            end = self.fake.Event()
            end.record(self.stream)
        return out, (begin, end)

    def done(self, event) -> bool:
        return event[1].query()

    def wait(self, event) -> None:
        event[1].synchronize()

    def hand_over(self, out, event) -> None:
        self.fake.current_stream().wait_event(event[1])

    def elapsed(self, event) -> float | None:
        return event[0].elapsed_time(event[1]) / 1e3
