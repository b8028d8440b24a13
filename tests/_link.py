"""What the Ray link's tests share: a ring, and a writer over it that remembers what it claimed and gave back."""

from __future__ import annotations

import pytest

from fastfeed._ring.ring import Ring
from fastfeed._workers.loop import SlotWriter


class RecordingWriter(SlotWriter):
    """The main process's writer over ``ring``, remembering what it claimed and what it was given back."""

    def __init__(self, ring: Ring):
        super().__init__(ring.control, lambda claimed: ring.segment(claimed.slot_id), ring.numa_node)
        self.claims: list[tuple] = []
        self.abandoned: list[tuple] = []

    def claim(self, nbytes):
        got = super().claim(nbytes)
        self.claims.append(got[:2])
        return got

    def abandon(self, slot_id, made):
        self.abandoned.append((slot_id, made))
        super().abandon(slot_id, made)


@pytest.fixture
def ring():
    r = Ring(quiet=16)  # room for every frame of a test at once: the ring has no reason to warn
    yield r
    r.close()


@pytest.fixture
def writer(ring):
    return RecordingWriter(ring)
