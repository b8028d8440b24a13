"""When a pinned slot may be rewritten: only after the copies queued from it have run.

With ``pin_memory=True`` and no device stage, the user copies from the slot, typically with
``x = batch.cuda(non_blocking=True)``. The copy is queued on the current stream, often behind the
last step's kernels, and the CPU batch dies right after, long before the DMA reads it. torch's
pinned allocator guards its own blocks with an event per copy (``CachingHostAllocator_recordEvent``)
but ignores memory it did not allocate, so the ring guards its slots itself: when the last view of
a pinned slot dies, an event is recorded on the target device's current stream, and the slot goes
back to the free list only once that event has completed. The ring polls at each ``next()`` and
never waits in the loop; a worker that finds no slot free makes a new one meanwhile.

A copy queued on another stream is not covered: whoever copies there must keep the CPU batch
alive until that stream's copy has completed (or use ``device=``, whose stage does).

``fence_for`` is the whole contract with CUDA here, so the ring's logic can be tested on a CPU
with a fake whose events complete only when the test says so.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Fence(Protocol):
    """Events on the stream that copies from slots."""

    def record(self) -> Any:
        """Record an event after the work queued so far; returns it."""

    def done(self, event) -> bool:
        """Whether that work has completed (never blocks)."""

    def wait(self, event) -> None:
        """Block until it has."""


class CudaFence:
    """Events on ``device``'s current stream, as of the moment a slot's last view dies."""

    def __init__(self, device: int):
        self.device = device

    def record(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def done(self, event) -> bool:
        return event.query()

    def wait(self, event) -> None:
        event.synchronize()


def fence_for(device: int) -> Fence | None:
    """The fence for slots headed to CUDA ``device``; None without CUDA, where nothing copies asynchronously."""
    if not torch.cuda.is_available():
        return None
    return CudaFence(device if device >= 0 else torch.cuda.current_device())
