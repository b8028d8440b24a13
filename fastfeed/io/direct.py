"""``DataLoader(ArrayFiles(...), device="cuda", reader="gds")``: batches read from disk straight into device memory
by a reader thread, ahead of the training loop, with no worker and no host copy.

The loader runs torch's single-process iterator (sampler, ``state_dict``, stats as with ``num_workers=0``): indices
are drawn in the loop's thread, in order, and handed to one reader thread per epoch, which reads each batch with
kvikio into a buffer of a small pool, runs ``device_transform`` on it and records an event. ``next()`` makes the
consumer's stream wait for that event (the host does not), so the reads of the next ``device_prefetch`` batches
overlap the step. A batch counts as yielded only once handed over, so ``state_dict()`` is exact.

Why a thread: kvikio's ``pread`` is not stream-ordered. It synchronises the default stream first, and a read in
compatibility mode is ordered on it; in the loop's thread every read would wait for the step's queued kernels,
and the step for the read.

Why a pool, and not ``torch.empty`` per batch: cuFile writes memory at once, outside any stream order, and the
caching allocator may hand out memory whose last kernels are still queued. A pool buffer is rewritten only once
its batch has died (every view of it) and an event recorded then, on the stream of the thread that dropped it,
has completed, after the read stream's own work on it.

``Device`` is the whole contract with CUDA here (streams, events, memory), so the ordering can be tested on a
CPU with a fake whose events complete only when the test says so.
"""

from __future__ import annotations

import collections
import contextlib
import math
import queue
import threading
import time
from typing import Any, Callable, ContextManager, Protocol

import numpy as np
import torch

from .. import transfer
from .._single import SingleProcessIter
from .gds import PAGE, GdsReader, Scratch, aligned_pages

STOP_TIMEOUT_S = 60.0  # a reader still in a read after this long is left to finish on its own (a daemon)


class Device(Protocol):
    """Streams, events and memory, as the GDS read-ahead needs them."""

    def reading(self) -> ContextManager:
        """Make the read stream current in the calling (reader) thread."""

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` on the device that no queued work uses (a read may write it at once)."""

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Queue ``target.copy_(source)`` on the current stream."""

    def run(self, fn: Callable, batch) -> Any:
        """``fn(batch)`` on the read stream, after the work queued there for ``batch`` (the transform)."""

    def record(self) -> Any:
        """An event on the read stream, after everything queued on it so far."""

    def consumed(self) -> Any:
        """An event on the calling thread's current stream of the device (where a batch's last view died)."""

    def wait(self, event) -> None:
        """Block the calling thread until ``event`` has completed (None: at once)."""

    def hand_over(self, out, event, memory: torch.Tensor) -> None:
        """Make the consumer's stream wait for ``event``; ``out`` and ``memory`` are now used on it too."""

    def lend(self, memory: torch.Tensor, on_free: Callable[[], None]) -> torch.Tensor:
        """A uint8 tensor over ``memory``; ``on_free()`` is called once it and every view of it have died."""


class _Lease:
    """What a lent tensor's storage holds: the pool buffer (kept alive) and what to call when it is let go."""

    def __init__(self, memory: torch.Tensor, on_free: Callable[[], None], cuda: bool):
        self.memory, self.on_free = memory, on_free
        interface = {"shape": (memory.numel(),), "typestr": "|u1", "data": (memory.data_ptr(), False),
                     "version": 2 if cuda else 3}  # fmt: skip
        if cuda:
            self.__cuda_array_interface__ = interface  # no "stream": the hand-over orders the consumer
        else:
            self.__array_interface__ = interface

    def __del__(self) -> None:
        on_free, self.on_free = self.on_free, None
        if on_free is not None:
            on_free()


class CudaDevice:
    """Reads into memory of ``device``; copies and the transform run on a dedicated stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def reading(self) -> ContextManager:
        return torch.cuda.stream(self.stream)

    def alloc(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            memory = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        # The allocator hands this stream memory that work queued on it may still use; cuFile writes at once.
        self.stream.synchronize()
        return memory

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        target.copy_(source, non_blocking=True)

    def run(self, fn: Callable, batch) -> Any:
        return fn(batch)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def consumed(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event) -> None:
        if event is not None:
            event.synchronize()

    def hand_over(self, out, event, memory: torch.Tensor) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        # The allocator then keeps the pool buffer (and a transform's outputs) from other streams until the
        # consumer's work on them is done, even once the pool is gone.
        for t in [memory, *transfer.tensors(out)]:
            if t.device.type == "cuda":
                t.record_stream(consumer)

    def lend(self, memory: torch.Tensor, on_free: Callable[[], None]) -> torch.Tensor:
        return torch.as_tensor(_Lease(memory, on_free, cuda=True), device=self.device)


class HostDevice:
    """Reads into host memory (kvikio reads host buffers too): nothing is queued, every event is complete."""

    def reading(self) -> ContextManager:
        return contextlib.nullcontext()

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        target.copy_(source)

    def run(self, fn: Callable, batch) -> Any:
        return fn(batch)

    def record(self) -> Any:
        return None

    def consumed(self) -> Any:
        return None

    def wait(self, event) -> None:
        pass

    def hand_over(self, out, event, memory: torch.Tensor) -> None:
        pass

    def lend(self, memory: torch.Tensor, on_free: Callable[[], None]) -> torch.Tensor:
        return torch.from_numpy(np.asarray(_Lease(memory, on_free, cuda=False)))


def device_for(device: torch.device) -> Device:
    return CudaDevice(device) if device.type == "cuda" else HostDevice()


class _Slot:
    """A pool buffer and its scratch, and the events to wait for before either is written again."""

    def __init__(self, device: Device):
        self.memory: torch.Tensor | None = None  # uint8, page-aligned
        self._raw: torch.Tensor | None = None
        self.scratch = Scratch(device.alloc)
        self.read: Any = None  # recorded on the read stream after this buffer's last batch's copies and transform
        self.consumed: Any = None  # recorded where that batch's last view died

    def pages(self, nbytes: int, device: Device) -> torch.Tensor:
        if self._raw is None or self._raw.numel() < nbytes + PAGE:
            self.memory = self._raw = None
            self._raw = device.alloc(nbytes + PAGE)
        self.memory = aligned_pages(self._raw, nbytes)
        return self.memory


class _Read:
    """A batch read: the batch (or the error its read raised), the read's event, its buffer."""

    __slots__ = ("batch", "error", "event", "memory")

    def __init__(self, batch=None, error: BaseException | None = None, event=None, memory=None):
        self.batch, self.error, self.event, self.memory = batch, error, event, memory


class ReadAhead:
    """Reads batches in a reader thread, up to ``ahead`` beyond the one being handed over.

    Indices are drawn by the caller's ``next_index`` in the caller's thread, only as a buffer is there to read
    them into, so the sampler's order and its RNG draws stay torch's. The pool grows to ``ahead + 2`` buffers
    (the batch you hold, the one handed over, those read ahead), and past that only when the batch asked for
    has no buffer because earlier batches are still held: holding batches takes memory, it never deadlocks.

    Args:
        reader: the ``GdsReader``.
        device: a ``Device``.
        ahead: batches read beyond the one handed over (``device_prefetch``).
        transform: ``device_transform``, or None.
        auto_collation: False: each index is one sample, handed over without the batch dimension.
    """

    def __init__(self, reader: GdsReader, device: Device, ahead: int, transform: Callable | None,
                 auto_collation: bool) -> None:  # fmt: skip
        self.reader, self.device, self.ahead = reader, device, ahead
        self.transform, self.auto_collation = transform, auto_collation
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (slot, index), None to stop
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # _Read, in order
        # Slots whose batch died: put from the lease's finalizer, in whatever thread (SimpleQueue.put is reentrant).
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._spare: collections.deque = collections.deque()  # oldest freed first: its event is likeliest done
        self._slots = 0
        self._in_flight = 0
        self._exhausted = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.read_wait_s = 0.0  # the consumer's time waiting for reads

    @property
    def slots(self) -> int:
        """Buffers in the pool."""
        return self._slots

    def ready(self) -> int:
        """Batches read and not yet handed over."""
        return self._done.qsize()

    def next(self, next_index: Callable[[], Any]):
        """The next batch, handed over to the caller's stream; StopIteration once ``next_index`` has no more."""
        if self._thread is None:
            self._start()
        while True:
            try:
                self._spare.append(self._free.get_nowait())
            except queue.Empty:
                break
        if not self._in_flight and not self._submit(next_index, grow=True):
            self.stop()
            raise StopIteration
        while self._in_flight <= self.ahead and self._submit(next_index, grow=self._slots < self.ahead + 2):
            pass
        asked = time.perf_counter()
        read = self._result()
        self.read_wait_s += time.perf_counter() - asked
        self._in_flight -= 1
        if read.error is not None:
            error, read.error = read.error, None
            raise error
        batch, read.batch = read.batch, None
        self.device.hand_over(batch, read.event, read.memory)
        return batch

    def _submit(self, next_index: Callable[[], Any], grow: bool) -> bool:
        if self._exhausted:
            return False
        if not self._spare and not grow:
            return False
        try:
            index = next_index()
        except StopIteration:
            self._exhausted = True
            return False
        if self._spare:
            slot = self._spare.popleft()
        else:
            slot = _Slot(self.device)
            self._slots += 1
        self._jobs.put((slot, index))
        self._in_flight += 1
        return True

    def _result(self) -> _Read:
        while True:
            try:
                return self._done.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():  # it never dies with a job pending; say so rather than hang
                    raise RuntimeError("fastfeed's GDS reader thread is gone with a batch still to read") from None

    def _start(self) -> None:
        jobs, done, stopping = self._jobs, self._done, self._stopping
        read = self._read  # a bound method of this object, not of the iterator: dropping the iterator stops it
        self._thread = threading.Thread(target=_run, args=(jobs, done, stopping, read, self.device, self.reader),
                                        name="fastfeed-gds-reader", daemon=True)  # fmt: skip
        self._thread.start()

    def _read(self, slot: _Slot, index) -> _Read:
        device = self.device
        device.wait(slot.read)  # this buffer's last copies and transform
        device.wait(slot.consumed)  # and the last batch read into it, wherever it was used
        slot.read = slot.consumed = None
        indices = list(index) if self.auto_collation else [index]
        shape = (len(indices), *self.reader.arrays.sample_shape)
        dtype = self.reader.arrays.dtype
        memory = slot.pages(dtype.itemsize * math.prod(shape), device)
        try:
            self.reader.read_batch(indices, memory.view(dtype).view(shape), slot.scratch, device.copy)
        except BaseException as e:
            slot.read = device.record()
            self._free.put(slot)
            return _Read(error=e)
        free = self._free

        def on_free() -> None:
            try:
                slot.consumed = device.consumed()
            except Exception:  # at interpreter exit CUDA may be gone; nothing reads the pool then
                slot.consumed = None
            free.put(slot)

        batch = device.lend(memory, on_free).view(dtype).view(shape)
        if not self.auto_collation:
            batch = batch[0]
        try:
            if self.transform is not None:
                batch = device.run(self.transform, batch)
        except BaseException as e:
            del batch  # its buffer goes back once the transform's queued work is done
            slot.read = device.record()
            return _Read(error=e)
        slot.read = event = device.record()
        return _Read(batch, None, event, slot.memory)

    def stop(self) -> None:
        """Stop and join the reader thread; batches read and not handed over are dropped."""
        thread = self._thread
        if thread is None or self._stopping.is_set():
            return
        self._stopping.set()
        self._jobs.put(None)
        if thread is not threading.current_thread():
            thread.join(STOP_TIMEOUT_S)
        while True:
            try:
                self._done.get_nowait()
            except queue.Empty:
                break


def _run(jobs: queue.SimpleQueue, done: queue.SimpleQueue, stopping: threading.Event, read, device: Device,
         reader: GdsReader) -> None:  # fmt: skip
    """The reader thread: each job read in order, until told to stop; then its files are closed."""
    try:
        with device.reading():
            while True:
                job = jobs.get()
                if job is None or stopping.is_set():
                    break
                done.put(read(*job))
    finally:
        reader.close()


class GdsIter(SingleProcessIter):
    """torch's single-process iterator, its batches read ahead by a ``ReadAhead`` (see the module).

    Args:
        loader: the DataLoader.
        resume: the state to resume from, or None.
        device: a ``Device`` over the loader's device.
        ahead: ``device_prefetch``.
        transform: ``device_transform``.
        threads: kvikio's thread pool size (the rank's CPUs), or None.
    """

    def __init__(self, loader, resume, device: Device, ahead: int, transform: Callable | None,
                 threads: int | None = None) -> None:  # fmt: skip
        super().__init__(loader, resume)
        self._read_ahead = ReadAhead(GdsReader(loader.dataset, threads), device, ahead, transform,
                                     self._auto_collation)  # fmt: skip

    def _next_data(self):
        rec = self._stats
        asked = time.perf_counter()
        ready = self._read_ahead.ready()
        try:
            data = self._read_ahead.next(self._next_index)
        except StopIteration:
            self._finished = True
            raise
        if rec is not None:
            rec.add(asked, ready, time.perf_counter())
        self._log_dataset()
        return data

    def gds_stats(self) -> dict:
        """What this epoch's reads were: kvikio's mode, threshold and threads, the reads by kind, the pool, and the
        time ``next()`` waited for reads."""
        ahead = self._read_ahead
        reader = ahead.reader
        return {"compat_mode": reader.compat_mode, "gds_threshold": reader.gds_threshold, "threads": reader.threads,
                **reader.stats, "pool": ahead.slots, "read_wait_s": ahead.read_wait_s}  # fmt: skip

    def close(self) -> None:
        """Stop the reader thread and close the files (the end of the epoch does so too)."""
        self._read_ahead.stop()

    def __del__(self) -> None:
        read_ahead = getattr(self, "_read_ahead", None)
        if read_ahead is not None:
            read_ahead.stop()
