"""The device stage: batches copied to the GPU on a side stream, ahead of the consumer.

Each batch from the ring is copied host-to-device with ``non_blocking=True`` on a
dedicated stream, an optional ``device_transform`` runs there too, and an event marks
the end. When the consumer takes the batch, its current stream waits on that event
(the host does not), and the device tensors are recorded on the consumer's stream so
the caching allocator does not hand their memory to the copy stream too early.

The CPU batch (views of a ring slot) is kept until the copy's event has completed:
only then may the slot go back to the ring and be rewritten.

``Copier`` is the whole contract with CUDA (streams and events), so the ordering
logic here can be tested on a CPU with a fake copier.
"""

from __future__ import annotations

import collections
import copy
import time
from typing import Any, Callable, NamedTuple, Protocol

import torch
from torch.autograd import profiler


def map_tensors(data, fn: Callable[[torch.Tensor], Any]):
    """``data`` with every tensor leaf replaced by ``fn(leaf)``; containers keep their types."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        items = {k: map_tensors(v, fn) for k, v in data.items()}
        if isinstance(data, collections.abc.MutableMapping):
            out = copy.copy(data)  # a mapping type may carry more than its items (as torch's pin_memory)
            out.update(items)
            return out
        return type(data)(items)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(map_tensors(v, fn) for v in data))
    if isinstance(data, tuple):
        return tuple(map_tensors(v, fn) for v in data)
    if isinstance(data, list):
        return [map_tensors(v, fn) for v in data]
    return data


def tensors(data) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(data, found.append)
    return found


class Copier(Protocol):
    """Streams and events, as the device stage needs them."""

    def start(self, batch) -> tuple[Any, Any]:
        """Issue the copy (and transform) of ``batch``; returns (device batch, event)."""

    def done(self, event) -> bool:
        """Whether the work before ``event`` has completed (never blocks)."""

    def wait(self, event) -> None:
        """Block the host until ``event`` has completed."""

    def hand_over(self, out, event) -> None:
        """Make the consumer's stream wait for ``event`` and own ``out``'s memory."""

    def elapsed(self, event) -> float | None:
        """Seconds the copy behind ``event`` took, once ``done(event)``; None when not timed."""


class CudaCopier:
    """Copies on a dedicated CUDA stream of ``device``."""

    def __init__(self, device: torch.device, transform: Callable | None):
        self.device = device
        self.transform = transform
        self.stream = torch.cuda.Stream(device)

    def start(self, batch):
        with torch.cuda.stream(self.stream):
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(self.stream)
            out = map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
            if self.transform is not None:
                out = self.transform(out)
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
        return out, (begin, end)

    def done(self, event) -> bool:
        return event[1].query()

    def wait(self, event) -> None:
        event[1].synchronize()

    def hand_over(self, out, event) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event[1])
        for t in tensors(out):
            if t.device.type == "cuda":
                t.record_stream(consumer)

    def elapsed(self, event) -> float | None:
        return event[0].elapsed_time(event[1]) / 1e3  # read only once done: it never waits


class CpuCopier:
    """``device="cpu"``: nothing to copy; the transform runs at once."""

    def __init__(self, transform: Callable | None):
        self.transform = transform

    def start(self, batch):
        return (batch if self.transform is None else self.transform(batch)), None

    def done(self, event) -> bool:
        return True

    def wait(self, event) -> None:
        pass

    def hand_over(self, out, event) -> None:
        pass

    def elapsed(self, event) -> float | None:
        return None


class DeviceIter:
    """Yields ``source``'s batches through ``copier``, with up to ``ahead`` more copies in flight.

    Args:
        source: the loader's iterator (CPU batches, views of ring slots).
        copier: a ``Copier``.
        ahead: batches copied beyond the one handed over, when they are ready (0: none).
        ready: whether ``source`` has its next batch without waiting; lookahead never waits
            for a worker, so it cannot delay the batch the consumer asked for.
        on_end: called once, after the last batch was handed over.
        stats: the source's ``stats.Recorder``: the consumer asks here, so waits and steps are
            timed here, and each copy's time is read once it completed.
    """

    def __init__(self, source, copier: Copier, ahead: int, ready: Callable[[], bool], on_end=None, stats=None):
        self.source = source
        self.stats = stats
        self.copier = copier
        self.ahead = ahead
        self.ready = ready
        self.on_end = on_end  # called once every batch was handed over (the source's shutdown)
        self._issued: collections.deque = collections.deque()  # (cpu batch, device batch, event)
        self._copying: collections.deque = collections.deque()  # (cpu batch, event), handed over
        self._exhausted = False

    @property
    def held_back(self) -> int:
        """Batches taken from ``source`` and not yet handed to the consumer."""
        return len(self._issued)

    def __iter__(self):
        return self

    def _issue(self) -> bool:
        try:
            cpu = next(self.source)
        except StopIteration:
            self._exhausted = True
            return False
        if profiler._is_profiler_enabled:  # torch's profiler (and HTA) see the copy as a range of its own
            with profiler.record_function("fastfeed::h2d"):
                out, event = self.copier.start(cpu)
        else:
            out, event = self.copier.start(cpu)
        self._issued.append((cpu, out, event))
        return True

    def _release_finished(self) -> None:
        # In order: a stream's events complete in the order they were recorded.
        while self._copying and self.copier.done(self._copying[0][1]):
            _, event = self._copying.popleft()  # the CPU batch dies here, and its slot goes back
            if self.stats is not None:
                self.stats.copied(self.copier.elapsed(event))

    def __next__(self):
        if profiler._is_profiler_enabled:  # named as torch names its iterators' waits, so tools find it
            with profiler.record_function("enumerate(DataLoader)#DeviceIter.__next__"):
                return self._timed_next()
        return self._timed_next()

    def _timed_next(self):
        rec = self.stats
        if rec is None:
            return self._next()
        ready = getattr(self.source, "_ready_count", None)
        ready = len(self._issued) + (ready() if ready is not None else 0)
        asked = time.perf_counter()
        out = self._next()
        rec.add(asked, ready, time.perf_counter())
        return out

    def _next(self):
        self._release_finished()
        if not self._issued and (self._exhausted or not self._issue()):
            self.close()
            if self.on_end is not None:
                on_end, self.on_end = self.on_end, None
                on_end()
            raise StopIteration
        while len(self._issued) <= self.ahead and not self._exhausted and self.ready():
            self._issue()
        cpu, out, event = self._issued.popleft()
        self.copier.hand_over(out, event)
        self._copying.append((cpu, event))
        return out

    def close(self) -> None:
        """Wait for every copy still reading a slot, then let the slots go."""
        for queue in (self._copying, self._issued):
            while queue:
                self.copier.wait(queue[0][-1])
                queue.popleft()

    def __del__(self) -> None:
        try:
            self.close()
        except RuntimeError:
            pass  # at interpreter exit CUDA may be gone already, and the slots with it


class Stage(NamedTuple):
    """What ``DataLoader(device=..., device_transform=..., device_prefetch=...)`` asked for."""

    device: torch.device
    transform: Callable | None
    ahead: int


def plan(device, transform, ahead) -> Stage | None:
    """Check the device arguments; None when there is no device stage.

    Raises:
        RuntimeError: a CUDA device on a machine (or torch build) without CUDA.
        ValueError, TypeError: arguments of the wrong kind or range.
    """
    if device is None:
        if transform is not None:
            raise ValueError("device_transform runs on the device: pass device= too (e.g. device='cuda')")
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device: {e}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device={str(device)!r}: fastfeed's device stage supports 'cuda' and 'cpu' devices")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU or driver was found"
            raise RuntimeError(
                f"DataLoader(device={str(device)!r}) needs CUDA, and torch.cuda.is_available() is False "
                f"({why}; torch {torch.__version__}). Use device='cpu', or leave device unset."
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if transform is not None and not callable(transform):
        raise TypeError(f"device_transform must be callable (batch -> batch), got {type(transform).__name__}")
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
        raise ValueError(f"device_prefetch must be an int >= 0 (batches copied ahead), got {ahead!r}")
    return Stage(device, transform, ahead)


def copier_for(stage: Stage) -> Copier:
    if stage.device.type == "cuda":
        return CudaCopier(stage.device, stage.transform)
    return CpuCopier(stage.transform)
