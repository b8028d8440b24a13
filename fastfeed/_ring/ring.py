"""The ring: a pool of reusable shared-memory slots owned by the main process.

A slot is lent to one task at a time, and a task is only sent when a slot is
free, so the free slots are the prefetch window. The slot comes back when the
last tensor viewing it dies (its ``Lease`` is destroyed), or at once when the
task did not use it. Until the first batch is seen, tasks go out without a
slot and each worker writes into a segment of its own making; those segments
become the first slots (so starting costs no extra memory or first touch).
A batch that outgrew its slot goes to such a one-off segment too, and later
slots grow.
"""

from __future__ import annotations

import collections
import warnings
import weakref

import torch

from .._native import C
from .._workers.messages import SlotRef
from . import segments


class RingGrowthWarning(UserWarning):
    """The ring had to grow because returned batches are still referenced."""


class Slot:
    __slots__ = ("slot_id", "segment")

    def __init__(self, slot_id: int, segment):
        self.slot_id = slot_id
        self.segment = segment

    def ref(self) -> SlotRef:
        return SlotRef(self.slot_id, self.segment.name, self.segment.size)


_reclaimed = False


class Ring:
    """Slots, their free list, and growth.

    Args:
        capacity: slots to keep before growing (the caller sizes it from the
            prefetch window).
        pin: register every segment the ring maps with CUDA (cudaHostRegister), once;
            the CUDA runtime must be loaded (``fastfeed._pinning.enable``).
        numa_node: bind the ring's memory to this node before it is first touched.
    """

    def __init__(self, capacity: int, pin: bool = False, numa_node: int | None = None):
        global _reclaimed
        if not _reclaimed:
            # Once per process: segments of fastfeed processes that were killed
            # (and so never cleaned up) would otherwise fill /dev/shm for good.
            _reclaimed = True
            segments.reclaim()
        self.prefix = segments.new_prefix()
        self.capacity = capacity
        self.pin = pin
        self.numa_node = numa_node
        # A training loop holds the previous batch while it asks for the next,
        # which may take one slot beyond the window; past that, batches are
        # being kept.
        self._quiet_capacity = capacity + 1
        self.slot_size = 0  # unknown until the first batch arrives
        # Tasks sent without a slot whose segments may still be adopted: they
        # count against capacity so the ring never holds more than the window.
        self.pending = 0
        self._slots: list[Slot] = []
        # Leases append from whichever thread drops the last view; deque.append
        # and popleft are atomic, so no lock is needed.
        self._free: collections.deque[Slot] = collections.deque()
        self._warned = False
        # Unlinks the ring's names even if it is never closed cleanly.
        self._finalizer = weakref.finalize(self, segments.sweep, self.prefix)

    @property
    def sized(self) -> bool:
        return self.slot_size > 0

    def note_batch(self, nbytes: int) -> None:
        """Size slots from the batches seen so far."""
        if self.slot_size == 0:
            # Most workloads have fixed-shape batches: exact slots cost no memory
            # beyond torch's own per-batch segments.
            self.slot_size = segments.pages(nbytes)
        elif nbytes > self.slot_size:
            # Sizes vary: leave 25% headroom so growth happens a few times, not
            # every few batches.
            self.slot_size = segments.pages(nbytes + nbytes // 4)

    def acquire(self) -> Slot | None:
        """A free slot of the current size, or None when all are lent out (or none is sized yet)."""
        if not self.sized:
            return None
        if self._free:
            slot = self._free.popleft()
            if slot.segment.size < self.slot_size:
                self._regrow(slot)
            return slot
        if len(self._slots) + self.pending < self.capacity:
            slot = Slot(len(self._slots), self.pinned(self._create()))
            self._slots.append(slot)
            return slot
        return None

    def adopt(self, segment) -> Slot | None:
        """Keep a worker-made segment as a slot, if the ring has room and it is big enough."""
        if len(self._slots) >= self.capacity or segment.size < self.slot_size:
            return None
        slot = Slot(len(self._slots), self.pinned(segment))
        self._slots.append(slot)
        return slot

    def _create(self):
        return segments.create(self.prefix, self.slot_size, self.numa_node)

    def pinned(self, segment):
        """``segment``, registered with CUDA if this ring pins (a one-off segment too)."""
        if self.pin:
            segment.pin()
        return segment

    def segment(self, ref: SlotRef):
        """The segment lent as ``ref`` (what a worker thread writes into, unmapped twice)."""
        return self._slots[ref.slot_id].segment

    def _regrow(self, slot: Slot) -> None:
        # The old mapping stays alive for as long as anything still views it;
        # the worker swaps its own mapping when it sees the new name.
        segments.unlink(slot.segment.name)
        slot.segment = self.pinned(self._create())

    def grow(self) -> None:
        """Make room for one more slot because every slot is held by batches the user kept."""
        self.capacity += 1
        if self.capacity > self._quiet_capacity and not self._warned:
            self._warned = True
            warnings.warn(
                f"fastfeed's ring of batch slots is full: all {self.capacity - 1} slots are "
                "held by batches that are still referenced (for example by list(loader)), so "
                "the ring grows by one slot per extra batch. Drop references to old batches "
                "(or .clone() what you keep) to keep memory flat.",
                RingGrowthWarning,
                stacklevel=5,
            )

    def release(self, slot: Slot | None) -> None:
        """Return a slot that no batch views (its task did not use it)."""
        if slot is not None:
            self._free.append(slot)

    def lend(self, slot: Slot) -> torch.Tensor:
        """A uint8 tensor over the whole slot; the slot is freed when it and all its views die."""
        lease = C.Lease(slot.segment, lambda free=self._free, s=slot: free.append(s))
        return torch.frombuffer(lease, dtype=torch.uint8)

    def close(self) -> None:
        """Unlink every name this ring or its workers created; live views stay valid."""
        self._finalizer()
        self._free.clear()
        self._slots.clear()
