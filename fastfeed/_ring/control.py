"""The ring's control block: which slots are free, and where each one lives.

One small shared-memory segment per ring, made by the main process, mapped by every
worker. Its layout, declared once here::

    offset 0                 free bitmap: WORDS little-endian uint64, bit k set while slot k is free
    offset BITMAP_BYTES      header: two uint64, the number of slot segments workers have made
                             (each adds one as it makes one), and the number at which a worker
                             that finds no slot free waits briefly for one (WAIT_S) before it
                             makes another
    offset TABLE             MAX_SLOTS entries of ENTRY_BYTES: the slot segment's name suffix
                             (SUFFIX_LEN ASCII hex characters after the ring's prefix), then its
                             size in bytes (uint64)

Only the main process writes entries, and always before it sets the slot's bit; a
worker reads an entry only after it has claimed that bit (claim and release order
memory: ``csrc/freelist.h``). Entries are parsed as fixed fields, never unpickled.
"""

from __future__ import annotations

import struct
import time
from typing import NamedTuple

from .._native import C
from . import segments

MAX_SLOTS = 1024  # beyond this many batches alive at once, a batch gets a one-off segment
WORDS = MAX_SLOTS // 64
BITMAP_BYTES = WORDS * 8
SUFFIX_LEN = 16  # segments.create names a segment prefix + 16 hex characters
_HEADER = struct.Struct("<QQ")
_WORD = struct.Struct("<Q")
TABLE = BITMAP_BYTES + 64
_ENTRY = struct.Struct(f"<{SUFFIX_LEN}sQ")
ENTRY_BYTES = 32
SIZE = TABLE + MAX_SLOTS * ENTRY_BYTES
# A loop frees its previous batch just after it gets the next one, microseconds after the
# worker may have been sent a new task: waiting this long for that slot, rather than making
# one more, keeps the ring at the batches torch holds. On a busy machine the loop can be off
# the CPU for tens of milliseconds (at 2 ms, two busy processes on two cores grew the ring and
# raised the "batches kept" warning). The wait is paid once per slot the ring grows by, and a
# worker with no slot has nothing else to do.
WAIT_S = 0.05


class Claimed(NamedTuple):
    """A slot a worker took from the free list: its id, segment name and size."""

    slot_id: int
    name: str
    size: int


class Control:
    """A mapped control block (``create`` in the main process, ``attach`` in a worker)."""

    def __init__(self, segment, prefix: str):
        self.segment = segment  # kept: the bitmap's address is only valid while it is mapped
        self.prefix = prefix
        self._view = memoryview(segment)
        self._words = segment.address

    @classmethod
    def create(cls, prefix: str) -> Control:
        return cls(segments.create(prefix, segments.pages(SIZE)), prefix)  # tmpfs pages start zeroed: none free

    @classmethod
    def attach(cls, name: str, prefix: str) -> Control:
        return cls(segments.attach(name), prefix)

    @property
    def name(self) -> str:
        return self.segment.name

    def claim(self) -> Claimed | None:
        """Take the lowest free slot, or None when every slot is in use.

        With exactly as many slots made as the ring's ``wait_at``, wait up to WAIT_S for one
        to be freed first. A ring that has grown past that holds batches the user keeps: no
        slot is coming back soon, so there is no waiting.
        """
        slot_id = C.claim_bit(self._words, WORDS)
        if slot_id < 0:
            count, wait_at = _HEADER.unpack_from(self._view, BITMAP_BYTES)
            if count != wait_at:
                return None
            deadline = time.monotonic() + WAIT_S
            while slot_id < 0 and time.monotonic() < deadline:
                time.sleep(WAIT_S / 20)
                slot_id = C.claim_bit(self._words, WORDS)
            if slot_id < 0:
                return None
        suffix, size = _ENTRY.unpack_from(self._view, TABLE + slot_id * ENTRY_BYTES)
        return Claimed(slot_id, self.prefix + suffix.decode("ascii"), size)

    def release(self, slot_id: int) -> None:
        """Put slot ``slot_id`` back on the free list."""
        C.release_bit(self._words, slot_id)

    def publish(self, slot_id: int, name: str, size: int) -> None:
        """Record where slot ``slot_id`` lives (main process only; before its bit is set)."""
        suffix = name[len(self.prefix):]
        if not name.startswith(self.prefix) or len(suffix) != SUFFIX_LEN:
            raise ValueError(f"segment {name!r} is not named under the ring's prefix {self.prefix!r}")
        _ENTRY.pack_into(self._view, TABLE + slot_id * ENTRY_BYTES, suffix.encode("ascii"), size)

    def made_one(self) -> None:
        """Count a new slot segment (by the worker that makes it, before the ring adopts it)."""
        C.add_count(self._words + BITMAP_BYTES, 1)

    def set_wait_at(self, wait_at: int) -> None:
        """Set the number of slots made at which a worker waits for a free one (main process only)."""
        _WORD.pack_into(self._view, BITMAP_BYTES + 8, wait_at)

    def is_free(self, slot_id: int) -> bool:
        word = int.from_bytes(self._view[slot_id // 64 * 8 : slot_id // 64 * 8 + 8], "little")
        return bool(word >> (slot_id % 64) & 1)
