"""The ring: reusable shared-memory slots, owned by the main process, claimed by workers.

Tasks never wait for a slot. A worker takes a free slot from the ring's shared free
list (``control.py``) only when it has a batch to write, so the ring holds as many
slots as batches really exist at once (in flight, plus the ones the user holds), and
a worker stuck on a slow sample holds one slot, not the others' window. When no slot
is free, or the one claimed is too small, the worker writes into a segment of its own
making; the ring adopts that segment as a new slot (or as the larger replacement of
the small one). A slot is freed when the last tensor viewing it dies (its ``Lease``
is destroyed), or at once when its batch is not returned. A pinned slot is freed only once
the copies queued from it have run (``fence.py``).

Pinned rings register each segment once, in a thread of the main process under the target
device (``pinner.py``), never in the loop's thread. One-off segments (past ``MAX_SLOTS``) are
never registered: their batch is copied once, like torch's, which costs less than registering.

The ring belongs to the DataLoader, not to one epoch's iterator: the next epoch's
workers write into slots that are already allocated, touched, pinned and on the
right NUMA node. It is released when the loader is.
"""

from __future__ import annotations

import collections
import os
import warnings
import weakref

import torch

from .._native import C
from . import pinner, segments
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
        pin: register every slot segment the ring maps with CUDA (cudaHostRegister), once;
            the CUDA runtime must be loaded (``fastfeed._pinning.enable``).
        numa_node: the node the ring's memory belongs on (workers bind what they create).
        device: the CUDA device index registration happens under (-1: the default device).
    """

    def __init__(self, quiet: int, pin: bool = False, numa_node: int | None = None, device: int = -1):
        global _reclaimed
        if not _reclaimed:
            # Once per process: segments of fastfeed processes that were killed
            # (and so never cleaned up) would otherwise fill /dev/shm for good.
            _reclaimed = True
            segments.reclaim()
        self.prefix = segments.new_prefix()
        # Unlinks the ring's names even if it is never closed cleanly.
        self._finalizer = weakref.finalize(self, _sweep_in, os.getpid(), self.prefix)
        self.control = Control.create(self.prefix)
        self._slots: list[Slot] = []
        self.set_quiet(quiet)
        self.pin = pin
        self.numa_node = numa_node
        self.device = device
        self._pinner = pinner.for_device(device) if pin else None
        # The process's pinner keeps every failure; this ring reports (once) only those after it was made.
        self._failures_seen = 0 if self._pinner is None else len(self._pinner.failures)
        # Set by each iterator: guards pinned slots the user copies from (fence.py); None when nothing does.
        self.fence = None
        # (fence, event, slot id, segment) of pinned slots whose last view died while a copy may still read them.
        # Appended from whichever thread drops a view, taken by poll(): deque appends and pops are atomic.
        self._fenced: collections.deque = collections.deque()
        # A ring collected with copies still reading its slots waits for them before its segments are unmapped.
        weakref.finalize(self, _settle, self._fenced)
        # Slots some tensor views. Leases discard from whichever thread drops the last
        # view; set.add and set.discard are atomic under the GIL, so no lock is needed.
        self._lent: set[int] = set()
        self._warned = False
        self._failed = False  # a registration failed, and the ring said so
        self.in_use = False  # an iterator's workers are writing into it

    def fits(self, pin: bool, numa_node: int | None, device: int = -1) -> bool:
        """Whether an iterator with these needs can take this ring over."""
        same = (pin, numa_node, device if pin else -1) == (self.pin, self.numa_node, self.device if self.pin else -1)
        return not self.in_use and same and self._finalizer.alive

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
        seg = segments.attach(made, populate=False)
        if slot_id is not None:  # the claimed slot was too small: the new segment replaces it
            slot = self._slots[slot_id]
            segments.unlink(slot.segment.name)  # its mapping lives on while anything views it
            old, slot.segment = slot.segment, seg
            if self._pinner is not None:  # claimed, so free: no view and no copy reads it
                self._pinner.unpin(old)
            del old
        elif len(self._slots) < MAX_SLOTS:
            slot = Slot(len(self._slots), seg)
            self._slots.append(slot)
            self._warn_if_kept()
        else:
            segments.unlink(made)  # mapped now; the name is no longer needed
            return seg
        if self._pinner is not None:
            self._pinner.pin(seg)
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
        # Slots held only until a copy has read them are the pinned path's, not the user's keeping.
        if len(self._slots) - len(self._fenced) > self.quiet and not self._warned:
            self._warned = True
            warnings.warn(
                f"fastfeed's ring of batch slots is growing past the {self.quiet} slots this loader needs: "
                "earlier batches are still referenced (for example by list(loader)), so every new batch "
                "takes new memory. Drop references to old batches (or .clone() what you keep) to keep "
                "memory flat.",
                RingGrowthWarning,
                stacklevel=6,
            )

    def segment(self, slot_id: int):
        """The segment of slot ``slot_id`` (what a worker thread writes into, mapped once)."""
        return self._slots[slot_id].segment

    def lend(self, memory) -> torch.Tensor:
        """A uint8 tensor over a slot (or one-off segment) from ``receive``; a slot is freed when it and all its views die."""
        if not isinstance(memory, Slot):
            return torch.frombuffer(memory, dtype=torch.uint8)
        slot_id, lent, control, segment = memory.slot_id, self._lent, self.control, memory.segment
        fence, fenced = self.fence, self._fenced  # set only on a pinned ring
        lent.add(slot_id)

        def free():
            if fence is not None:
                try:
                    fenced.append((fence, fence.record(), slot_id, segment))  # stays in `lent` until poll()
                    return
                except Exception:  # noqa: BLE001 - CUDA torn down (exit) or broken: nothing copies any more
                    pass
            lent.discard(slot_id)
            control.release(slot_id)

        return torch.frombuffer(C.Lease(memory.segment, free), dtype=torch.uint8)

    def poll(self) -> None:
        """Free the fenced slots whose copies have completed, and report failed registrations (never waits)."""
        fenced = self._fenced
        for _ in range(len(fenced)):
            entry = fenced.popleft()
            if entry[0].done(entry[1]):
                self._lent.discard(entry[2])
                self.control.release(entry[2])
            else:
                fenced.append(entry)
        if self._pinner is not None and not self._failed and len(self._pinner.failures) > self._failures_seen:
            self._failed = True
            warnings.warn(
                f"fastfeed could not register a ring segment with CUDA ({self._pinner.failures[-1]}); batches "
                "in such segments are not pinned, and pin_memory=True copies them into pinned memory as torch "
                "does. Locked memory may be exhausted (ulimit -l), or the GPU virtualised.",
                RuntimeWarning,
                stacklevel=4,
            )

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
        _settle(self._fenced)
        self._slots.clear()


def _sweep_in(owner: int, prefix: str) -> None:
    # A forked child's copy of the ring dies there too: the names are the parent's to unlink.
    if os.getpid() == owner:
        segments.sweep(prefix)


def _settle(fenced: collections.deque) -> None:
    """Wait for the copies that still read fenced slots, then let their segments go."""
    while fenced:
        fence, event, _, _ = fenced.popleft()
        try:
            fence.wait(event)
        except Exception:  # noqa: BLE001 - at exit CUDA may be gone already, and the copies with it
            pass
