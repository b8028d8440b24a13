"""The ring: reusable shared-memory slots, owned by the main process, claimed by workers.

Tasks never wait for a slot. A worker takes a free slot from the ring's shared free
list (``control.py``) only when it has a batch to write, so the ring holds as many
slots as batches really exist at once (in flight, plus the ones the user holds), and
a worker stuck on a slow sample holds one slot, not the others' window. When no slot
is free, or the one claimed is too small, the worker writes into a segment of its own
making; the ring adopts that segment as a new slot (or as the larger replacement of
the small one). A slot is freed when the last tensor viewing it dies (its ``Lease``
is destroyed), or at once when its batch is not returned.

The ring belongs to the DataLoader, not to one epoch's iterator: the next epoch's
workers write into slots that are already allocated, touched, pinned and on the
right NUMA node. It is released when the loader is.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .._native import C
from . import segments
from .control import MAX_SLOTS, Control


class RingGrowthWarning(UserWarning):
    """The ring had to grow because returned batches are still referenced."""


class Slot:
    __slots__ = ("slot_id", "segment")

    def __init__(self, slot_id: int, segment):
        self.slot_id = slot_id
        self.segment = segment


_reclaimed = False


class Ring:
    """Slots, their shared free list, and growth.

    Args:
        quiet: slots a loop needs when it keeps no batch (tasks in flight, batches a
            device stage holds, and the two a ``for`` loop holds while it asks for the
            next); past that, batches are being kept, and the ring says so once.
        pin: register every segment the ring maps with CUDA (cudaHostRegister), once;
            the CUDA runtime must be loaded (``fastfeed._pinning.enable``).
        numa_node: the node the ring's memory belongs on (workers bind what they create).
    """

    def __init__(self, quiet: int, pin: bool = False, numa_node: int | None = None):
        global _reclaimed
        if not _reclaimed:
            # Once per process: segments of fastfeed processes that were killed
            # (and so never cleaned up) would otherwise fill /dev/shm for good.
            _reclaimed = True
            segments.reclaim()
        self.prefix = segments.new_prefix()
        # Unlinks the ring's names even if it is never closed cleanly.
        self._finalizer = weakref.finalize(self, segments.sweep, self.prefix)
        self.control = Control.create(self.prefix)
        self._slots: list[Slot] = []
        self.set_quiet(quiet)
        self.pin = pin
        self.numa_node = numa_node
        # Slots some tensor views. Leases discard from whichever thread drops the last
        # view; set.add and set.discard are atomic under the GIL, so no lock is needed.
        self._lent: set[int] = set()
        self._warned = False
        self.in_use = False  # an iterator's workers are writing into it

    def fits(self, pin: bool, numa_node: int | None) -> bool:
        """Whether an iterator with these needs can take this ring over."""
        return not self.in_use and (pin, numa_node) == (self.pin, self.numa_node) and self._finalizer.alive

    def receive(self, slot_id: int | None, made: str | None):
        """The memory a worker wrote a batch into: a ``Slot``, or a one-off segment.

        Args:
            slot_id: the slot it claimed, or None when none was free.
            made: the segment the worker created instead (none was free, or the one
                claimed was too small), or None.
        """
        if made is None:
            return self._slots[slot_id]
        # Mapped lazily: pages are mapped as they are read.
        seg = self.pinned(segments.attach(made, populate=False))
        if slot_id is not None:  # the claimed slot was too small: the new segment replaces it
            slot = self._slots[slot_id]
            segments.unlink(slot.segment.name)  # its mapping lives on while anything views it
            slot.segment = seg
        elif len(self._slots) < MAX_SLOTS:
            slot = Slot(len(self._slots), seg)
            self._slots.append(slot)
            self._warn_if_kept()
        else:
            segments.unlink(made)  # mapped now; the name is no longer needed
            return seg
        self.control.publish(slot.slot_id, seg.name, seg.size)
        return slot

    def set_quiet(self, quiet: int) -> None:
        """Set ``quiet`` (see the class) and where workers wait briefly for a slot rather than make one."""
        self.quiet = quiet
        # With one slot per batch in flight, a worker that finds none free waits briefly: the
        # loop is about to free the batch it holds, as torch's memory would. If it does not
        # (it holds its batch through a long step), one slot more, and no waiting after that.
        self.control.set_wait_at(quiet - 2)

    def _warn_if_kept(self) -> None:
        if len(self._slots) > self.quiet and not self._warned:
            self._warned = True
            warnings.warn(
                f"fastfeed's ring of batch slots is growing past the {self.quiet} slots this loader needs: "
                "earlier batches are still referenced (for example by list(loader)), so every new batch "
                "takes new memory. Drop references to old batches (or .clone() what you keep) to keep "
                "memory flat.",
                RingGrowthWarning,
                stacklevel=6,
            )

    def pinned(self, segment):
        """``segment``, registered with CUDA if this ring pins (a one-off segment too)."""
        if self.pin:
            segment.pin()
        return segment

    def segment(self, slot_id: int):
        """The segment of slot ``slot_id`` (what a worker thread writes into, mapped once)."""
        return self._slots[slot_id].segment

    def lend(self, memory) -> torch.Tensor:
        """A uint8 tensor over a slot (or one-off segment) from ``receive``; a slot is freed when it and all its views die."""
        if not isinstance(memory, Slot):
            return torch.frombuffer(memory, dtype=torch.uint8)
        slot_id, lent, control = memory.slot_id, self._lent, self.control
        lent.add(slot_id)

        def free():
            lent.discard(slot_id)
            control.release(slot_id)

        return torch.frombuffer(C.Lease(memory.segment, free), dtype=torch.uint8)

    def release(self, memory) -> None:
        """Return what ``receive`` gave when its batch is not handed out."""
        if isinstance(memory, Slot):
            self.control.release(memory.slot_id)

    def recover(self) -> None:
        """Settle what workers left unreported: call only once they are all gone.

        Slots they claimed go back on the free list, and segments they made whose
        message was never read are unlinked.
        """
        for slot in self._slots:
            if slot.slot_id not in self._lent and not self.control.is_free(slot.slot_id):
                self.control.release(slot.slot_id)
        segments.sweep(self.prefix, keep={self.control.name, *(slot.segment.name for slot in self._slots)})

    def close(self) -> None:
        """Unlink every name this ring or its workers created; live views stay valid."""
        self._finalizer()
        self._slots.clear()
